"""What the README and ``--help`` promise, checked against the CLI: a state path that cannot be
one, uncordon with no state, a cordon before the first discover recording its inventory, usage
errors naming the subcommand, and the plan's JSON using one key for a profile's attempts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_cli_place import write_inputs
from test_placement_clusters import a100_pcie, catalog, dgx, profile
from typer.testing import CliRunner

from cluster_cli.cli.main import app
from cluster_cli.placement import plan, render_plan
from cluster_cli.state.store import Store

runner = CliRunner()


@pytest.fixture(autouse=True)
def _no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CLUSTERCTL_INVENTORY", raising=False)
    monkeypatch.delenv("CLUSTERCTL_STATE", raising=False)


def _inventory(tmp_path: Path) -> Path:
    p = tmp_path / "inv.yaml"
    p.write_text("nodes:\n  - {name: h1, host: 198.18.0.250}\n  - {name: h2, host: 198.18.0.251}\n")
    return p


@pytest.mark.parametrize(
    "command", [["discover"], ["cordon", "h1", "-r", "x"], ["uncordon", "h1"], ["place", "--dry-run"]]
)
def test_a_state_path_that_is_a_folder_or_empty_is_one_line_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: list[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    inv = _inventory(tmp_path)
    (tmp_path / "file.db").write_text("")
    extra = ["-i", str(inv)] + (["-c", str(inv)] if command[0] == "place" else [])
    cases = {
        ".": "error: .: is a folder, not a state database file",
        str(tmp_path): f"error: {tmp_path}: is a folder, not a state database file",
        "": "error: empty state path (--state / CLUSTERCTL_STATE)",
        "file.db/state.db": "error: file.db/state.db: file.db is a file, not a folder",
    }
    for given, want in cases.items():
        r = runner.invoke(app, ["--state", given, *command, *extra])
        lines = [ln for ln in r.output.splitlines() if ln.strip()]
        assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith(want), (given, r.output)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.db", "inv.yaml"]  # nothing written


def test_uncordon_with_no_state_and_no_inventory_says_so_and_creates_nothing(tmp_path: Path) -> None:
    state = tmp_path / "none" / "state.db"
    r = runner.invoke(app, ["--state", str(state), "uncordon", "gpu-03"])
    assert r.exit_code == 0, r.output
    assert r.output.strip() == f"gpu-03 was not cordoned (no state at {state})"
    assert not state.parent.exists()


def test_a_cordon_before_the_first_discover_records_its_inventory(tmp_path: Path) -> None:
    """cordon -i on a new state records the inventory, so later commands need no -i, and
    uncordoning twice is a no-op the second time (as the README says), not an error."""
    inv = _inventory(tmp_path)
    state = tmp_path / "state.db"

    def cli(*args: str):
        return runner.invoke(app, ["--state", str(state), *args])

    assert cli("cordon", "h2", "-i", str(inv), "-r", "rack move").exit_code == 0
    with Store(state, readonly=True) as s:
        assert s.inventory() == inv.resolve()
    assert cli("cordon", "h1", "-r", "psu").exit_code == 0
    assert cli("uncordon", "h2").output.strip() == "h2 uncordoned"
    r = cli("uncordon", "h2")
    assert r.exit_code == 0 and r.output.strip() == "h2 was not cordoned"
    r = cli("uncordon", "h9")  # a typo is still caught, against the recorded inventory
    assert r.exit_code == 2 and "no node named 'h9'" in r.output
    # A later discover's inventory is not overridden by a cordon with another -i.
    other = tmp_path / "other.yaml"
    other.write_text(inv.read_text())
    assert cli("cordon", "h1", "-i", str(other), "-r", "psu").exit_code == 0
    with Store(state, readonly=True) as s:
        assert s.inventory() == inv.resolve()


def test_a_missing_option_value_names_the_subcommand(tmp_path: Path) -> None:
    r = runner.invoke(app, ["--state", str(tmp_path / "s.db"), "place", "-c", "cat.yaml", "--dry-run", "--facts"])
    assert r.exit_code == 2
    assert r.output.strip() == (
        "error: clusterctl place: Option '--facts' requires an argument. (see: clusterctl place -h)"
    )
    r = runner.invoke(app, ["--state"])
    assert r.exit_code == 2 and "(see: clusterctl -h)" in r.output


def test_unplaced_replicas_list_their_attempts_like_placed_ones(tmp_path: Path) -> None:
    inv, cat, facts = write_inputs(tmp_path, [dgx("gpu-01", cordoned=True)])
    r = runner.invoke(app, ["--state", str(tmp_path / "s.db"), "place", "--dry-run", "-i", str(inv), "-c", str(cat),
                            "--facts", str(facts), "-o", "json"])  # fmt: skip
    assert r.exit_code == 3, r.output
    for u in json.loads(r.stdout)["unplaced"]:
        assert "profiles" not in u
        assert {a["profile"] for a in u["attempts"]} == {"h100-tp8", "a100-2x8", "cpu"}
        for a in u["attempts"]:
            assert set(a) == {"profile", "placed", "metrics", "summary"} and a["placed"] is False


def test_one_more_node_is_singular() -> None:
    nodes = [a100_pcie(f"a-{i:02}") for i in range(11)]
    lines = render_plan(plan(nodes, catalog(("m", 1, [profile("p", gpu_class="H100", gpus=8)]))))
    assert "      ... and 1 more node (-o json lists every one)" in lines


def test_uncordon_in_a_state_with_no_inventory_recorded_checks_nothing(tmp_path: Path) -> None:
    state = tmp_path / "state.db"
    Store(state).close()  # a state no discover or cordon -i has recorded an inventory in
    r = runner.invoke(app, ["--state", str(state), "uncordon", "h1"])
    assert r.exit_code == 0 and r.output.strip() == "h1 was not cordoned"


def test_a_cordon_with_an_inventory_replaces_a_recorded_one_that_is_gone(tmp_path: Path) -> None:
    inv = _inventory(tmp_path)
    moved = tmp_path / "moved.yaml"
    moved.write_text(inv.read_text())
    state = tmp_path / "state.db"

    def cli(*args: str):
        return runner.invoke(app, ["--state", str(state), *args])

    assert cli("cordon", "h1", "-r", "x", "-i", str(moved)).exit_code == 0
    moved.unlink()
    r = cli("cordon", "h2", "-r", "y")
    assert r.exit_code == 2 and "moved.yaml" in r.output and "is gone; pass -i" in r.output
    assert cli("cordon", "h2", "-r", "y", "-i", str(inv)).exit_code == 0
    with Store(state, readonly=True) as s:
        assert s.inventory() == inv.resolve()
    assert cli("uncordon", "h2").exit_code == 0 and cli("cordon", "h2", "-r", "z").exit_code == 0


def test_serve_router_help_paragraphs_wrap_at_the_terminal_width() -> None:
    # rich keeps a help text's own line breaks: a paragraph written over several source lines
    # broke there and again at the terminal's width, leaving ragged one-word lines.
    r = CliRunner().invoke(app, ["serve-router", "--help"], env={"COLUMNS": "240"}, terminal_width=240)
    assert r.exit_code == 0
    lines = [ln.strip() for ln in r.output.splitlines()]
    assert any("SIGHUP; an invalid new one is logged and the previous one keeps serving." in ln for ln in lines)
    assert any("2 bad config, API keys file or option value, an access log" in ln for ln in lines)
    assert any(ln.startswith("- {url:") and "draining: true}" in ln for ln in lines)  # the example stays verbatim
