"""Review fixes of ``place --dry-run``, ``cordon`` and ``uncordon``: explanations taken when a
profile failed, strict catalogs, safe cordon reasons, cordons of nodes with no facts yet."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from test_cli_place import write_inputs
from test_placement_clusters import catalog, dgx, ib, profile
from typer.testing import CliRunner

from cluster_cli.cli.main import app
from cluster_cli.config.catalog import load_catalog
from cluster_cli.errors import ConfigError
from cluster_cli.facts import UNREAD, NodeFacts
from cluster_cli.placement import plan, render_plan, render_trace
from cluster_cli.state.store import Store

runner = CliRunner()


def _write(tmp_path: Path, nodes: list[NodeFacts], cat: str, names: list[str] | None = None) -> tuple[Path, Path, Path]:
    return write_inputs(tmp_path, nodes, inventory_nodes=names, catalog=cat)


def _cli(tmp_path: Path, *args: str):
    return runner.invoke(app, ["--state", str(tmp_path / "state.db"), *args])


# --------------------------------------------------------------------------- 1. explained when it failed


def test_unplaced_is_explained_by_the_state_it_failed_on_not_the_final_one() -> None:
    """a (8x H100) fails on h1 (2 ECC); b (4x H100) is placed there afterwards: a's reason is
    6 free, as -v says, not the 2 left after b."""
    cat = catalog(
        ("a", 1, [profile("tp8", gpu_class="H100", gpus=8)]), ("b", 1, [profile("tp4", gpu_class="H100", gpus=4)])
    )
    p = plan([dgx("h1", problems={0: "ecc", 1: "ecc"})], cat, trace=True)
    want = "6 of 8 H100 free (2 ECC), profile needs 8"
    (u,) = p.to_dict()["unplaced"]
    assert [r["detail"] for r in u["reasons"]] == [want]
    assert f"      h1: {want}" in render_plan(p)
    assert f"    h1: rejected by capacity: {want}" in render_trace(p)


def test_fallback_summary_is_taken_when_the_better_profile_failed() -> None:
    """m's 2-node profile fails for want of a second node on ib-a (h1 fits alone); its
    replicas then fill h1 and h2 with tp8. The "not ..." line and the JSON summary say why it
    failed (fabric too small), not what the nodes look like at the end (full)."""
    nodes = [dgx("h1"), dgx("h2", fabric="ib-b", hcas=[ib("mlx5_0", "ib-b")])]
    cat = catalog(
        (
            "m",
            2,
            [profile("mn", gpu_class="H100", gpus=8, nodes=2, priority=10), profile("tp8", gpu_class="H100", gpus=8)],
        )
    )
    p = plan(nodes, cat)
    assert p.complete and len(p.starts) == 2
    line = "    not mn (2 nodes x 8x H100): 0/2 nodes are available: 2 fabric too small."
    assert line in render_plan(p)
    first = p.to_dict()["replicas"][0]["attempts"][0]
    assert first["summary"] == line.split(": ", 1)[1]
    assert first["metrics"]["exhausted_by"] == {"fabric": 2}


def test_explanations_stay_deterministic() -> None:
    cat = catalog(
        ("a", 2, [profile("tp8", gpu_class="H100", gpus=8)]), ("b", 1, [profile("tp4", gpu_class="H100", gpus=4)])
    )
    nodes = [dgx("h1", problems={0: "ecc"}), dgx("h2", problems={3: "ecc"})]
    assert plan(nodes, cat).to_dict() == plan(list(reversed(nodes)), cat).to_dict()


# --------------------------------------------------------------------------- 2. cpus/memory on a GPU profile


@pytest.mark.parametrize(("field", "value"), [("cpus", "8"), ("memory_gib", "64")])
def test_gpu_profile_with_cpus_or_memory_is_refused(tmp_path: Path, field: str, value: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(
        "models:\n  - name: m\n    profiles:\n"
        f"      - {{name: p, engine: vllm, gpu_class: H100, gpus: 1, {field}: {value}, model: /m}}\n"
    )
    with pytest.raises(ConfigError) as e:
        load_catalog(path)
    msg = str(e.value)
    assert "\n" not in msg and f"models.0.profiles.0.{field}: only a CPU profile" in msg, msg
    inv, cat, facts = _write(tmp_path, [dgx("h1")], path.read_text())
    r = _cli(tmp_path, "place", "--dry-run", "-i", str(inv), "-c", str(cat), "--facts", str(facts))
    assert r.exit_code == 2, r.output


# --------------------------------------------------------------------------- 3. cordon reasons


@pytest.mark.parametrize(
    "reason", ["bad\nfan", "bad\tfan", "bad \x1b[31mfan", "x" * 30_000], ids=["newline", "tab", "esc", "30000-chars"]
)
def test_cordon_refuses_control_characters_and_long_reasons(tmp_path: Path, reason: str) -> None:
    inv, _, _ = _write(tmp_path, [dgx("h1")], "models: []\n")
    r = _cli(tmp_path, "cordon", "h1", "-i", str(inv), "--reason", reason)
    assert r.exit_code == 2, r.output
    err = r.stderr.strip()
    assert "\n" not in err and "--reason" in err and "\x1b" not in err and len(err) < 300, err
    assert not (tmp_path / "state.db").exists()  # nothing written


def test_rich_markup_in_a_reason_is_printed_literally(tmp_path: Path) -> None:
    reason = "[red]PSU[/red] [bold]x"
    inv, cat, facts = _write(
        tmp_path,
        [dgx("h1")],
        "models:\n  - {name: m, profiles: [{name: p, engine: vllm, gpu_class: H100, model: /m}]}\n",
    )
    r = _cli(tmp_path, "cordon", "h1", "-i", str(inv), "--reason", reason)
    assert r.exit_code == 0 and f"h1 cordoned: {reason}" in r.stderr, r.output
    r = _cli(tmp_path, "cordon", "h1", "-i", str(inv), "--reason", reason + "!")
    assert r.exit_code == 0 and json.dumps(reason) in r.stderr, r.output
    r = _cli(tmp_path, "-v", "place", "--dry-run", "-i", str(inv), "-c", str(cat), "--facts", str(facts))
    assert r.exit_code == 3, r.output
    assert f"h1: cordoned ({reason}!)" in r.stdout
    assert f"h1: rejected: cordoned ({reason}!)" in r.stderr


# --------------------------------------------------------------------------- 4. cordoned, no facts yet


def test_cordoned_node_without_facts_is_explained_as_cordoned(tmp_path: Path) -> None:
    inv, cat, _ = _write(
        tmp_path,
        [],
        "models:\n  - {name: m, profiles: [{name: p, engine: vllm, gpu_class: H100, model: /m}]}\n",
        ["h1"],
    )
    assert _cli(tmp_path, "cordon", "h1", "-i", str(inv), "--reason", "RMA 4411").exit_code == 0
    r = _cli(tmp_path, "place", "--dry-run", "-i", str(inv), "-c", str(cat), "-o", "json")
    assert r.exit_code == 3, r.output
    (u,) = json.loads(r.stdout)["unplaced"]
    (reason,) = u["reasons"]
    assert (reason["constraint"], reason["detail"]) == (
        "cordoned",
        "cordoned (RMA 4411); also unreachable: no facts (not discovered yet)",
    )
    assert u["attempts"][0]["metrics"]["filtered_by"] == {"cordoned": 1}
    assert u["attempts"][0]["placed"] is False and u["attempts"][0]["summary"].startswith("0/")


# --------------------------------------------------------------------------- 5. lost GPUs' placeholder class


def test_lost_gpu_of_unread_class_is_called_lost() -> None:
    n = dgx("g3")
    gpus = (*n.gpus[:7], replace(n.gpus[7], lost=True, product=UNREAD, gpu_class=UNREAD, uuid=""))
    p = plan([replace(n, gpus=gpus)], catalog(("m", 1, [profile("p", gpu_class="H200", gpus=1)])))
    assert [r.detail for r in p.unplaced[0].reasons] == ["no H200 GPU (has 7 H100, 1 lost)"]


def test_gpu_class_unknown_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("models:\n  - {name: m, profiles: [{name: p, engine: vllm, gpu_class: unknown, model: /m}]}\n")
    with pytest.raises(ConfigError, match=r"models\.0\.profiles\.0\.gpu_class: 'unknown' is reserved"):
        load_catalog(path)


# --------------------------------------------------------------------------- 6. strict numbers


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("{name: m, replicas: true, profiles: [{name: p, engine: vllm, gpu_class: H100, model: /m}]}", "replicas"),
        ("{name: m, replicas: '2', profiles: [{name: p, engine: vllm, gpu_class: H100, model: /m}]}", "replicas"),
        ("{name: m, profiles: [{name: p, engine: vllm, gpu_class: H100, gpus: true, model: /m}]}", "profiles.0.gpus"),
        ("{name: m, profiles: [{name: p, engine: vllm, gpu_class: H100, nodes: '1', model: /m}]}", "profiles.0.nodes"),
        ("{name: m, profiles: [{name: p, engine: vllm, gpu_class: H100, priority: '9', model: /m}]}", "profiles.0.priority"),
        ("{name: m, profiles: [{name: p, engine: llamacpp, cpus: '4', model: /m}]}", "profiles.0.cpus"),
        ("{name: m, profiles: [{name: p, engine: llamacpp, memory_gib: true, model: /m}]}", "profiles.0.memory_gib"),
    ],
)  # fmt: skip
def test_catalog_numbers_are_strict(tmp_path: Path, text: str, where: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(f"models:\n  - {text}\n")
    with pytest.raises(ConfigError, match=rf"models\.0\.{where}: "):
        load_catalog(path)


def test_catalog_float_memory_still_takes_an_int(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(
        "models:\n  - {name: m, profiles: [{name: p, engine: llamacpp, cpus: 4, memory_gib: 8, model: /m}]}\n"
    )
    assert load_catalog(path).models[0].profiles[0].memory_mib == 8192


# --------------------------------------------------------------------------- 7. no-op cordon changes


def test_noop_cordon_changes_do_not_bump_the_version(tmp_path: Path) -> None:
    with Store(tmp_path / "s.db") as s:
        v0 = s.version()
        assert s.uncordon("h1") is False
        assert s.uncordon("h1") is False
        assert s.version() == v0
        assert s.cordon("h1", "fan") is None
        v1 = s.version()
        assert v1 == v0 + 1
        assert s.cordon("h1", "fan") == {"reason": "fan", "created_at": s.cordons()["h1"]["created_at"]}
        assert s.version() == v1
        s.cordon("h1", "psu")  # a new reason is a change
        assert s.version() == v1 + 1
        assert s.uncordon("h1") is True
        assert s.version() == v1 + 2


def test_noop_uncordon_from_the_cli_writes_nothing(tmp_path: Path) -> None:
    inv, _, _ = _write(tmp_path, [dgx("h1")], "models: []\n")
    assert _cli(tmp_path, "cordon", "h1", "-i", str(inv), "--reason", "fan").exit_code == 0
    assert _cli(tmp_path, "uncordon", "h1", "-i", str(inv)).exit_code == 0
    with Store(tmp_path / "state.db", readonly=True) as s:
        v = s.version()
    for args in (["uncordon", "h1"], ["uncordon", "h1"]):
        r = _cli(tmp_path, *args, "-i", str(inv))
        assert r.exit_code == 0 and "was not cordoned" in r.stderr, r.output
    assert _cli(tmp_path, "cordon", "h1", "-i", str(inv), "--reason", "fan").exit_code == 0
    assert _cli(tmp_path, "cordon", "h1", "-i", str(inv), "--reason", "fan").exit_code == 0
    with Store(tmp_path / "state.db", readonly=True) as s:
        assert s.version() == v + 1
