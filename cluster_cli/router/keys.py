"""API keys: one per line in a file, checked as ``Authorization: Bearer KEY``.

Keys are kept only as SHA-256 digests in memory; a line may also hold a digest
already (``sha256:<64 hex>``) so the file need not contain the key itself. Blank
lines and ``#`` comments are ignored. Keys never reach logs or metrics.
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

from cluster_cli.errors import ConfigError


def digest(key: str | bytes) -> bytes:
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).digest()


class ApiKeys:
    def __init__(self, digests: set[bytes]) -> None:
        self._digests = frozenset(digests)

    def __len__(self) -> int:
        return len(self._digests)

    @classmethod
    def load(cls, path: Path | str, data: bytes | None = None) -> ApiKeys:
        """Keys from ``path`` (or ``data``, its bytes already read)."""
        path = Path(path)
        try:
            text = (path.read_bytes() if data is None else data).decode(
                "utf-8-sig"
            )  # an editor's BOM is not part of the first key
        except OSError as e:
            raise ConfigError(f"{path}: cannot read API keys: {e.strerror or e}") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path}: cannot read API keys: not UTF-8 text (byte {e.start})") from None
        out: set[bytes] = set()
        for n, raw in enumerate(text.splitlines(), 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            if line.startswith("sha256:"):
                hexd = line[7:]
                try:
                    d = bytes.fromhex(hexd)
                except ValueError:
                    d = b""
                if len(d) != 32:
                    raise ConfigError(f"{path}: line {n}: sha256: must be followed by 64 hex digits")
                out.add(d)
            elif any(c.isspace() for c in line):
                raise ConfigError(f"{path}: line {n}: a key may not contain spaces")
            else:
                out.add(digest(line))
        if not out:
            raise ConfigError(f"{path}: no API keys in the file")
        return cls(out)

    def check(self, authorization: bytes | None) -> bool:
        if not authorization or authorization[:7].lower() != b"bearer ":
            return False
        d = digest(authorization[7:].strip())
        return any(hmac.compare_digest(d, k) for k in self._digests) if len(self._digests) < 8 else d in self._digests
