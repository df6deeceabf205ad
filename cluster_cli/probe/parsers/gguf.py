"""The shape of a model from the first bytes of its GGUF file (llama.cpp's format).

Pure: bytes in, :class:`GgufShape` out. The node sends only the file's beginning (the
metadata comes before the tensor data; a large vocabulary can push the tokenizer's arrays
past what was read), so a truncated header is read as far as it goes and what was not
reached stays unknown. The weights' size is the file's size, which the node reports with it.

Format (version 2 and 3, little-endian): ``GGUF``, u32 version, u64 tensor count, u64
key/value count, then each key (u64 length, UTF-8), a u32 value type and the value.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

MAGIC = b"GGUF"
# value type -> struct format of a scalar (8 string, 9 array are read apart)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_MAX_KEY = 1 << 16  # no key is this long: the bytes are not a GGUF header


class GgufError(ValueError):
    """Not a GGUF file (bad magic or version), or a header that makes no sense."""


@dataclass(frozen=True)
class GgufShape:
    """What the header says (None: not reached or not given)."""

    version: int
    architecture: str | None = None
    block_count: int | None = None  # layers
    context_length: int | None = None  # trained context
    embedding_length: int | None = None
    head_count: int | None = None
    head_count_kv: int | None = None
    key_length: int | None = None  # per head, where it is not embedding_length / head_count
    value_length: int | None = None
    expert_count: int | None = None
    file_type: int | None = None  # llama.cpp's LLAMA_FTYPE (1 F16, 7 Q8_0, 15 Q4_K_M, ...)
    complete: bool = False  # every key/value pair was read

    def kv_bytes_per_token(self, bytes_per_element: float = 2.0) -> int | None:
        """K and V of one token across every layer, at ``bytes_per_element`` (f16 by default)."""
        layers, heads = self.block_count, self.head_count
        if layers is None or heads is None or heads <= 0:
            return None
        kv_heads = self.head_count_kv if self.head_count_kv is not None else heads
        k = self.key_length or (self.embedding_length // heads if self.embedding_length else None)
        v = self.value_length or k
        if k is None or v is None:
            return None
        return round(layers * kv_heads * (k + v) * bytes_per_element)


class _Reader:
    __slots__ = ("data", "pos")

    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise EOFError
        b = self.data[self.pos : self.pos + n]
        self.pos += n
        return b

    def scalar(self, fmt: str) -> int | float | bool:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = int(self.scalar("<Q"))
        if n > len(self.data):
            raise GgufError("a string longer than the file")
        return self.take(n).decode("utf-8", "replace")

    def value(self, vtype: int) -> object:
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            itype, count = int(self.scalar("<I")), int(self.scalar("<Q"))
            if itype in _SCALARS:  # skipped whole: a vocabulary's scores are 100k floats
                size = struct.calcsize(_SCALARS[itype])
                if count * size > len(self.data):
                    raise EOFError
                self.take(count * size)
                return None
            for _ in range(count):
                self.value(itype)
            return None
        raise GgufError(f"unknown GGUF value type {vtype}")


_FIELDS = {
    "block_count": "block_count",
    "context_length": "context_length",
    "embedding_length": "embedding_length",
    "attention.head_count": "head_count",
    "attention.head_count_kv": "head_count_kv",
    "attention.key_length": "key_length",
    "attention.value_length": "value_length",
    "expert_count": "expert_count",
}


def parse_gguf_header(data: bytes) -> GgufShape:
    """Read the shape from a GGUF file's first bytes (see the module's notes).

    Raises :class:`GgufError` for bytes that are not a GGUF file of version 2 or 3.
    """
    if len(data) < 24 or data[:4] != MAGIC:
        raise GgufError("not a GGUF file (no GGUF magic)")
    r = _Reader(data)
    r.take(4)
    version = int(r.scalar("<I"))
    if version not in (2, 3):
        raise GgufError(f"GGUF version {version} is not supported (2 or 3)")
    r.scalar("<Q")  # tensor count
    kv_count = int(r.scalar("<Q"))
    got: dict[str, object] = {}
    by_arch: dict[tuple[str, str], int] = {}  # (key prefix, field): the architecture may come later
    arch: str | None = None
    complete = False
    try:
        for _ in range(kv_count):
            n = int(r.scalar("<Q"))
            if n > _MAX_KEY:
                raise GgufError("a key longer than any GGUF key")
            key = r.take(n).decode("utf-8", "replace")
            value = r.value(int(r.scalar("<I")))
            if key == "general.architecture" and isinstance(value, str):
                arch = value
            elif key == "general.file_type" and isinstance(value, int) and not isinstance(value, bool):
                got["file_type"] = value
            elif "." in key:
                prefix, _, rest = key.partition(".")
                name = _FIELDS.get(rest)
                if name is not None and isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                    by_arch[(prefix, name)] = value
        complete = True
    except EOFError:
        pass  # truncated: what was read stands
    if arch is not None:
        got.update({name: v for (prefix, name), v in by_arch.items() if prefix == arch})
    return GgufShape(version=version, architecture=arch, complete=complete, **got)  # type: ignore[arg-type]
