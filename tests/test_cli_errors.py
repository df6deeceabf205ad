"""CLI bad input: one error line naming the file/field/node, the documented exit code, nothing written."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from cluster_cli.cli.main import app
from cluster_cli.state.store import Store

runner = CliRunner()


def inv(tmp_path: Path, body: str) -> Path:
    p = tmp_path / "inventory.yaml"
    p.write_text(body)
    return p


def run(tmp_path: Path, *args: str):
    return runner.invoke(app, ["--state", str(tmp_path / "state.db"), *args])


def error_lines(result) -> list[str]:
    return [line for line in result.output.splitlines() if line.strip()]


def test_version_and_help_examples() -> None:
    r = runner.invoke(app, ["--version"])
    assert r.exit_code == 0 and r.output.startswith("clusterctl ")
    for cmd in ("discover", "cordon", "uncordon"):
        r = runner.invoke(app, [cmd, "--help"])
        assert r.exit_code == 0
        assert "clusterctl " + cmd in r.output  # every --help shows an example


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ("nodes: [{name: a, host: h\n", "invalid YAML"),
        ("nodes:\n  - {name: a, host: h, bogus: 1}\n", "nodes.0.bogus: unknown key"),
        ("nodes:\n  - {name: a, host: h}\n  - {name: a, host: h2}\n", "duplicate node name"),
    ],
)
def test_discover_bad_inventory_exits_2(tmp_path: Path, body: str, needle: str) -> None:
    r = run(tmp_path, "discover", "-i", str(inv(tmp_path, body)))
    assert r.exit_code == 2
    lines = error_lines(r)
    assert len(lines) == 1 and needle in lines[0] and "inventory.yaml" in lines[0]
    assert not (tmp_path / "state.db").exists()


def test_discover_missing_identity_file_names_node(tmp_path: Path) -> None:
    (tmp_path / "kh").write_text("")
    body = "defaults: {identity_file: nokey, known_hosts: kh}\nnodes:\n  - {name: gpu-07, host: 198.18.0.77}\n"
    r = run(tmp_path, "discover", "-i", str(inv(tmp_path, body)))
    assert r.exit_code == 2
    (line,) = error_lines(r)
    assert "gpu-07" in line and "identity file not found" in line and "nokey" in line


def test_discover_missing_known_hosts(tmp_path: Path) -> None:
    (tmp_path / "id").write_text("x")
    body = "defaults: {identity_file: id, known_hosts: nofile}\nnodes:\n  - {name: gpu-07, host: 198.18.0.77}\n"
    r = run(tmp_path, "discover", "-i", str(inv(tmp_path, body)))
    assert r.exit_code == 2
    (line,) = error_lines(r)
    assert "known_hosts file not found" in line and "accept-new" in line


def test_discover_unknown_node_flag(tmp_path: Path) -> None:
    (tmp_path / "id").write_text("x")
    (tmp_path / "kh").write_text("")
    body = "defaults: {identity_file: id, known_hosts: kh}\nnodes:\n  - {name: a, host: 198.18.0.77}\n"
    r = run(tmp_path, "discover", "-i", str(inv(tmp_path, body)), "--node", "zz")
    assert r.exit_code == 2 and "'zz'" in r.output


def test_cordon_roundtrip_and_unknown_node(tmp_path: Path) -> None:
    p = inv(tmp_path, "nodes:\n  - {name: gpu-01, host: h}\n")
    r = run(tmp_path, "cordon", "nope", "-i", str(p), "--reason", "x")
    assert r.exit_code == 2 and "no node named 'nope'" in r.output
    assert not (tmp_path / "state.db").exists()
    r = run(tmp_path, "cordon", "gpu-01", "-i", str(p), "--reason", "fan failure")
    assert r.exit_code == 0, r.output
    with Store(tmp_path / "state.db") as s:
        assert s.cordons()["gpu-01"]["reason"] == "fan failure"
    r = run(tmp_path, "uncordon", "gpu-01", "-i", str(p))
    assert r.exit_code == 0
    with Store(tmp_path / "state.db") as s:
        assert s.cordons() == {}


def test_cordon_needs_reason(tmp_path: Path) -> None:
    p = inv(tmp_path, "nodes:\n  - {name: gpu-01, host: h}\n")
    r = run(tmp_path, "cordon", "gpu-01", "-i", str(p), "--reason", "  ")
    assert r.exit_code == 2


def test_corrupt_state_file(tmp_path: Path) -> None:
    p = inv(tmp_path, "nodes:\n  - {name: gpu-01, host: h}\n")
    (tmp_path / "state.db").write_bytes(b"this is not sqlite" * 100)
    r = run(tmp_path, "cordon", "gpu-01", "-i", str(p), "--reason", "x")
    assert r.exit_code == 2
    (line,) = error_lines(r)
    assert "state.db" in line and "not a usable state database" in line
