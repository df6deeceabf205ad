"""The one-file binary's self-extracting header (packaging/header.sh, packed by
``scripts/build-dist.sh pack``), tried on a stand-in program instead of the PyInstaller
bundle: no build needed. The real binary is tested by ``scripts/dist-smoke.sh``
(``CLUSTERCTL_DIST_SMOKE=1`` runs it here, after ``make dist``).

What a user sees: the first run unpacks once, into a per-user cache, atomically (several
first runs at once leave one folder); later runs exec the cached program with the same
arguments, stdin and exit status; an unusable or noexec folder means a fallback or one
clear line naming CLUSTERCTL_CACHE_DIR; a host with too old a glibc gets one line too.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "scripts" / "build-dist.sh"
FAKE = """#!/bin/sh
# The stand-in for the PyInstaller program: its folder, its arguments, its stdin.
here=$(cd "$(dirname "$0")" && pwd)
printf 'dir=%s\\n' "$here"
for a in "$@"; do printf 'arg=[%s]\\n' "$a"; done
[ "${FAKE_STDIN:-}" = 1 ] && printf 'stdin=%s\\n' "$(cat)"
exit "${FAKE_RC:-0}"
"""

pytestmark = pytest.mark.skipif(
    not all(shutil.which(t) for t in ("bash", "tar", "gzip", "sha256sum")), reason="needs bash, tar, gzip, sha256sum"
)


def pack(tmp: Path, *, version: str = "9.9.9", glibc: str = "2.17", compress: str = "gz", name: str = "ctl") -> Path:
    onedir = tmp / f"onedir-{name}"
    (onedir / "_internal").mkdir(parents=True, exist_ok=True)
    (onedir / "_internal" / "data.txt").write_text("payload\n" * 1000)
    prog = onedir / "clusterctl"
    prog.write_text(FAKE)
    prog.chmod(0o755)
    out = tmp / "bin" / name
    out.parent.mkdir(exist_ok=True)
    env = {**os.environ, "DIST_COMPRESS": compress}
    subprocess.run(["bash", str(BUILD), "pack", str(onedir), str(out), version, glibc], check=True, env=env)
    return out


def run(binary: Path, *args: str, env: dict[str, str], stdin: str = "", sh: list[str] | None = None):
    return subprocess.run(
        [*(sh or []), str(binary), *args], env=env, input=stdin, capture_output=True, text=True, timeout=60
    )


@pytest.fixture
def home(tmp_path: Path) -> Path:
    h = tmp_path / "home"
    h.mkdir()
    return h


def clean_env(home: Path, **extra: str) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "HOME": str(home), **extra}


def cached(home: Path) -> list[Path]:
    base = home / ".cache" / "clusterctl" / "bin"
    return sorted(base.iterdir()) if base.is_dir() else []


SHELLS: list[list[str]] = [[]] + [[s] for s in ("dash", "bash", "mksh") if shutil.which(s)]
if shutil.which("busybox"):
    SHELLS.append(["busybox", "sh"])


@pytest.mark.parametrize("sh", SHELLS, ids=lambda s: " ".join(s) or "#!/bin/sh")
def test_first_run_unpacks_once_later_runs_exec_the_cache(tmp_path: Path, home: Path, sh: list[str]) -> None:
    binary = pack(tmp_path)
    env = clean_env(home)
    p = run(binary, "a b", "", "--x=1", env=env, sh=sh)
    assert p.returncode == 0, p.stderr
    (unpacked,) = cached(home)
    assert unpacked.name.startswith("9.9.9-")
    assert p.stdout.splitlines() == [f"dir={unpacked}", "arg=[a b]", "arg=[]", "arg=[--x=1]"]
    assert p.stderr == ""
    # A later run runs the unpacked program, not a new copy of it.
    (unpacked / "clusterctl").write_text('#!/bin/sh\necho cached "$@"\n')
    p = run(binary, "again", env=env, sh=sh)
    assert (p.returncode, p.stdout) == (0, "cached again\n")
    assert cached(home) == [unpacked]


def test_exit_status_and_stdin_reach_the_program(tmp_path: Path, home: Path) -> None:
    binary = pack(tmp_path)
    for _ in range(2):  # the unpacking run and a cached one
        p = run(binary, env=clean_env(home, FAKE_RC="7", FAKE_STDIN="1"), stdin="hello from stdin")
        assert p.returncode == 7
        assert "stdin=hello from stdin" in p.stdout


@pytest.mark.parametrize("compress", ["gz", "none", "xz"])
def test_payload_formats(tmp_path: Path, home: Path, compress: str) -> None:
    if compress == "xz" and not shutil.which("xz"):
        pytest.skip("no xz")
    binary = pack(tmp_path, compress=compress)
    p = run(binary, "x", env=clean_env(home))
    assert p.returncode == 0, p.stderr
    assert (cached(home)[0] / "_internal" / "data.txt").read_text() == "payload\n" * 1000


def test_packing_is_reproducible_and_the_id_names_the_payload(tmp_path: Path) -> None:
    a = pack(tmp_path, name="a").read_bytes()
    b = pack(tmp_path, name="b").read_bytes()
    assert a == b
    assert a.startswith(b"#!/bin/sh\n")
    header = a.split(b"\noff=", 1)[1]
    off = int(header.split(b"\n", 1)[0])
    assert hashlib.sha256(a[off - 1 :]).hexdigest()[:16].encode() in a[:off]


def test_several_first_runs_at_once_leave_one_folder(tmp_path: Path, home: Path) -> None:
    binary = pack(tmp_path)
    env = clean_env(home)
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda i: run(binary, str(i), env=env), range(8)))
    assert [r.returncode for r in results] == [0] * 8, [r.stderr for r in results]
    base = home / ".cache" / "clusterctl" / "bin"
    (only,) = os.listdir(base)  # no temporary folders or probe files left
    for i, r in enumerate(results):
        assert r.stdout.splitlines() == [f"dir={base / only}", f"arg=[{i}]"]


def test_cache_dir_setting_and_fallbacks(tmp_path: Path, home: Path) -> None:
    binary = pack(tmp_path)
    given = tmp_path / "given"
    p = run(binary, env=clean_env(home, CLUSTERCTL_CACHE_DIR=str(given)))
    assert p.returncode == 0, p.stderr
    assert len(os.listdir(given)) == 1 and cached(home) == []
    # No usable HOME (a file): $TMPDIR/clusterctl-UID.
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    p = run(binary, env=clean_env(not_a_dir, TMPDIR=str(tmpdir)))
    assert p.returncode == 0, p.stderr
    assert os.listdir(tmpdir) == [f"clusterctl-{os.getuid()}"]
    # Neither: the folder beside the binary.
    p = run(binary, env=clean_env(not_a_dir, TMPDIR=str(not_a_dir)))
    assert p.returncode == 0, p.stderr
    assert (binary.parent / ".clusterctl-bin").is_dir()


def test_unusable_cache_dir_is_one_clear_line(tmp_path: Path, home: Path) -> None:
    binary = pack(tmp_path)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    p = run(binary, env=clean_env(home, CLUSTERCTL_CACHE_DIR=str(blocker / "cache")))
    assert p.returncode == 1 and p.stdout == ""
    (line,) = p.stderr.splitlines()
    assert line.startswith("clusterctl: cannot unpack itself") and "CLUSTERCTL_CACHE_DIR" in line
    assert f"{blocker}/cache (cannot create)" in line


def noexec_dir(tmp_path: Path) -> Path | None:
    """A tmpfs mounted noexec (root only), or None."""
    if os.geteuid() != 0 or not shutil.which("mount"):
        return None
    d = tmp_path / "noexec"
    d.mkdir()
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "noexec,size=16m", "tmpfs", str(d)], capture_output=True
    ).returncode:
        return None
    return d


def test_noexec_folders_are_skipped_or_named(tmp_path: Path, home: Path) -> None:
    d = noexec_dir(tmp_path)
    if d is None:
        pytest.skip("needs root to mount a noexec tmpfs")
    try:
        binary = pack(tmp_path)
        tmpdir = tmp_path / "tmp"
        tmpdir.mkdir()
        # HOME on the noexec mount: skipped for $TMPDIR.
        (d / "home").mkdir()
        p = run(binary, env=clean_env(d / "home", TMPDIR=str(tmpdir)))
        assert p.returncode == 0, p.stderr
        assert os.listdir(tmpdir) == [f"clusterctl-{os.getuid()}"]
        # The folder given is noexec: one line, nothing left on the mount but the empty folder.
        p = run(binary, env=clean_env(home, CLUSTERCTL_CACHE_DIR=str(d / "cache")))
        assert p.returncode == 1
        (line,) = p.stderr.splitlines()
        assert "programs cannot run there: noexec mount?" in line and "CLUSTERCTL_CACHE_DIR" in line
        assert os.listdir(d / "cache") == []
    finally:
        subprocess.run(["umount", str(d)], check=False)


def test_someone_elses_tmp_folder_is_not_used(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to make a folder another user owns")
    binary = pack(tmp_path)
    tmpdir = tmp_path / "tmp"
    (tmpdir / f"clusterctl-{os.getuid()}").mkdir(parents=True)
    os.chown(tmpdir / f"clusterctl-{os.getuid()}", 65534, 65534)
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    p = run(binary, env=clean_env(not_a_dir, TMPDIR=str(tmpdir)))
    assert p.returncode == 0, p.stderr
    assert "/.clusterctl-bin/" in p.stdout  # went on to the folder beside the binary


def test_too_old_glibc_is_one_clear_line(tmp_path: Path, home: Path) -> None:
    binary = pack(tmp_path, glibc="2.36")
    fake = tmp_path / "fakebin"
    fake.mkdir()
    getconf = fake / "getconf"
    getconf.write_text('#!/bin/sh\necho "glibc 2.17"\n')
    getconf.chmod(0o755)
    p = run(binary, env={**clean_env(home), "PATH": f"{fake}:/usr/bin:/bin"})
    assert p.returncode == 1 and cached(home) == []
    (line,) = p.stderr.splitlines()
    assert "needs glibc 2.36 or newer; this host has 2.17" in line
    getconf.write_text('#!/bin/sh\necho "glibc 2.40"\n')
    assert run(binary, env={**clean_env(home), "PATH": f"{fake}:/usr/bin:/bin"}).returncode == 0


@pytest.mark.slow
@pytest.mark.testbed
@pytest.mark.llama
@pytest.mark.skipif(os.environ.get("CLUSTERCTL_DIST_SMOKE") != "1", reason="CLUSTERCTL_DIST_SMOKE=1 (after make dist)")
def test_the_built_binary_passes_the_smoke_test() -> None:
    binary = ROOT / "dist" / "clusterctl"
    assert binary.is_file(), "make dist first"
    p = subprocess.run(["bash", str(ROOT / "scripts" / "dist-smoke.sh"), str(binary)], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
