"""Checks of the node builders in ``helpers.py`` that the placement tests rely on."""

from __future__ import annotations

from helpers import dgx


def test_dgx_has_eight_rails_on_one_fabric() -> None:
    n = dgx("gpu-01")
    assert n.fabrics == frozenset({"ib-a"})
    assert len(n.hcas) == 8 and all(h.is_ib_attachment for h in n.hcas)
    assert all(g.free for g in n.gpus) and n.nvlink_domains == (tuple(range(8)),)


def test_problem_gpus_are_not_free() -> None:
    n = dgx("gpu-01", problems={0: "ecc", 1: "foreign", 2: "lost", 3: "mig"})
    assert [g.free for g in n.gpus[:5]] == [False, False, False, False, True]
    assert [g.healthy for g in n.gpus[:4]] == [False, True, False, True]
