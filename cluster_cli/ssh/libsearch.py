"""Import asyncssh without running a compiler.

When it is imported, asyncssh looks for liboqs (for the sntrup761 post-quantum key
exchange) and for nettle (UMAC) with ``ctypes.util.find_library``. On Linux that runs
``ldconfig -p`` for each and, when a library is not installed (liboqs usually is not),
``gcc`` and ``ld`` as well: about 45 ms of wall time and 35 ms of CPU in child processes
on every ``discover`` (bench/README.md, Discovery). While asyncssh is imported, :func:`quick_find_library` answers the lookup for
those names by looking in the dynamic loader's directories instead, and leaves every
other lookup to ctypes.
"""

from __future__ import annotations

import ctypes.util
import functools
import glob
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

# The names asyncssh asks for (asyncssh/crypto/pq.py and umac.py).
ASYNCSSH_LIBS = frozenset({"oqs", "liboqs", "nettle"})


def loader_dirs() -> list[str]:
    """The directories the dynamic loader searches: LD_LIBRARY_PATH, ld.so.conf(.d), defaults."""
    dirs = [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d]
    for conf in ["/etc/ld.so.conf", *sorted(glob.glob("/etc/ld.so.conf.d/*.conf"))]:
        try:
            text = Path(conf).read_text(errors="replace")
        except OSError:
            continue
        for line in text.splitlines():
            line = line.split("#", 1)[0].strip()
            if line.startswith("/"):
                dirs.append(line)
    arch = getattr(sys.implementation, "_multiarch", "")
    if arch:
        dirs += [f"/lib/{arch}", f"/usr/lib/{arch}"]
    dirs += ["/lib64", "/usr/lib64", "/lib", "/usr/lib", "/usr/local/lib"]
    return list(dict.fromkeys(dirs))


def _version(path: str) -> tuple[int, ...]:
    tail = path.rsplit(".so", 1)[1].lstrip(".")
    return tuple(int(p) for p in tail.split(".") if p.isdigit())


def _elf_id(path: str) -> bytes | None:
    """ELF class, byte order and machine of a file (what the loader checks), or None."""
    try:
        with open(path, "rb") as f:
            head = f.read(20)
    except OSError:
        return None
    if len(head) < 20 or head[:4] != b"\x7fELF":
        return None
    return head[4:6] + head[18:20]


@functools.cache
def _own_elf_id() -> bytes | None:
    return _elf_id(os.path.realpath(sys.executable))


def _loadable(path: str) -> bool:
    """A file (not a dangling link) built for this interpreter's ELF class and machine."""
    own = _own_elf_id()
    mine = _elf_id(path)
    return mine is not None and (own is None or mine == own)


def find_in_dirs(name: str, dirs: list[str]) -> str | None:
    """The path of a loadable ``lib<name>.so*`` in the first directory that has one, else None.

    Like the loader, skip files of another architecture (an i386 multiarch copy) or
    dangling links, and prefer a versioned file (``libX.so.8``, the highest) over the bare
    development link ``libX.so``.
    """
    for d in dirs:
        found = [p for p in glob.glob(os.path.join(glob.escape(d), f"lib{glob.escape(name)}.so*")) if _loadable(p)]
        if found:
            return max(found, key=lambda p: (bool(_version(p)), _version(p), p))
    return None


@contextmanager
def quick_find_library(names: frozenset[str] = ASYNCSSH_LIBS) -> Iterator[None]:
    """Within the block, ``ctypes.util.find_library(n)`` for ``n`` in ``names`` spawns nothing."""
    if not sys.platform.startswith("linux"):
        yield
        return
    original = ctypes.util.find_library
    dirs: list[str] = []  # read once per block, on the first lookup

    def find_library(name: str) -> str | None:
        if name not in names:
            return original(name)
        if not dirs:
            dirs.extend(loader_dirs())
        return find_in_dirs(name, dirs)

    ctypes.util.find_library = find_library
    try:
        yield
    finally:
        ctypes.util.find_library = original


def import_asyncssh() -> ModuleType:
    """``import asyncssh`` with the quick lookup; should a library it found fail to load
    anyway, import again the slow way rather than fail."""
    try:
        with quick_find_library():
            import asyncssh
    except OSError:
        for mod in [m for m in sys.modules if m == "asyncssh" or m.startswith("asyncssh.")]:
            del sys.modules[mod]
        import asyncssh
    return asyncssh
