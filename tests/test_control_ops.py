"""The operations behind discover, place, cordon and events, called without the CLI."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from helpers import dgx, write_inputs

from cluster_cli.control import cordon as cordons
from cluster_cli.control import events as log
from cluster_cli.control.discover import DiscoverResult, Discovery, select
from cluster_cli.control.place import place, read_facts
from cluster_cli.control.router import Overrides, access_log
from cluster_cli.errors import ConfigError, SSHError, StateError
from cluster_cli.state.store import Store


def _inventory(tmp_path: Path, names: list[str]) -> tuple[Any, Path]:
    from cluster_cli.config.inventory import load_inventory

    path = tmp_path / "inventory.yaml"
    path.write_text("nodes:\n" + "".join(f"  - {{name: {n}, host: 198.18.0.{i + 1}}}\n" for i, n in enumerate(names)))
    return load_inventory(path), path


class _Unreachable:
    """A connector no node answers on."""

    @contextlib.asynccontextmanager
    async def session(self, target: Any) -> AsyncIterator[Any]:
        raise SSHError(f"{target.name}: connection refused")
        yield


# --------------------------------------------------------------------------- discover


def test_select_keeps_inventory_order_and_names_the_unknown(tmp_path: Path) -> None:
    inv, path = _inventory(tmp_path, ["a", "b", "c"])
    assert [n.name for n in select(inv, path, None)] == ["a", "b", "c"]
    assert [n.name for n in select(inv, path, ["c", "a"])] == ["a", "c"]
    with pytest.raises(ConfigError, match=r"no node named 'x', 'y' in the inventory"):
        select(inv, path, ["a", "x", "y"])


def test_a_discovery_makes_its_state_only_to_save_and_reports_who_did_not_answer(tmp_path: Path) -> None:
    inv, path = _inventory(tmp_path, ["a", "b"])
    state = tmp_path / "sub" / "state.db"
    lines: list[str] = []
    run = Discovery.open(inv, path, state, ["b"], connector=_Unreachable(), say=lines.append)
    try:
        facts = asyncio.run(run.probe())
        assert [f.name for f in facts] == ["b"] and not facts[0].reachable
        assert not state.exists() and not run.saved()  # probing saves nothing, nor makes the state
        result = asyncio.run(run.save())
    finally:
        run.close()
    assert isinstance(result, DiscoverResult) and run.saved()
    assert [f.name for f in result.failed] == ["b"]
    assert result.to_dict() == {"nodes": [result.nodes[0].to_dict()], "fabric_conflicts": []}
    assert any(line.startswith("b: unreachable") for line in lines)  # the -v trace
    with Store(state, readonly=True) as s:
        assert [f.name for f in s.nodes()] == ["b"] and s.inventory() == path.resolve()


def test_a_state_that_cannot_be_made_is_refused_before_probing(tmp_path: Path) -> None:
    inv, path = _inventory(tmp_path, ["a"])
    (tmp_path / "file").write_text("")
    with pytest.raises(StateError, match="not a folder"):
        Discovery.open(inv, path, tmp_path / "file" / "state.db", connector=_Unreachable())


# --------------------------------------------------------------------------- place


def test_place_returns_the_plan_its_inputs_and_the_warnings(tmp_path: Path) -> None:
    inv, cat, facts = write_inputs(tmp_path, [dgx("gpu-01"), dgx("gpu-02")])
    facts.write_text(facts.read_text().replace('"nodes": [', '"nodes": [' + _extra_node(), 1))
    result = place(inv, cat, tmp_path / "none.db", facts, trace=True)
    assert result.version is None and result.source == str(facts) and result.nodes == 2
    assert result.warnings[0] == f"{facts}: ignoring facts of nodes not in the inventory: stray"
    assert result.to_dict()["state_version"] is None and result.to_dict()["complete"] is result.complete
    assert result.lines(header="H")[0] == "H"
    assert result.trace_lines()  # recorded, since trace=True


def _extra_node() -> str:
    import json

    return json.dumps(dgx("stray").to_dict()) + ", "


def test_place_without_any_matching_facts_is_a_config_error(tmp_path: Path) -> None:
    inv, cat, facts = write_inputs(tmp_path, [dgx("other")], inventory_nodes=["gpu-01"])
    with pytest.raises(ConfigError, match="has facts for none of the inventory's 1 node"):
        place(inv, cat, tmp_path / "none.db", facts)


def test_read_facts_names_what_is_wrong(tmp_path: Path) -> None:
    bad = tmp_path / "f.json"
    bad.write_text('{"nodes": [1]}')
    with pytest.raises(ConfigError, match=r"nodes\.0: expected an object, got int"):
        read_facts(bad)
    with pytest.raises(ConfigError, match="file not found"):
        read_facts(tmp_path / "missing.json")


# --------------------------------------------------------------------------- cordon


@pytest.mark.parametrize(
    ("reason", "message"),
    [(" ", "must not be empty"), ("a\nb", r"U\+000A not allowed"), ("x" * 501, "501 characters, at most 500")],
)
def test_a_cordon_reason_is_one_line_of_plain_text(reason: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        cordons.check_reason(reason)
    assert cordons.check_reason("  ECC storm ") == "ECC storm"


def test_cordon_replaces_a_recorded_inventory_only_when_its_file_is_gone(tmp_path: Path) -> None:
    state = tmp_path / "s.db"
    first, second = tmp_path / "one.yaml", tmp_path / "two.yaml"
    first.write_text("")
    second.write_text("")
    assert not cordons.is_cordoned(state, "a")  # no state: nothing is cordoned, and nothing made
    assert not state.exists()
    with Store(state) as s:
        done = cordons.cordon(s, "a", "why", inventory=first)
        assert done.was is None and s.inventory() == first.resolve()
        again = cordons.cordon(s, "a", "still", inventory=second, recorded=first)
        assert again.was is not None and again.was["reason"] == "why"
        assert s.inventory() == first.resolve()  # still there: kept
        first.unlink()
        cordons.cordon(s, "b", "why", inventory=second, recorded=first)
        assert s.inventory() == second.resolve()
    assert cordons.is_cordoned(state, "a")
    with Store(state) as s:
        assert cordons.uncordon(s, "a") and not cordons.uncordon(s, "a")
    assert not cordons.is_cordoned(state, "a")


# --------------------------------------------------------------------------- events


def test_events_by_kind_read_further_back_until_enough_match(tmp_path: Path) -> None:
    state = tmp_path / "s.db"
    with Store(state, actor="test") as s:
        cordons.cordon(s, "a", "first", inventory=tmp_path / "i.yaml")
        for i in range(20):
            cordons.cordon(s, "a", f"again {i}", inventory=tmp_path / "i.yaml")
        cordons.uncordon(s, "a")
    with log.open_log(state) as s:
        assert [e.kind for e in log.newest(s, log.EventQuery(1, frozenset({"cordon"})))] == ["cordon"]
        assert [e.kind for e in log.newest(s, log.EventQuery(2))][-1] == "uncordon"
        assert not log.is_empty(s)


def test_follow_gives_the_newest_then_each_new_batch(tmp_path: Path) -> None:
    state = tmp_path / "s.db"
    Store(state).close()
    with log.open_log(state, follow=True) as reader, Store(state, actor="test") as writer:
        ticks: list[float] = []

        def sleep(s: float) -> None:  # each poll: another cordon is written first
            ticks.append(s)
            cordons.cordon(writer, f"n{len(ticks)}", "why", inventory=tmp_path / "i.yaml")

        follow = log.Follow(reader, log.EventQuery(5, frozenset({"cordon"})), poll_s=0.01, sleep=sleep)
        assert follow.first() == [] and follow.was_empty
        batches = iter(follow)
        assert [e.node for e in next(batches)] == ["n1"]
        assert [e.node for e in next(batches)] == ["n2"]
        assert ticks == [0.01, 0.01]


def test_retention_needs_a_state(tmp_path: Path) -> None:
    with pytest.raises(StateError):
        log.set_retention(tmp_path / "none.db", days=1)
    Store(tmp_path / "s.db").close()
    kept = log.set_retention(tmp_path / "s.db", days=2, max_events=10)
    assert (kept.days, kept.max_events) == (2, 10)


# --------------------------------------------------------------------------- serve-router


def test_router_overrides_name_the_option_a_bad_value_came_from() -> None:
    from cluster_cli.router.config import RouterConfig

    cfg = RouterConfig.model_validate({"models": {}})
    assert Overrides(policy="p2c", max_queue=3).apply(cfg).router.policy == "p2c"
    with pytest.raises(ConfigError, match=r"^--max-queue -1: "):
        Overrides(max_queue=-1).apply(cfg)


def test_access_log_spec(tmp_path: Path) -> None:
    assert access_log("off").stream is None
    f = access_log(str(tmp_path / "a.log"))
    assert f.path == str(tmp_path / "a.log")
    with pytest.raises(OSError):
        access_log(str(tmp_path / "no" / "a.log"))


# --------------------------------------------------------------------------- status


def test_recorded_status_needs_no_inventory_nor_node(tmp_path: Path) -> None:
    from cluster_cli.control.status import recorded_status

    with Store(tmp_path / "s.db") as s:
        s.set_node_status("n1", "lost", detail="unreachable for 30 s")
        s.acquire_lease("supervise", "supervise-x", 30.0, host="h", pid=42)
        view = asyncio.run(recorded_status(s))
        assert (view.rows, view.fences) == ([], [])
        assert [(n.node, n.status, n.detail) for n in view.nodes] == [("n1", "lost", "unreachable for 30 s")]
        assert view.supervisor is not None and view.supervisor.pid == 42
        assert view.to_dict()["supervisor"]["holder"] == "supervise-x"
