"""What ``supervise`` decides from what it saw, as pure functions over plain data: each node's
state from its heartbeats, the storm brake, and each replica's restart backoff. No I/O and
no clock of their own (``now`` is given), so that every decision is property-tested.

Node states: ``ready`` (answers) → ``unreachable`` (missed a heartbeat: out of the router at
once, its replicas kept) → ``lost`` (unreachable for ``grace_s``: its replicas are released
and rebuilt elsewhere). A node that answers again is ``fencing`` until what runs there that
is not assigned to it is stopped, then ``ready``. A node that keeps coming and going is
damped: after each return it must answer for longer before it is trusted again (doubling,
up to ``grace_s``), and its unreachable time counts from its first miss of the episode.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field

READY, UNREACHABLE, LOST, FENCING = "ready", "unreachable", "lost", "fencing"

GRACE_S = 30.0  # unreachable this long: lost (its replicas are rebuilt elsewhere)
BRAKE_SHARE = 0.55  # Kubernetes' unhealthy-zone threshold: this share unreachable at once is our network
FLAP_WINDOW_S = 600.0  # returns counted over this window to damp a flapping node
RESTART_FIRST_S, RESTART_MAX_S = 1.0, 60.0
MOVE_AFTER = 3  # failed restarts within RESTART_WINDOW_S: placed elsewhere
RESTART_WINDOW_S = 600.0  # also: healthy this long and the count starts again


@dataclass
class NodeState:
    """One node as the supervisor sees it."""

    state: str = READY
    since: float = 0.0  # when it entered ``state``
    missed_since: float | None = None  # first missed heartbeat of the current episode
    boot_id: str | None = None
    returns: list[float] = field(default_factory=list)  # when it answered again after a miss
    answering_since: float | None = None  # answering without a miss since (to trust it again)
    last_answer: float | None = None  # its last heartbeat answered
    slow: int = 0  # heartbeats in a row that timed out while it was ready
    why: str = ""


@dataclass(frozen=True)
class Change:
    """A node moved from ``old`` to ``new`` (``why``: what was seen)."""

    node: str
    old: str
    new: str
    why: str
    rebooted: bool = False  # its boot id changed: nothing of what ran there runs any more


def settle_s(ns: NodeState, now: float, interval_s: float, grace_s: float) -> float:
    """How long a node that answered again must keep answering before it is trusted: none for
    a first return, then doubling with each return within the flap window, up to ``grace_s``."""
    recent = [t for t in ns.returns if now - t <= FLAP_WINDOW_S]
    if len(recent) <= 1:
        return 0.0
    return min(grace_s, interval_s * 2 ** (len(recent) - 1))


def observe(
    nodes: dict[str, NodeState],
    beats: Mapping[str, tuple[bool, str | None, str]],
    now: float,
    *,
    interval_s: float,
    grace_s: float = GRACE_S,
    braked: bool = False,
    timed_out: Collection[str] = (),
) -> list[Change]:
    """Update ``nodes`` (in place) with one round of heartbeats (node -> (answered, boot id,
    why not)) and return the changes. A ready node becomes ``unreachable`` at its first miss
    when its connection failed, at its second in a row when it only did not answer in time
    (``timed_out``: it may be loaded, not gone). An answering node that was away goes to
    ``fencing`` (the caller fences it, then calls :func:`fenced`); a node unreachable for
    ``grace_s`` since its last answer goes to ``lost`` unless ``braked`` (the supervisor's
    own network is in doubt). A ready node that reports a new boot id (it rebooted between
    two heartbeats) is fenced too."""
    out: list[Change] = []
    for name, (answered, boot, why) in beats.items():
        ns = nodes.setdefault(name, NodeState(since=now, boot_id=boot))
        if answered:
            ns.last_answer, ns.slow = now, 0
            rebooted = bool(boot and ns.boot_id and boot != ns.boot_id)
            if boot:
                ns.boot_id = boot
            if ns.state in (UNREACHABLE, LOST):
                ns.returns.append(now)
                ns.returns = [t for t in ns.returns if now - t <= FLAP_WINDOW_S]
                ns.answering_since = now
                out.append(_move(ns, name, FENCING, now, "answers again", rebooted=rebooted))
            elif ns.state == FENCING:
                pass  # the caller is fencing it
            elif rebooted:  # nothing it ran runs now; what it starts at boot is not trusted yet
                out.append(_move(ns, name, FENCING, now, "rebooted (a new boot id)", rebooted=True))
            if ns.answering_since is None:
                ns.answering_since = now
            continue
        ns.answering_since = None
        if ns.state == READY and name in timed_out and ns.slow == 0:
            ns.slow = 1  # one slow answer is no verdict
            continue
        if ns.missed_since is None:  # reset only once trusted again: a flapping node's time adds up
            ns.missed_since = ns.last_answer if ns.last_answer is not None else now
        if ns.state in (READY, FENCING):
            out.append(_move(ns, name, UNREACHABLE, now, why))
        elif ns.state == UNREACHABLE and not braked and now - ns.missed_since >= grace_s:
            out.append(_move(ns, name, LOST, now, f"unreachable for {now - ns.missed_since:.0f} s: {why}"))
        else:
            ns.why = why
    return out


def expire(nodes: dict[str, NodeState], now: float, *, grace_s: float = GRACE_S, braked: bool = False) -> list[Change]:
    """The unreachable nodes whose grace is over, ``lost`` now (unless ``braked``): asked at
    the start of a tick, so that a node whose heartbeat would only time out again is not
    declared lost a heartbeat timeout late."""
    out = []
    for name, ns in nodes.items():
        if ns.state == UNREACHABLE and not braked and ns.missed_since is not None and now - ns.missed_since >= grace_s:
            out.append(
                _move(ns, name, LOST, now, f"no answer for {now - ns.missed_since:.0f} s: {ns.why}".rstrip(": "))
            )
    return out


def rearm(nodes: dict[str, NodeState], now: float) -> None:
    """The storm brake was released: a node still unreachable gets a whole grace from now, as a
    network that comes back comes back node by node (its time while braked proves nothing)."""
    for ns in nodes.values():
        if ns.state == UNREACHABLE:
            ns.missed_since = now


def fenced(nodes: dict[str, NodeState], name: str, now: float, *, interval_s: float, grace_s: float) -> Change | None:
    """The fence of ``name`` is done: ready, unless it is damped and has not answered long
    enough yet (then it stays fencing: fenced again at its next heartbeat, harmless)."""
    ns = nodes[name]
    if ns.state != FENCING:
        return None
    wait = settle_s(ns, now, interval_s, grace_s)
    if ns.answering_since is not None and now - ns.answering_since < wait:
        return None
    ns.missed_since = None
    return _move(ns, name, READY, now, "fenced" if wait == 0 else f"fenced, and answering for {wait:.0f} s")


def _move(ns: NodeState, name: str, new: str, now: float, why: str, *, rebooted: bool = False) -> Change:
    old = ns.state
    ns.state, ns.since, ns.why = new, now, why
    return Change(name, old, new, why, rebooted=rebooted)


def braking(nodes: Mapping[str, NodeState], now: float, *, grace_s: float, share: float = BRAKE_SHARE) -> str | None:
    """Why nothing is to be rebuilt now, or None: when at least ``share`` of the nodes (and
    more than one), or all of them, went unreachable within one grace window, the fault is
    more likely the supervisor's own network than theirs."""
    if not nodes:
        return None
    away = [n for n, s in nodes.items() if s.state in (UNREACHABLE, LOST)]
    recent = [n for n in away if nodes[n].missed_since is not None and now - nodes[n].missed_since <= 2 * grace_s]
    total = len(nodes)
    if len(away) == total:
        return f"all {total} nodes are unreachable: the supervisor's own network is in doubt, nothing is rebuilt"
    if len(recent) > 1 and len(recent) >= share * total:
        return (
            f"{len(recent)} of {total} nodes went unreachable within {2 * grace_s:.0f} s "
            f"(at least {share:.0%}): the supervisor's own network is in doubt, nothing is rebuilt"
        )
    return None


# ---- a replica's restarts ----------------------------------------------------------------
@dataclass
class Restarts:
    """One replica's restarts: when each failure was seen, where, and when it was healthy."""

    failures: list[tuple[float, str]] = field(default_factory=list)  # (when, node)
    healthy_since: float | None = None
    last_death: str | None = None  # the dead process last counted (a death is counted once)


def failed(r: Restarts, now: float, node: str) -> None:
    """The replica was found dead (or its restart failed) on ``node``."""
    r.failures = [f for f in r.failures if now - f[0] <= RESTART_WINDOW_S] + [(now, node)]
    r.healthy_since = None


def healthy(r: Restarts, now: float) -> None:
    """The replica was seen ready; healthy for ``RESTART_WINDOW_S``, its count starts again."""
    if r.healthy_since is None:
        r.healthy_since = now
    elif now - r.healthy_since >= RESTART_WINDOW_S:
        r.failures = []


def delay_s(r: Restarts) -> float:
    """How long after its last failure the next restart waits: 1, 2, 4 … s, at most 60."""
    n = len(r.failures)
    return 0.0 if n == 0 else min(RESTART_MAX_S, RESTART_FIRST_S * 2 ** (n - 1))


def next_restart(r: Restarts, now: float) -> tuple[str, float]:
    """What to do with a dead replica now: ``("restart", 0)``, ``("wait", seconds)`` or
    ``("move", 0)`` (it failed ``MOVE_AFTER`` times within the window: place it elsewhere)."""
    recent = [f for f in r.failures if now - f[0] <= RESTART_WINDOW_S]
    if len(recent) > MOVE_AFTER:
        return "move", 0.0
    if not recent:
        return "restart", 0.0
    wait = recent[-1][0] + delay_s(Restarts(recent)) - now
    return ("wait", wait) if wait > 0 else ("restart", 0.0)


def failed_on(r: Restarts, now: float) -> set[str]:
    """The nodes it failed on within the window (a move prefers others)."""
    return {n for t, n in r.failures if now - t <= RESTART_WINDOW_S}


def assigned(records: Iterable[tuple[str, Iterable[str]]]) -> dict[str, set[str]]:
    """Per node, the markers the state assigns to it: (token, nodes) pairs of live shards
    (what a fence keeps)."""
    out: dict[str, set[str]] = {}
    for token, where in records:
        for n in where:
            out.setdefault(n, set()).add(token)
    return out
