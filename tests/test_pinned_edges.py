"""Behaviour a mutation audit found no test pinning down: each test here fails when the rule
it names is broken (a flipped min/max, a dropped condition, a tie-break reordered).

Router: config merging of an endpoint listed under two models, the breaker settings reaching
the workers, half-open probe slots, Retry-After values, waiters answered when their last
endpoint goes, a re-added endpoint's starting estimate. Placement: a changed CPU profile, a
duplicated GPU index, NVLink tie-breaks. Parsers: hex LIDs, foreign column lists, duplicated
topology columns. State view: a vanished-GPU note said once, lost GPUs not counted as seen."""

from __future__ import annotations

import asyncio

import pytest
from test_placement_clusters import catalog, cpu_node, dgx, profile
from test_placement_rules import rep
from test_router_balance import Clock, worker

from cluster_cli.facts import Gpu, NodeFacts
from cluster_cli.placement import plan
from cluster_cli.placement.constraints import choose_gpus
from cluster_cli.probe.parsers.ibstat import parse_ibstat
from cluster_cli.probe.parsers.nvidia_smi import parse_query_gpu
from cluster_cli.probe.parsers.topology import parse_topo
from cluster_cli.router.admission import ModelQueue, QueueLimits, Rejected
from cluster_cli.router.balancer import Balancer, no_endpoint
from cluster_cli.router.breaker import State
from cluster_cli.router.config import RouterConfig, endpoint_views
from cluster_cli.router.policy import make_policy
from cluster_cli.router.registry import adopt_peer_capacity, build_table
from cluster_cli.state.view import note_vanished_gpus

# --------------------------------------------------------------------------- router config


def _cfg(models: dict, router: dict | None = None) -> RouterConfig:
    return RouterConfig.model_validate({"models": models, "router": router or {}})


def test_an_endpoint_under_two_models_drains_if_either_says_so_and_takes_the_tighter_limit() -> None:
    url = "http://10.0.0.1:8000"
    cfg = _cfg(
        {
            "a": {"endpoints": [{"url": url, "draining": True, "max_inflight": 8}]},
            "b": {"endpoints": [{"url": url, "max_inflight": 2}]},
        }
    )
    (view,) = endpoint_views(cfg).values()
    assert view.draining is True and view.max_inflight == 2 and view.models == ("a", "b")
    flipped = _cfg(
        {
            "a": {"endpoints": [{"url": url, "max_inflight": 2}]},
            "b": {"endpoints": [{"url": url, "draining": True, "max_inflight": 8}]},
        }
    )
    (view,) = endpoint_views(flipped).values()
    assert view.draining is True and view.max_inflight == 2


def test_the_configured_health_failure_threshold_reaches_the_breakers() -> None:
    cfg = _cfg({"m": {"endpoints": [{"url": "http://10.0.0.1:8000"}]}}, {"breaker": {"health_failure_threshold": 4}})
    (w,) = build_table(cfg).workers.values()
    for _ in range(3):
        w.breaker.on_health(False)
    assert w.breaker.current() is State.CLOSED
    w.breaker.on_health(False)
    assert w.breaker.current() is State.OPEN


# --------------------------------------------------------------------------- balancer


def test_a_probe_that_was_answered_gives_its_slot_back_once() -> None:
    """Half-open with one probe slot: probe A is answered (its slot goes to B), then A ends.
    A's release must not free B's slot too, or a third request would probe alongside B."""
    c = Clock()
    w = worker(0, c)
    b = w.breaker
    for _ in range(b.cfg.failure_threshold):
        b.on_result(False)
    c.t += b.open_for() + 0.1
    assert b.current() is State.HALF_OPEN
    cfg = _cfg({"m": {"endpoints": [{"url": w.url}]}})
    table = build_table(cfg)
    table.workers = {w.url: w}
    table.models["m"].workers = [w]
    bal = Balancer(table, make_policy("least_load"), clock=c)
    a = bal.try_acquire(table.models["m"])
    assert a is not None and a.probe and not b.allows()
    a.answered()
    second = bal.try_acquire(table.models["m"])
    assert second is not None and second.probe and b.probes == 1
    a.release(True)
    assert b.probes == 1 and not b.allows()
    second.release(True)


def test_retry_after_is_the_soonest_breaker_and_never_beyond_the_queue_wait() -> None:
    c = Clock()
    soon, late = worker(0, c), worker(1, c)
    for w, openings in ((soon, 1), (late, 4)):
        w.breaker.openings = openings - 1
        for _ in range(w.breaker.cfg.failure_threshold):
            w.breaker.on_result(False)
    assert soon.breaker.reopens_in() == pytest.approx(5.0) and late.breaker.reopens_in() == pytest.approx(20.0)
    assert no_endpoint([late, soon]).retry_after == pytest.approx(5.0)
    q = ModelQueue(QueueLimits(max_queue=1000, max_wait_s=1.5))
    q.live = 200  # a long queue: Retry-After grows with it, up to the wait a client would get
    assert q.retry_after() == 1.5


def test_queued_requests_get_503_at_once_when_their_last_endpoint_goes() -> None:
    async def scenario() -> None:
        c = Clock()
        cfg = _cfg({"m": {"endpoints": [{"url": "http://10.0.0.1:8000", "max_inflight": 1}]}})
        table = build_table(cfg, clock=c)
        bal = Balancer(table, make_policy("least_load"), clock=c)
        entry = table.models["m"]
        held = bal.try_acquire(entry)
        assert held is not None
        waiting = asyncio.ensure_future(bal.acquire(entry))
        await asyncio.sleep(0)
        assert len(entry.queue) == 1
        (w,) = table.workers.values()
        for _ in range(w.breaker.cfg.failure_threshold):
            w.breaker.on_result(False)
        bal.kick()
        with pytest.raises(Rejected) as err:
            await asyncio.wait_for(waiting, 1)
        assert (err.value.status, err.value.reason) == (503, "no_endpoint")
        held.release(None)

    asyncio.run(scenario())


def test_queue_deadlines_only_shrink_and_the_deadline_itself_is_expired() -> None:
    q = ModelQueue(QueueLimits(max_queue=8, max_wait_s=5.0))

    class _Fut:
        def done(self) -> bool:
            return False

        def add_done_callback(self, _cb: object) -> None:
            pass

    w = q.push(_Fut(), 0.0)  # type: ignore[arg-type]
    q.limits = QueueLimits(max_queue=8, max_wait_s=30.0)  # longer: the queued keep theirs
    q.limits = QueueLimits(max_queue=8, max_wait_s=10.0)  # shorter than 30, longer than its 5: still 5
    assert w.deadline == 5.0
    assert q.expired(4.999) == [] and q.expired(5.0) == [w]


# --------------------------------------------------------------------------- registry


def test_a_re_added_endpoint_starts_at_the_largest_learned_estimate_not_an_operator_limit() -> None:
    c = Clock()
    a, b, new = worker(0, c), worker(1, c), worker(2, c)
    a.cap, b.cap = 4, 8
    adopt_peer_capacity([a, b, new], {new.url})
    assert new.cap == 8
    c2 = Clock()
    a, limited, new = worker(0, c2), worker(1, c2, max_inflight=16), worker(2, c2)
    a.cap, limited.cap = 4, 16
    adopt_peer_capacity([a, limited, new], {new.url})
    assert new.cap == 4


# --------------------------------------------------------------------------- placement


def test_a_cpu_replica_is_restarted_when_its_profile_memory_changes() -> None:
    cat = catalog(("tiny", 1, [profile("cpu", engine="llamacpp", cpus=4, memory_gib=16)]))
    current = [rep("tiny", 0, "cpu", [("c-1", ())], engine="llamacpp", cpus=4, memory_mib=8192)]
    p = plan([cpu_node("c-1")], cat, current)
    assert [(x.action, x.replica.memory_mib) for x in p.placements] == [("stop", 8192), ("start", 16384)]
    assert "now reserves" in p.placements[0].note


def test_a_duplicated_gpu_index_is_never_handed_out_twice() -> None:
    n = dgx("h-1")
    twin = Gpu(0, "GPU-other", n.gpus[0].product, "H100")
    one = NodeFacts(name="h-1", gpus=(n.gpus[0], twin), nvlink_domains=None, cpus=8, memory_mib=1024)
    p = plan([one], catalog(("m", 1, [profile("p", gpu_class="H100", gpus=2)])))
    assert not p.starts and p.unplaced


def test_nvlink_choice_keeps_whole_domains_and_lone_gpus_first() -> None:
    # Fewest free GPUs left over in the chosen domain: the broken domain's pair, not a whole one.
    assert choose_gpus([0, 1, 8, 9, 10, 11], 2, (tuple(range(8)), (8, 9, 10, 11))) == ((0, 1), True)
    # One GPU: a GPU in no NVLink domain before breaking into a pair.
    assert choose_gpus([0, 1, 2], 1, ((0, 1),)) == ((2,), True)


# --------------------------------------------------------------------------- parsers

_IBSTAT = """CA 'mlx5_0'
\tCA type: MT4129
\tNumber of ports: 1
\tPort 1:
\t\tState: Active
\t\tPhysical state: LinkUp
\t\tRate: 400
\t\tBase lid: 0x1a
\t\tLMC: 0
\t\tSM lid: 0x10
\t\tCapability mask: 0xa751e84a
\t\tPort GUID: 0x58a2e103001b2576
\t\tLink layer: InfiniBand
"""


def test_ibstat_lids_printed_in_hex_are_read() -> None:
    (p,) = parse_ibstat(_IBSTAT)
    assert (p.base_lid, p.sm_lid) == (26, 16)


def test_a_query_gpu_row_with_one_column_too_many_and_no_bus_id_is_not_ours() -> None:
    line = "0, GPU-aaa, NVIDIA H100, 81559, 0, [N/A], 0, Disabled, No, No, extra"
    assert parse_query_gpu(line) == ([], [])


def test_a_topology_matrix_with_a_duplicated_gpu_column_is_unknown() -> None:
    text = "\tGPU0\tGPU1\tGPU1\tCPU Affinity\nGPU0\t X \tNV12\tNV12\t0-31\nGPU1\tNV12\t X \tNV12\t0-31\n"
    assert parse_topo(text) is None


# --------------------------------------------------------------------------- state view


def test_a_vanished_gpu_note_is_said_once_and_lost_gpus_are_not_counted_as_seen() -> None:
    old = dgx("h-1", problems={7: "lost"})
    new = NodeFacts(name="h-1", cpus=8, memory_mib=1024, nvlink_domains=None)
    noted = note_vanished_gpus(new, old)
    (gone,) = [p for p in noted.problems if p.startswith("gpus-gone")]
    assert "7 H100" in gone and "8 H100" not in gone
    again = note_vanished_gpus(noted, old)
    assert again.problems == noted.problems


def test_retry_attempts_are_bounded_and_exactly_enough_memory_fits() -> None:
    from pydantic import ValidationError

    models = {"m": {"endpoints": [{"url": "http://10.0.0.1:8000"}]}}
    assert _cfg(models, {"retry": {"max_attempts": 10}}).router.retry.max_attempts == 10
    with pytest.raises(ValidationError):
        _cfg(models, {"retry": {"max_attempts": 11}})
    cat = catalog(("tiny", 1, [profile("cpu", engine="llamacpp", memory_gib=128)]))
    assert plan([cpu_node("c-1", memory_gib=128)], cat).complete
    from cluster_cli.placement.constraints import Capacity, NodeState, Request

    req = Request.of(cat.models[0].profiles[0])
    assert Capacity().check(NodeState.build(cpu_node("c-1", memory_gib=128), 0), req).ok  # what place -v says
    assert not Capacity().check(NodeState.build(cpu_node("c-1", memory_gib=127), 0), req).ok


# --------------------------------------------------------------------------- upstream connections


class _ClosedTransport:
    """What uvloop hands back once the engine has closed the socket and before the protocol's
    connection_lost has run: closing, and a write raises RuntimeError ("handler is closed")."""

    def is_closing(self) -> bool:
        return True

    def write(self, data: bytes) -> None:
        raise RuntimeError("unable to perform operation on <TCPTransport closed=True>; the handler is closed")

    def abort(self) -> None:
        pass


class _Sink:
    def __init__(self) -> None:
        self.errors: list = []

    def on_error(self, exc: object) -> None:
        self.errors.append(exc)

    def flush(self) -> None:
        pass


def test_a_pooled_connection_the_engine_closed_is_skipped_or_failed_as_stale_never_raised() -> None:
    """An engine killed with kept-alive connections to it: a request that picked one up just
    then got a 500 from the router (uvloop's RuntimeError escaped). The pool now skips such a
    connection, and a send on one reports a stale failure (retried on a fresh connection)."""
    from cluster_cli.router.upstream import UpstreamConn, UpstreamPool

    async def scenario() -> None:
        pool = UpstreamPool("127.0.0.1", 9)
        c = UpstreamConn(pool)
        c.tr = _ClosedTransport()  # type: ignore[assignment]
        pool.idle.append(c)
        assert pool.get_idle() is None
        c.reused = True
        sink = _Sink()
        c.send(b"GET / HTTP/1.1\r\n\r\n", sink)  # type: ignore[arg-type]
        assert sink.errors == []
        c.connection_lost(None)  # uvloop delivers it next
        (err,) = sink.errors
        assert err.kind == "reset" and err.stale
        # Lost before the send (a fresh connection the engine reset during the caller's await).
        d = UpstreamConn(pool)
        d.tr = _ClosedTransport()  # type: ignore[assignment]
        d.connection_lost(ConnectionResetError())
        sink2 = _Sink()
        d.send(b"GET / HTTP/1.1\r\n\r\n", sink2)  # type: ignore[arg-type]
        await asyncio.sleep(0)
        (err,) = sink2.errors
        assert err.kind == "reset" and not err.stale

    asyncio.run(scenario())


def test_a_write_to_a_client_that_just_reset_does_not_raise() -> None:
    """The client resets its connection; before its connection_lost runs, the engine's next
    chunk is written to it: the RuntimeError uvloop raises must not escape into the engine's
    connection (it would be torn down with an error logged)."""
    from cluster_cli.router.server import ClientConn

    conn = ClientConn.__new__(ClientConn)
    conn.closed = False
    conn.tr = _ClosedTransport()  # type: ignore[assignment]
    conn.write(b"data: {}\n\n")
