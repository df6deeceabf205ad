"""Importing asyncssh through cluster_cli spawns no ldconfig/gcc/ld, and still finds libraries."""

from __future__ import annotations

import ctypes.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cluster_cli.ssh import libsearch
from cluster_cli.ssh.libsearch import find_in_dirs, loader_dirs, quick_find_library

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ctypes lookup differs elsewhere")


def elf(path, *, bits32: bool = False) -> None:
    """A file with this interpreter's ELF header (or a 32-bit one): what the loader looks at."""
    head = bytearray(Path(os.path.realpath(sys.executable)).read_bytes()[:64])
    if bits32:
        head[4] = 1
    Path(path).write_bytes(bytes(head))


def test_find_in_dirs_prefers_first_dir_and_highest_version(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    assert find_in_dirs("foo", [str(a), str(b)]) is None
    for name in ("libfoo.so", "libfoo.so.2", "libfoo.so.10", "libfoobar.so.99"):
        elf(b / name)
    assert find_in_dirs("foo", [str(a), str(b)]) == str(b / "libfoo.so.10")
    (a / "libfoo.so.1").symlink_to(tmp_path / "gone")  # dangling: the loader could not open it
    elf(a / "libfoo.so.3", bits32=True)  # another architecture (an i386 multiarch copy)
    (a / "libfoo.so.4").write_bytes(b"not an ELF file")
    assert find_in_dirs("foo", [str(a), str(b)]) == str(b / "libfoo.so.10")
    elf(a / "libfoo.so")
    assert find_in_dirs("foo", [str(a), str(b)]) == str(a / "libfoo.so")  # the first directory wins
    assert find_in_dirs("fo[o]", [str(b)]) is None  # a name is not a pattern


def test_loader_dirs_start_with_ld_library_path(monkeypatch, tmp_path):
    monkeypatch.setenv("LD_LIBRARY_PATH", f"{tmp_path}::/nonexistent")
    dirs = loader_dirs()
    assert dirs[:2] == [str(tmp_path), "/nonexistent"]
    assert len(dirs) == len(set(dirs))


@linux_only
def test_quick_find_library_answers_listed_names_without_processes(monkeypatch, tmp_path):
    elf(tmp_path / "liboqs.so.7")
    monkeypatch.setenv("LD_LIBRARY_PATH", str(tmp_path))
    spawned: list = []
    real_popen = subprocess.Popen

    class Spy(real_popen):  # type: ignore[misc, valid-type]
        def __init__(self, *a, **k):
            spawned.append(a[0] if a else k.get("args"))
            super().__init__(*a, **k)

    monkeypatch.setattr(subprocess, "Popen", Spy)
    original = ctypes.util.find_library
    with quick_find_library():
        assert ctypes.util.find_library("oqs") == str(tmp_path / "liboqs.so.7")
        assert ctypes.util.find_library("liboqs") is None  # it would be libliboqs.so*
        assert spawned == []
        # Any other name still goes to ctypes' own lookup.
        ctypes.util.find_library("c")
        assert spawned  # ctypes' lookup ran ldconfig
    assert ctypes.util.find_library is original


@pytest.mark.slow
@linux_only
def test_importing_the_ssh_layer_runs_no_programs():
    # A fresh interpreter: asyncssh is imported there for the first time.
    code = textwrap.dedent(
        """
        import subprocess
        spawned = []
        real = subprocess.Popen.__init__
        def spy(self, *a, **k):
            spawned.append(a[0] if a else k.get("args"))
            return real(self, *a, **k)
        subprocess.Popen.__init__ = spy
        import cluster_cli.ssh.connect
        from asyncssh.mac import get_mac_algs
        import ctypes.util
        print(repr(spawned))
        print(any(b"umac" in a for a in get_mac_algs()) == bool(ctypes.util.find_library("nettle")))
        print(ctypes.util.find_library.__module__)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    spawned, umac_consistent, module = out.stdout.split("\n")[:3]
    assert spawned == "[]", f"importing the SSH layer ran {spawned}"
    assert umac_consistent == "True"  # nettle is found exactly when ctypes would find it
    assert module == "ctypes.util"  # restored afterwards
    assert {"oqs", "liboqs", "nettle"} <= libsearch.ASYNCSSH_LIBS


@pytest.mark.slow
@linux_only
def test_a_library_that_fails_to_load_anyway_falls_back_to_the_slow_import():
    code = textwrap.dedent(
        """
        import contextlib
        from cluster_cli.ssh import libsearch

        @contextlib.contextmanager
        def broken():
            raise OSError("cannot open shared object file")
            yield

        libsearch.quick_find_library = broken
        mod = libsearch.import_asyncssh()
        print(mod.__name__, hasattr(mod, "connect"))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["asyncssh", "True"]
