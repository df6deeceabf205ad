"""Tests for cluster_cli.probe.parsers.host (nproc, /proc/meminfo)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster_cli.probe.parsers.host import parse_meminfo, parse_nproc

FIXTURES = Path(__file__).parent / "fixtures" / "probes"
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def fx(name: str) -> str:
    return (FIXTURES / name).read_text()


def test_nproc_fixture() -> None:
    assert parse_nproc(fx("nproc.xeon6430-2s-container.DERIVED.txt")) == 64


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("64\n", 64),
        ("  8  \r\n", 8),
        ("\n\n1\n", 1),
        ("0\n", None),
        ("-4\n", None),
        ("4.0\n", None),
        ("", None),
        ("bash: line 1: nproc: command not found\n", None),
        ("nproc: invalid option -- 'x'\n64\n", None),
        ("١٢\n", None),  # non-ASCII digits
        ("9" * 5000, None),
    ],
)
def test_nproc_cases(text: str, expected: int | None) -> None:
    assert parse_nproc(text) == expected


def test_meminfo_fixture() -> None:
    assert parse_meminfo(fx("proc-meminfo.16gb-host.txt")) == 16201888 // 1024 == 15822


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("MemTotal:       16201888 kB\n", 15822),
        ("MemFree: 1 kB\nMemTotal: 2097152 kB\r\n", 2048),
        ("MemTotal:\t1048576\n", 1024),
        ("MemTotal: 1023 kB\n", None),
        ("MemTotal: lots kB\n", None),
        ("MemTotalX: 1048576 kB\n", None),
        ("HugePages_Total:       0\n", None),
        ("", None),
        ("cat: /proc/meminfo: No such file or directory\n", None),
    ],
)
def test_meminfo_cases(text: str, expected: int | None) -> None:
    assert parse_meminfo(text) == expected


def test_meminfo_ignores_other_lines_of_fixture() -> None:
    """Only MemTotal counts: dropping it leaves nothing, even though other kB lines remain."""
    text = "\n".join(ln for ln in fx("proc-meminfo.16gb-host.txt").splitlines() if not ln.startswith("MemTotal"))
    assert parse_meminfo(text) is None


@FUZZ
@given(st.integers(1, 10**6), st.sampled_from(["\n", "\r\n", ""]))
def test_nproc_roundtrip(n: int, end: str) -> None:
    assert parse_nproc(f"{n}{end}") == n


@FUZZ
@given(st.integers(1024, 2**50), st.sampled_from(["\t", " ", "        "]))
def test_meminfo_roundtrip(kb: int, sep: str) -> None:
    assert parse_meminfo(f"MemFree: 5 kB\nMemTotal:{sep}{kb} kB\n") == kb // 1024


@FUZZ
@given(st.text())
def test_never_raises(text: str) -> None:
    n = parse_nproc(text)
    m = parse_meminfo(text)
    assert n is None or n > 0
    assert m is None or m > 0


@FUZZ
@given(st.sampled_from(["proc-meminfo.16gb-host.txt", "nproc.xeon6430-2s-container.DERIVED.txt"]), st.data())
def test_never_raises_on_truncated_fixtures(name: str, data: st.DataObject) -> None:
    text = fx(name)
    i = data.draw(st.integers(0, len(text)))
    j = data.draw(st.integers(i, len(text)))
    for variant in (text[:i], text[:i] + text[j:], text[i:]):
        parse_nproc(variant)
        parse_meminfo(variant)


def test_non_string_input() -> None:
    assert parse_nproc(None) is None and parse_meminfo(None) is None  # type: ignore[arg-type]
