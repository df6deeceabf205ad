"""Fan discover out over the nodes: one SSH connection each, probes in parallel on it.

The effectful part (``discover``) only moves text; turning command outputs into
``NodeFacts`` is the pure ``facts_from_outputs``, tested without any SSH.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from cluster_cli.config.inventory import Inventory, Node
from cluster_cli.errors import SSHError
from cluster_cli.facts import Gpu, HcaPort, NodeFacts, lost_gpus_problem, printable_facts
from cluster_cli.probe.batch import BATCH_SHELL, build_script, parse_records
from cluster_cli.probe.commands import (
    GPU_FIELDS,
    LAUNCHED_AFTER_APPS,
    OPTIONAL_GPU_FIELDS,
    PROBES,
    SMINFO_AFTER_IBSTAT,
    gid_command,
    gid_record,
    query_gpu_args,
    sminfo_command,
    sminfo_record,
)
from cluster_cli.probe.parsers.host import parse_launched, parse_meminfo, parse_nproc
from cluster_cli.probe.parsers.ibstat import parse_gid_prefix, parse_ibstat, parse_sminfo
from cluster_cli.probe.parsers.nvidia_smi import (
    build_gpus,
    classify_failure,
    killed,
    parse_compute_apps,
    parse_lost,
    parse_query_gpu,
    unknown_field,
    unreadable_app_gpus,
    unreadable_gpu_rows,
    widen_query_gpu,
)
from cluster_cli.probe.parsers.topology import parse_topo
from cluster_cli.ssh.connect import AsyncsshConnector
from cluster_cli.ssh.session import CommandResult, Connector, Session

OnDone = Callable[[NodeFacts], None]
_SIGNALS = frozenset(int(s) for s in signal.Signals)


def _missing(r: CommandResult | None) -> bool:
    """The tool is not installed on the node (as opposed to installed and failing)."""
    if r is None:
        return True
    failure = classify_failure(r.rc, r.output)
    return failure is not None and failure.kind == "missing"


def facts_from_outputs(
    inv: Inventory,
    node: Node,
    outputs: Mapping[str, CommandResult],
    *,
    own_pids: frozenset[int] = frozenset(),
    own_tokens: frozenset[str] = frozenset(),
    sm_guids: Mapping[tuple[str, int], int | None] | None = None,
    probed_at: float | None = None,
    ib_ports: Sequence[HcaPort] | None = None,
    earlier: NodeFacts | None = None,
) -> NodeFacts:
    """Pure: the raw outputs of the probe commands of one node -> its facts.

    ``ib_ports`` is ``parse_ibstat`` of ``outputs["ibstat"]`` where the caller already has it.
    ``earlier``: the node's earlier facts, which give what a probe left out of ``outputs``
    (``cpus``, ``meminfo``, ``topo``, ``ibstat``: see ``HARDWARE_PROBES``) instead of
    unknown. A topology is taken only for the same GPUs. Without ``gpus``, the node has no
    GPU, as one without nvidia-smi.
    """
    problems: list[str] = []

    # CPU and memory
    if "cpus" not in outputs and earlier is not None:
        cpus = earlier.cpus
    else:
        cpus = parse_nproc(outputs["cpus"].stdout) if "cpus" in outputs and outputs["cpus"].rc == 0 else None
    if "meminfo" not in outputs and earlier is not None:
        mem = earlier.memory_mib
    else:
        mem = parse_meminfo(outputs["meminfo"].stdout) if "meminfo" in outputs and outputs["meminfo"].rc == 0 else None
    if cpus is None:
        problems.append("cpu: could not read the CPU count")
    if mem is None:
        problems.append("memory: could not read /proc/meminfo")

    # GPUs
    gpus: tuple = ()
    nvlink: tuple[tuple[int, ...], ...] | None = None
    smi = outputs.get("gpus")
    if smi is None or _missing(smi):
        nvlink = ()  # no nvidia-smi: a CPU node, no GPUs and so no NVLink
    else:
        rows, lost = parse_query_gpu(smi.output)
        failure = classify_failure(smi.rc, smi.output)
        if failure is not None and not rows and not lost:
            problems.append(f"nvidia-smi: {failure.message}")
        elif not rows and not lost:
            # rc 0 but nothing we can read: never report that as "no GPUs".
            first = smi.output.strip().splitlines()[0][:120] if smi.output.strip() else "empty output"
            problems.append(f"nvidia-smi: unreadable GPU list: {first!r}")
        else:
            apps = outputs.get("apps")
            # A lost GPU makes the process query exit non-zero while still listing the rest.
            # Killed (timed out, cut), its list may lack the very process that holds a GPU.
            apps_ok = apps is not None and (
                apps.rc == 0 or (not killed(apps.rc) and classify_failure(apps.rc, apps.output) is None)
            )
            procs = parse_compute_apps(apps.stdout) if apps is not None and apps_ok else []
            # The process query runs beside the GPU list and may be the one to find a GPU gone:
            # a row it names by bus id is lost (by index alone it is ambiguous, and a GPU the
            # list does not show by that bus id may be one of its fault rows: not a new GPU).
            buses = {r.pci_bus_id for r in rows if r.pci_bus_id}
            gone = [g for g in parse_lost(apps.output) if g.pci_bus_id in buses] if apps is not None else []
            # The replicas' own processes: the recorded ones, and every one carrying a marker
            # of theirs (workers the engine forked, whatever their PID).
            launched = outputs.get("launched")
            # grep exits 2 for a process that ended while it read (its environ gone): still read
            if launched is not None and launched.rc in (0, 2) and own_tokens:
                own_pids = own_pids | {p for p, t in parse_launched(launched.stdout).items() if t in own_tokens}
            gpus = build_gpus(rows, procs, [*lost, *gone], gpu_class=inv.gpu_class, own_pids=own_pids)
            if apps is not None and not apps_ok:
                problems.append("nvidia-smi: could not list compute processes; GPUs treated as busy")
                gpus = _with_problem(gpus, "foreign-process: unknown (query failed)")
            elif strangers := sorted({p.gpu_uuid for p in procs} - {g.uuid for g in gpus if g.uuid}, key=str.lower):
                # A process on a GPU the list does not show (a row cut from it, another
                # spelling): someone computes on one of this node's GPUs, which is unknown.
                problems.append(
                    f"nvidia-smi: a compute process runs on {strangers[0]}, which the GPU list does not show; "
                    "GPUs treated as busy"
                )
                gpus = _with_problem(gpus, f"foreign-process: on {strangers[0]} (not in the GPU list)")
            elif apps is not None and (hidden := unreadable_app_gpus(apps.stdout)):
                # A process row we cannot read is still someone computing on that GPU.
                known = {g.uuid for g in gpus if g.uuid}
                hit = set(hidden)
                if "" in hit or not hit <= known:
                    problems.append("nvidia-smi: a compute process row names no GPU we know; GPUs treated as busy")
                    hit = known
                gpus = _with_problem(
                    gpus, "foreign-process: unreadable process row (pid unknown)", lambda g: g.uuid in hit
                )
            topo = outputs.get("topo")
            if not gpus:
                nvlink = ()
            elif topo is not None and topo.rc == 0:
                nvlink = parse_topo(topo.stdout, gpus={g.index for g in gpus})
            elif topo is None and earlier is not None and _same_gpus(gpus, earlier.gpus):
                nvlink = earlier.nvlink_domains
            # A list that may be cut short frees nothing until a discover reads it whole: rows,
            # but nvidia-smi failed or timed out; or rc 0 with rows cut short or repeated.
            incomplete = None
            if smi.rc != 0 and (not (lost or any(r.fault for r in rows)) or killed(smi.rc)):
                # Lost GPUs (a line of their own, or a row of fault cells) make nvidia-smi exit
                # non-zero after a whole list; killed, it may not have got to the end of it.
                why = {124: "timed out", None: "gave no exit status"}.get(smi.rc, f"exited with rc {smi.rc}")
                incomplete = f"{why} after listing {len(rows)} GPU(s)"
            elif garbled := unreadable_gpu_rows(smi.output, rows):
                incomplete = f"{garbled} GPU row(s) cut short or repeated"
            if incomplete:
                problems.append(f"nvidia-smi: {incomplete}; the list may be incomplete")
                gpus = _with_problem(gpus, "unknown: GPU list incomplete")
                nvlink = None
            n_lost = sum(g.lost for g in gpus)
            if n_lost:
                problems.append(lost_gpus_problem(n_lost))

    # InfiniBand
    hcas: list[HcaPort] = []
    ib = outputs.get("ibstat")
    if ib is None and earlier is not None:  # left out: the ports as seen last, on today's fabrics
        hcas = [replace(p, fabric=inv.fabric_for(node, p.ca) if p.is_ib_attachment else None) for p in earlier.hcas]
    elif ib is not None and ib.rc == 0:
        for p in parse_ibstat(ib.stdout) if ib_ports is None else ib_ports:
            fab = inv.fabric_for(node, p.ca) if p.is_ib_attachment else None
            guid = (sm_guids or {}).get((p.ca, p.port))
            gid = outputs.get(gid_record(p.ca, p.port)) if p.is_ib_attachment else None
            prefix = parse_gid_prefix(gid.stdout) if gid is not None and gid.rc == 0 else None
            hcas.append(replace(p, fabric=fab, sm_guid=guid, subnet_prefix=prefix))
    elif ib is not None and not _missing(ib) and node.fabric:
        problems.append(
            f"ibstat: failed (rc {ib.rc}): {ib.output.strip().splitlines()[0] if ib.output.strip() else ''}"
        )
    if node.fabric and not any(h.is_ib_attachment for h in hcas):
        problems.append(f"fabric: declared on {node.fabric} but no Active InfiniBand port")
    if ib is not None and ib.rc == 0 and (absent := sorted(set(node.hca_fabrics) - {h.ca for h in hcas})):
        problems.append(f"fabric: hca_fabrics names {', '.join(absent)}, which ibstat does not list on this node")

    # What the node printed goes to terminals: every piece of its text made printable.
    return printable_facts(
        NodeFacts(
            name=node.name,
            host=node.host,
            reachable=True,
            error=None,
            cpus=cpus,
            memory_mib=mem,
            gpus=tuple(gpus),
            nvlink_domains=nvlink,
            hcas=tuple(hcas),
            fabric=node.fabric,
            labels=dict(node.labels),
            problems=tuple(problems),
            probed_at=probed_at,
        )
    )


async def run_batch(
    session: Session, commands: dict[str, str], timeout: float, then: dict[str, str] | None = None
) -> dict[str, CommandResult]:
    """Run ``commands`` in parallel as one remote exec; one result per record."""
    # Each probe gets well under the session's timeout, so one hung nvidia-smi is killed and
    # reported while the others' results still come back.
    # The probes' deadline leaves the batch time to kill stragglers and send what it has.
    script, token = build_script(commands, per_command_timeout_s=max(1.0, 0.6 * timeout, timeout - 6), then=then)
    rc, out, err = await session.run_raw(BATCH_SHELL, timeout=timeout, input=script.encode())
    results = parse_records(commands, out, token)
    if rc not in (0, None) and all(r.rc is None for r in results.values()):
        # The cause is the last line (a nologin shell's "This account is currently not
        # available."); sshd's own warning that the home folder is missing comes first.
        said = [ln.strip() for ln in err.decode("utf-8", "replace").splitlines() if ln.strip()]
        why = [ln for ln in said if not ln.startswith("Could not chdir to home directory")] or said
        killed = rc > 128 and rc - 128 in _SIGNALS
        how = f"was killed by {signal.Signals(rc - 128).name}" if killed else f"failed (rc {rc})"
        raise SSHError(f"probe script {how}: {why[-1] if why else 'no output'}")
    return results


async def probe_node(
    inv: Inventory,
    node: Node,
    connector: Connector,
    *,
    own_pids: frozenset[int] = frozenset(),
    own_tokens: frozenset[str] = frozenset(),
    deadline: float | None = None,
    extra: Mapping[str, str] | None = None,
    on_outputs: Callable[[str, dict[str, CommandResult]], None] | None = None,
    earlier: NodeFacts | None = None,
    leave_out: frozenset[str] = frozenset(),
) -> NodeFacts:
    """Probe one node; never raises for node-level failures (they become ``error``).

    ``deadline`` (``time.monotonic()``): when the whole node must be done. The probes' own
    timeouts are fitted inside it, so that a hung nvidia-smi is killed and reported with the
    node's other facts, not the node given up on as unreachable. ``extra`` commands run in the
    same batch; ``on_outputs`` gets every record of it (theirs included). The probes named in
    ``leave_out`` are not run: their facts are taken from ``earlier`` (given with them)."""
    target = inv.ssh_target(node)
    started = time.time()

    def command_timeout() -> float:
        if deadline is None:
            return target.command_timeout_s
        left = deadline - time.monotonic() - _DEADLINE_MARGIN_S
        return max(_MIN_COMMAND_TIMEOUT_S, min(target.command_timeout_s, left))

    try:
        async with connector.session(target) as session:
            # sminfo for the Active IB ports starts inside the same exec once ibstat is done.
            probes = {k: v for k, v in PROBES.items() if k not in leave_out}
            then = {"ibstat": SMINFO_AFTER_IBSTAT} if "ibstat" in probes else {}
            if own_tokens and "apps" in probes:
                then["apps"] = LAUNCHED_AFTER_APPS
            outputs = await run_batch(session, {**probes, **(extra or {})}, command_timeout(), then=then)
            if on_outputs is not None:
                on_outputs(node.name, outputs)
            await _narrow_gpu_query(session, outputs, command_timeout)
            sm: dict[tuple[str, int], int | None] = {}
            ib = outputs.get("ibstat")
            every_port = parse_ibstat(ib.stdout) if ib is not None and ib.rc == 0 else None
            if every_port is not None:
                ports = [p for p in every_port if p.is_ib_attachment]
                got = {(p.ca, p.port): outputs.get(sminfo_record(p.ca, p.port)) for p in ports}
                # Ports our parser sees that the in-batch shortcut missed: ask in a second exec.
                again = [k for k, r in got.items() if r is None]
                if again:
                    cmds = {f"sm{i}": sminfo_command(ca, port) for i, (ca, port) in enumerate(again)}
                    gids = [k for k in again if gid_record(*k) not in outputs]
                    cmds.update({f"gid{i}": gid_command(ca, port) for i, (ca, port) in enumerate(gids)})
                    try:
                        res = await run_batch(session, cmds, command_timeout())
                    except SSHError:
                        res = {}  # keep the facts already gathered; SM identity stays unknown
                    got.update({k: res.get(f"sm{i}") for i, k in enumerate(again)})
                    outputs.update({gid_record(*k): r for i, k in enumerate(gids) if (r := res.get(f"gid{i}"))})
                sm = {k: parse_sminfo(r.stdout) if r is not None and r.rc == 0 else None for k, r in got.items()}
        return facts_from_outputs(
            inv,
            node,
            outputs,
            own_pids=own_pids,
            own_tokens=own_tokens,
            sm_guids=sm,
            probed_at=started,
            ib_ports=every_port,
            earlier=earlier,
        )
    except SSHError as e:
        return unreachable(node, e.message.removeprefix(f"{node.name}: "), started)


async def _narrow_gpu_query(
    session: Session, outputs: dict[str, CommandResult], command_timeout: Callable[[], float]
) -> None:
    """An older driver refuses the whole ``--query-gpu`` for one field it does not know: ask
    again without it (and without each further one it names), and put the answer in
    ``outputs["gpus"]`` with those columns ``[N/A]`` (unknown, as on a GPU without them)."""
    fields = GPU_FIELDS
    while (r := outputs.get("gpus")) is not None and (bad := unknown_field(r.rc, r.output)) is not None:
        if bad not in OPTIONAL_GPU_FIELDS or bad not in fields:
            return  # a field the list cannot do without, or one already left out: a real failure
        fields = tuple(f for f in fields if f != bad)
        try:
            res = await run_batch(session, {"gpus": f"nvidia-smi {query_gpu_args(fields)}"}, command_timeout())
        except SSHError:
            return  # keep the refusal: the GPU list stays unknown, the node's other facts stand
        got = res["gpus"]
        outputs["gpus"] = replace(got, stdout=widen_query_gpu(got.stdout, fields))


_DEADLINE_MARGIN_S = 1.5  # after the probes' timeout: the batch's kill and its answer's way back
_MIN_COMMAND_TIMEOUT_S = 2.0


def _same_gpus(now: Sequence[Gpu], before: Sequence[Gpu]) -> bool:
    """The same GPUs at the same indices (by UUID where both know it)."""
    return sorted((g.index, g.uuid) for g in now) == sorted((g.index, g.uuid) for g in before)


def _with_problem(gpus: tuple[Gpu, ...], problem: str, which: Callable[[Gpu], bool] | None = None) -> tuple[Gpu, ...]:
    """``gpus`` with ``problem`` added to each (or to each that ``which`` picks)."""
    return tuple(replace(g, problems=(*g.problems, problem)) if which is None or which(g) else g for g in gpus)


def unreachable(node: Node, error: str, at: float | None = None) -> NodeFacts:
    return NodeFacts(
        name=node.name,
        host=node.host,
        reachable=False,
        error=error,
        fabric=node.fabric,
        labels=dict(node.labels),
        probed_at=at,
    )


async def discover(
    inv: Inventory,
    nodes: Sequence[Node] | None = None,
    *,
    connector: Connector | None = None,
    parallel: int = 64,
    node_timeout_s: float | None = None,
    own_pids: Mapping[str, frozenset[int]] | None = None,
    own_tokens: Mapping[str, frozenset[str]] | None = None,
    extra: Mapping[str, Mapping[str, str]] | None = None,
    on_outputs: Callable[[str, dict[str, CommandResult]], None] | None = None,
    on_done: OnDone | None = None,
    carry: Mapping[str, tuple[NodeFacts, frozenset[str]]] | None = None,
) -> list[NodeFacts]:
    """Probe ``nodes`` (default: all) with at most ``parallel`` at once. ``carry``: per node,
    its earlier facts and the probes to leave out, whose facts are taken from them.

    Each node gets a hard deadline (connect + command timeouts unless given), so a
    frozen or black-holed node is reported, never waited on forever. Results come
    back in inventory order.
    """
    connector = connector or AsyncsshConnector()
    nodes = list(inv.nodes if nodes is None else nodes)
    sem = asyncio.Semaphore(max(1, parallel))

    async def one(n: Node) -> NodeFacts:
        t = inv.ssh_target(n)
        # First contact (accept-new) + connect, then the probe batch and the sminfo batch.
        deadline = node_timeout_s or (2 * t.connect_timeout_s + 2 * t.command_timeout_s + 2)
        earlier, leave_out = (carry or {}).get(n.name, (None, frozenset()))
        async with sem:
            try:
                ends = time.monotonic() + deadline
                f = await asyncio.wait_for(
                    probe_node(
                        inv,
                        n,
                        connector,
                        own_pids=(own_pids or {}).get(n.name, frozenset()),
                        own_tokens=(own_tokens or {}).get(n.name, frozenset()),
                        deadline=ends,
                        extra=(extra or {}).get(n.name),
                        on_outputs=on_outputs,
                        earlier=earlier,
                        leave_out=leave_out,
                    ),
                    timeout=deadline,
                )
            except TimeoutError:
                f = unreachable(n, f"no answer within {deadline:g}s", time.time())
            except Exception as e:  # a failing node never takes the run down
                f = unreachable(n, f"probe failed: {type(e).__name__}: {e}", time.time())  # a bug: name it
        # Everything a node said is made printable before it is shown or stored (its text
        # reaches the operator's terminal: ESC ] 52 ... would write their clipboard). The facts
        # of a node that answered are so already (facts_from_outputs); an error is not yet.
        if not f.reachable:
            f = printable_facts(f)
        if on_done is not None:
            on_done(f)
        return f

    try:
        return list(await asyncio.gather(*(one(n) for n in nodes)))
    finally:
        aclose = getattr(connector, "aclose", None)  # shared jump-host connections, if any
        if aclose is not None:
            await aclose()
