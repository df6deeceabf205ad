"""Engine API keys: one per replica generation, derived from a cluster secret, never stored.

The secret is 32 random bytes in a 0600 file beside the state (``.clusterctl/state.secret``
for ``.clusterctl/state.db``), made on first use. A replica's key is
``ck-`` + hex(HMAC-SHA256(secret, model, replica, generation)): each generation has its own (a
replaced engine's key stops working with it), and any command that can read the secret
computes it again, so neither the state nor the inventory ever holds one. The engine gets its
key in its environment (``VLLM_API_KEY``, ``LLAMA_API_KEY``: see ``cluster_cli.engines``),
the router in its config (``routerconf.render(..., keys=)``).

The secret file is refused when anyone but its owner may read or write it (as ssh refuses a
private key that is "too open"), when another user owns it, or when it is not 32 bytes.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import os
import stat
import tempfile
from collections.abc import Iterable
from pathlib import Path

from cluster_cli.errors import StateError
from cluster_cli.state.records import READY, UP, ReplicaRecord

SECRET_BYTES = 32
KEY_PREFIX = "ck-"
_CONTEXT = b"clusterctl engine key v1"


def secret_path(state_path: Path) -> Path:
    """``STATE.secret`` beside the state: ``.clusterctl/state.secret`` for ``.clusterctl/state.db``."""
    p = state_path.with_suffix(".secret")
    return p if p != state_path else state_path.with_name(state_path.name + ".key")


def load_secret(path: Path) -> bytes:
    """The secret in ``path``. Raises FileNotFoundError when there is none, StateError when it
    cannot be used (readable or writable by others, another user's, not 32 bytes)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise StateError(f"{path}: the cluster secret is a symbolic link; refusing it") from None
        raise StateError(f"{path}: cannot read the cluster secret: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise StateError(f"{path}: the cluster secret is not a regular file")
        if st.st_mode & 0o077:
            raise StateError(
                f"{path}: the cluster secret is open to others (mode {stat.S_IMODE(st.st_mode):04o}); "
                f"it must be 0600: chmod 600 {path}"
            )
        if hasattr(os, "geteuid") and st.st_uid != os.geteuid():
            raise StateError(f"{path}: the cluster secret belongs to another user (uid {st.st_uid})")
        data = os.read(fd, SECRET_BYTES + 1)
    except OSError as e:
        raise StateError(f"{path}: cannot read the cluster secret: {e.strerror or e}") from None
    finally:
        os.close(fd)
    if len(data) != SECRET_BYTES:
        raise StateError(
            f"{path}: not a cluster secret ({len(data)} bytes, not {SECRET_BYTES}); "
            "move it away to make a new one (every engine key then changes: restart the replicas)"
        )
    return data


def ensure_secret(path: Path) -> bytes:
    """The secret in ``path``, made first if there is none: 32 random bytes written to a 0600
    temporary file beside it and linked into place, so that a reader never sees a partial file
    and two commands making it at once end up with the same one. Raises StateError."""
    try:
        return load_secret(path)
    except FileNotFoundError:
        pass
    folder = path.parent if str(path.parent) else Path(".")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=folder)  # 0600, whatever the umask
    except OSError as e:
        raise StateError(f"{path}: cannot create the cluster secret: {e.strerror or e}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(SECRET_BYTES))
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)  # fails if it exists: another command made it first, and that one is kept
        except FileExistsError:
            pass
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
                raise
            _create_exclusive(path, Path(tmp))  # a filesystem without hard links
    except OSError as e:
        raise StateError(f"{path}: cannot create the cluster secret: {e.strerror or e}") from None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    with contextlib.suppress(OSError):  # the new name reaches the disk
        dfd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    try:
        return load_secret(path)
    except FileNotFoundError:
        raise StateError(f"{path}: the cluster secret vanished as it was made") from None


def _create_exclusive(path: Path, tmp: Path) -> None:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return
    with os.fdopen(fd, "wb") as f:
        f.write(tmp.read_bytes())
        f.flush()
        os.fsync(f.fileno())


def replica_key(secret: bytes, model: str, replica: int, generation: int) -> str:
    """The API key of generation ``generation`` of replica ``model/replica``: ``ck-`` and 64 hex
    digits (no character that a header, a shell or llama-server's comma-separated key list
    would read otherwise)."""
    if len(secret) < 16:
        raise ValueError("the cluster secret is too short")
    msg = b"\0".join((_CONTEXT, model.encode(), str(int(replica)).encode(), str(int(generation)).encode()))
    return KEY_PREFIX + hmac.new(secret, msg, hashlib.sha256).hexdigest()


def record_key(secret: bytes, rec: ReplicaRecord) -> str:
    """``replica_key`` of a state record (its model, replica number and generation)."""
    return replica_key(secret, rec.replica.model, rec.replica.replica, rec.generation)


def published_keys(secret: bytes, records: Iterable[ReplicaRecord]) -> dict[str, str]:
    """``MODEL/N`` -> key, for each replica that ``routerconf.render`` publishes (ready, wanted
    up, with an endpoint), of the generation it publishes."""
    out: dict[str, str] = {}
    for rec in sorted(records, key=lambda r: (r.replica.model, r.replica.replica, r.generation)):
        if rec.status == READY and rec.desired == UP and rec.endpoint:
            out[rec.name] = record_key(secret, rec)
    return out
