"""More rules a second mutation audit found no test pinning down (SSH layer, state store, the
router's HTTP, keys, scrape, workers and config source): each test fails when its rule is broken."""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path

import pytest
from test_router_balance import Clock, worker

from cluster_cli.engines.base import MetricMapping
from cluster_cli.errors import ConfigError
from cluster_cli.facts import NodeFacts
from cluster_cli.probe.runner import _existing, _untrusted
from cluster_cli.router.http import parse_request_head
from cluster_cli.router.keys import ApiKeys
from cluster_cli.router.scrape import resolve
from cluster_cli.router.source import WatchedFile
from cluster_cli.state.store import Store

# --------------------------------------------------------------------------- router HTTP and keys


def test_the_clients_api_key_never_reaches_an_engine() -> None:
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nAuthorization: Bearer sk-router\r\nX-Trace: 1\r\nContent-Length: 2"
    req = parse_request_head(head)[0]
    fwd = req.forward.lower()
    assert b"authorization" not in fwd and b"sk-router" not in fwd
    assert b"x-trace: 1" in fwd  # other headers do go through


def test_an_http_1_0_client_asking_for_keep_alive_is_not_kept() -> None:
    req = parse_request_head(b"GET /health HTTP/1.0\r\nHost: a\r\nConnection: keep-alive")[0]
    assert req.keep_alive is False
    assert parse_request_head(b"GET /health HTTP/1.1\r\nHost: a")[0].keep_alive is True


def test_api_keys_file_rules(tmp_path: Path) -> None:
    p = tmp_path / "keys"
    with pytest.raises(ConfigError, match="no API keys"):
        ApiKeys.load(p, b"# nobody yet\n\n")
    with pytest.raises(ConfigError, match="64 hex digits"):
        ApiKeys.load(p, b"sha256:" + b"ab" * 16)
    keys = ApiKeys.load(p, b"sk-a\n")
    assert keys.check(b"Bearer sk-a") and keys.check(b"bearer sk-a") and keys.check(b"BEARER sk-a")
    assert not keys.check(b"Bearer sk-b") and not keys.check(b"Basic sk-a")


# --------------------------------------------------------------------------- scrape and workers


def test_the_primary_metric_name_wins_over_its_fallback() -> None:
    mapping = MetricMapping.vllm()  # KV cache: current name, then the pre-0.10 one
    primary, legacy = mapping.kv_cache_usage, mapping.names("kv_cache_usage")[1]
    assert resolve({primary: [0.2], legacy: [0.7]}, mapping)[2] == 0.2
    assert resolve({legacy: [0.7]}, mapping)[2] == 0.7


def test_an_engine_showing_less_than_the_router_sent_adds_no_negative_load() -> None:
    c = Clock()
    w = worker(0, c)
    w.inflight = 3
    w.on_scrape(0, 0, None, c())  # the scrape raced ahead of our three requests
    assert w.external(c()) == 0.0 and w.load(c()) == 3


def test_a_reload_with_another_metric_mapping_forgets_the_scraped_load() -> None:
    from dataclasses import replace

    from cluster_cli.router.breaker import BreakerConfig

    c = Clock()
    w = worker(0, c)
    w.on_scrape(5, 2, 0.5, c())
    llama = MetricMapping.from_config({"running": "llamacpp:requests_processing"})
    w.update_view(replace(w.view, metrics=llama), breaker_cfg=BreakerConfig(), stale_s=3.0, probe_s=5.0)
    assert w.scraped.running is None and w.external(c()) == 0.0


def test_a_config_file_missing_at_start_is_picked_up_when_it_appears(tmp_path: Path) -> None:
    path = tmp_path / "router.yaml"

    async def scenario() -> bytes | None:
        wf = WatchedFile(path, interval=0.05, settle=0.01)
        it = wf.changes().__aiter__()
        path.write_bytes(b"models: {}\n")
        content, _why = await asyncio.wait_for(it.__anext__(), 10)
        return content

    assert asyncio.run(scenario()) == b"models: {}\n"


# --------------------------------------------------------------------------- SSH layer


def test_a_pin_file_anyone_can_write_is_not_trusted(tmp_path: Path) -> None:
    f = tmp_path / "pins"
    f.write_text("")
    f.chmod(0o646)
    assert _untrusted(os.stat(f)) == "is writable by every user"
    f.chmod(0o600)
    assert _untrusted(os.stat(f)) is None
    assert stat.S_IMODE(os.stat(f).st_mode) == 0o600


def test_an_identity_file_written_with_a_tilde_is_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".ssh").mkdir()
    (tmp_path / ".ssh" / "x").write_text("key")
    assert _existing(("~/.ssh/x", "~/.ssh/missing")) == ["~/.ssh/x"]


# --------------------------------------------------------------------------- state store


def test_an_unreachable_node_takes_its_new_host_labels_and_fabric_from_the_inventory(tmp_path: Path) -> None:
    with Store(tmp_path / "s.db") as s:
        s.save_discovery([NodeFacts(name="n1", host="10.0.0.1", cpus=8, labels={"rack": "r1"}, fabric="ib-a")])
        s.save_discovery(
            [
                NodeFacts(
                    name="n1", host="10.0.0.9", reachable=False, error="refused", labels={"rack": "r7"}, fabric="ib-b"
                )
            ]
        )
        (n,) = s.nodes()
    assert (n.host, n.labels, n.fabric, n.reachable, n.cpus) == ("10.0.0.9", {"rack": "r7"}, "ib-b", False, 8)


def test_an_engines_own_reason_phrase_is_relayed_only_when_clean() -> None:
    from types import SimpleNamespace

    from cluster_cli.router.proxy import _engine_phrase

    assert _engine_phrase(SimpleNamespace(status_line=b"HTTP/1.1 599 Network Timeout")) == b"Network Timeout"
    for dirty in (b"HTTP/1.1 599 Bad\x1b[31m red", b"HTTP/1.1 599 a\rSet-Cookie: x", b"HTTP/1.1 599 nul\x00"):
        assert _engine_phrase(SimpleNamespace(status_line=dirty)) == b""
