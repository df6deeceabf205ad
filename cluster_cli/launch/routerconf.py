"""The router config that ``up`` and ``down`` publish: every ready replica as an endpoint.

Written in exactly the format ``serve-router`` reads, atomically (a temporary file beside it,
fsynced, renamed over the old one), so a running router's live reload never reads half a
file. What else the file holds (a ``router:`` section of tunables) is kept.

An endpoint may carry the ``api_key`` its engine demands (``keys.replica_key``): the file is
therefore always written 0600, and one found open to others is closed on the next write.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from cluster_cli.engines import get_engine
from cluster_cli.errors import ConfigError
from cluster_cli.state.records import READY, UP, ReplicaRecord

if TYPE_CHECKING:
    from cluster_cli.config.catalog import Catalog


# libyaml where PyYAML has it: up and down read and write this file on every run.
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)

# How long a serve-router takes to see a new config: its default --watch-interval (1 s) and a
# margin. An endpoint taken out of the config is stopped only after this, so that the router
# sends it no new request meanwhile.
PICKUP_S = 1.5


def default_path(state_path: Path) -> Path:
    """``.clusterctl/router.yaml`` for ``.clusterctl/state.db``: beside the state."""
    return state_path.with_name("router.yaml")


Keys = Mapping[str, str] | Callable[[ReplicaRecord], str | None]


def render(records: Iterable[ReplicaRecord], cat: Catalog | None, keys: Keys | None = None) -> dict[str, Any]:
    """``engines`` (each one's metric mapping: the catalog's, else the adapter's) and ``models``
    (the ready replicas' endpoints, by model, in replica order).

    ``keys`` gives each endpoint the API key its engine demands, which the router sends it:
    a mapping of replica names (``MODEL/N``, as ``keys.published_keys`` makes) to keys, or a
    function of the record (``lambda rec: keys.record_key(secret, rec)``, which also tells
    generations apart). A replica it has no key for gets none (an engine started without one)."""
    models: dict[str, dict[str, Any]] = {}
    engines: dict[str, Any] = {}
    shown = [r for r in records if r.status == READY and r.desired == UP and r.endpoint]
    newest = {r.name: r.generation for r in sorted(shown, key=lambda r: r.generation)}
    for rec in sorted(shown, key=lambda r: (r.replica.model, r.replica.replica, r.generation)):
        eng = rec.replica.engine
        ep: dict[str, Any] = {"url": rec.endpoint, "engine": eng, "replica": label(rec, newest[rec.name])}
        key = _key_of(keys, rec)
        if key:
            ep["api_key"] = key
        models.setdefault(rec.replica.model, {"endpoints": []})["endpoints"].append(ep)
        if eng not in engines:
            cfg = cat.engines.get(eng) if cat is not None else None
            adapter = get_engine(eng)
            if cfg is not None and cfg.metrics is not None:
                engines[eng] = {"metrics": dict(cfg.metrics)}
            elif adapter is not None:
                engines[eng] = {"metrics": adapter.metrics.to_config()}
    return {"engines": engines, "models": models}


def label(rec: ReplicaRecord, newest: int) -> str:
    """The name the router knows ``rec`` by: ``MODEL/N``; while a newer generation of it
    serves beside it (a replacement made before the old one is stopped), ``MODEL/N.gG`` for
    the older (the router wants one name per upstream, and drains the old one by it)."""
    return rec.name if rec.generation >= newest else f"{rec.name}.g{rec.generation}"


def _key_of(keys: Keys | None, rec: ReplicaRecord) -> str | None:
    if keys is None:
        return None
    if callable(keys):
        return keys(rec)
    return keys.get(rec.name)


def write(path: Path, doc: dict[str, Any]) -> bool:
    """Replace the models and engines of the router config at ``path`` with ``doc``'s, keeping
    its other sections; atomically, as a 0600 file (it may hold engine keys). Whether the file
    changed. Raises ConfigError."""
    old: dict[str, Any] = {}
    try:
        text = path.read_text()
    except FileNotFoundError:
        text = ""
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the router config: {e.strerror or e}") from None
    if text.strip():
        try:
            loaded = yaml.load(text, Loader=_LOADER)
        except yaml.YAMLError:
            loaded = None
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: not a router config (not YAML mapping); move it away or pick --router-config")
        old = loaded
    merged = {**{k: v for k, v in old.items() if k not in ("engines", "models")}, **doc}
    body = "# Written by clusterctl up/down: the ready replicas. Other sections are kept.\n"
    body += yaml.dump(merged, Dumper=_DUMPER, sort_keys=False, default_flow_style=False)
    if body == text:
        # Unchanged: no rewrite (a watching router re-reads nothing); but a file an older
        # clusterctl left readable by others is closed now.
        with contextlib.suppress(OSError):
            if os.stat(path).st_mode & 0o077:
                os.chmod(path, 0o600)
        return False
    folder = path.parent if str(path.parent) else Path(".")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=folder)
    except OSError as e:
        raise ConfigError(f"{path}: cannot write the router config: {e.strerror or e}") from None
    try:
        with os.fdopen(fd, "w") as f:
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o600)  # (mkstemp's own mode, whatever the umask: said once more all the same)
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise ConfigError(f"{path}: cannot write the router config: {e.strerror or e}") from None
    with contextlib.suppress(OSError):  # the rename itself reaches the disk
        dfd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    return True
