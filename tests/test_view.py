"""state.view's pure helpers: what a new discover's facts say next to the last ones."""

from __future__ import annotations

from dataclasses import replace

from helpers import cpu_node, dgx

from cluster_cli.facts import NodeFacts
from cluster_cli.state.view import note_lost_ports, note_vanished_gpus


def test_gpus_that_vanished_without_an_nvidia_smi_error_are_a_problem() -> None:
    before = replace(dgx("g", cls="H200"), probed_at=0.0)
    now = replace(cpu_node("g"), probed_at=60.0)  # nvidia-smi not found: reads as a CPU node
    (problem,) = note_vanished_gpus(now, before).problems
    assert problem == (
        "gpus-gone: nvidia-smi shows no GPU here (not installed, or not on PATH, or no driver), "
        "but the last discover (1970-01-01 00:00 UTC) saw 8 H200"
    )
    again = note_vanished_gpus(replace(now, problems=()), note_vanished_gpus(now, before))
    assert again.problems == (problem,)  # said on every discover until they come back
    assert note_vanished_gpus(before, again).problems == ()  # back


def test_no_gpus_is_no_problem_where_nothing_says_they_vanished() -> None:
    gpu, cpu = dgx("g"), cpu_node("g")
    assert note_vanished_gpus(cpu, None) is cpu  # first discover
    assert note_vanished_gpus(cpu, cpu_node("g")) is cpu  # always a CPU node
    assert note_vanished_gpus(gpu, gpu) is gpu  # GPUs still there
    down = replace(cpu, reachable=False)
    assert note_vanished_gpus(down, gpu) is down  # not seen now: its last facts stand
    failing = replace(cpu, problems=("nvidia-smi: NVIDIA-SMI has failed (rc 9)",))
    assert note_vanished_gpus(failing, gpu) is failing  # the failure already says why


def test_an_ib_port_that_was_active_and_is_not_now_is_a_problem_until_it_is_back() -> None:
    before = dgx("g")  # 8 Active ports on ib-a
    down = replace(before.hcas[2], state="Down", physical_state="Disabled")
    now = replace(before, hcas=(*before.hcas[:2], down, *before.hcas[3:]))
    (problem,) = note_lost_ports(now, before).problems
    assert problem == "ib-port-down: mlx5_2 port 1 was Active on ib-a at the last discover, now Down (Disabled)"
    later = note_lost_ports(now, note_lost_ports(now, before))  # the next discover: still down
    assert later.problems == (problem,)
    assert note_lost_ports(before, later).problems == ()  # Active again
    gone = replace(before, hcas=before.hcas[1:])  # the card vanished from ibstat
    assert note_lost_ports(gone, before).problems == (
        "ib-port-down: mlx5_0 port 1 was Active on ib-a at the last discover, now missing from ibstat",
    )
    spare = replace(before, hcas=(*before.hcas, replace(before.hcas[0], ca="mlx5_9", state="Down")))
    assert note_lost_ports(spare, spare).problems == ()  # never Active: an unused port, no problem


def test_the_discover_table_tells_lost_unknown_and_gone_gpus_apart() -> None:
    from cluster_cli.cli.discover import gpu_summary
    from cluster_cli.facts import Gpu

    a100 = dgx("a", cls="A100")
    lost = Gpu(index=3, uuid="", product="unknown", gpu_class="unknown", lost=True)
    four = replace(a100, gpus=(*a100.gpus[:3], lost))
    assert gpu_summary(four) == "3/4 A100 (1 lost)"
    assert gpu_summary(a100) == "8/8 A100"
    failing = replace(cpu_node("c"), problems=("nvidia-smi: NVIDIA-SMI has failed (rc 9)",))
    assert gpu_summary(failing) == "unknown"  # not a CPU node's "-"
    assert gpu_summary(cpu_node("c")) == "-"
    gone = replace(cpu_node("c"), problems=("gpus-gone: nvidia-smi shows no GPU here ...",))
    assert gpu_summary(gone) == "none (gone)"


def test_a_rail_down_on_the_first_discover_is_a_problem_but_an_unused_second_port_is_not() -> None:
    """Nothing was seen Active before a node's first discover: a card with no Active port
    while the node's other cards of its kind have one is a rail down (a cable, a switch port)
    from day one; the unused second port of a dual-port card is not."""
    rails = tuple(replace(h, ca_type="MT4129") for h in dgx("g").hcas)
    down = replace(rails[2], state="Down", physical_state="Polling")
    first = replace(dgx("g"), hcas=(*rails[:2], down, *rails[3:]))
    (problem,) = note_lost_ports(first, None).problems
    assert problem == "ib-port-down: mlx5_2 port 1 is Down (Polling) while 7 other MT4129 cards on this node are Active"
    # said once on every discover, not twice, and gone once the port is Active
    assert note_lost_ports(first, note_lost_ports(first, None)).problems == (problem,)
    assert note_lost_ports(replace(first, hcas=rails), note_lost_ports(first, None)).problems == ()
    # a dual-port card whose second port is unused: its card has an Active port
    spare = replace(rails[0], port=2, state="Down", physical_state="Polling")
    assert note_lost_ports(replace(first, hcas=(*rails, spare)), None).problems == ()
    # an Ethernet (RoCE) port is no InfiniBand rail
    eth = replace(rails[0], ca="mlx5_8", state="Down", link_layer="Ethernet")
    assert note_lost_ports(replace(first, hcas=(*rails, eth)), None).problems == ()


def test_a_vanished_gpu_note_is_said_once_and_lost_gpus_are_not_counted_as_seen() -> None:
    old = dgx("h-1", problems={7: "lost"})
    new = NodeFacts(name="h-1", cpus=8, memory_mib=1024, nvlink_domains=None)
    noted = note_vanished_gpus(new, old)
    (gone,) = [p for p in noted.problems if p.startswith("gpus-gone")]
    assert "7 H100" in gone and "8 H100" not in gone
    again = note_vanished_gpus(noted, old)
    assert again.problems == noted.problems
