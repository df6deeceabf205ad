"""Load-balancing policies. Each gets only eligible, unsaturated endpoints and picks one.

``least_load`` (default) scans every candidate; ``p2c`` samples two; ``round_robin``
ignores load. ``bench/router.py`` compares them on unequal engines.
"""

from __future__ import annotations

from cluster_cli.router.policy.base import Policy
from cluster_cli.router.policy.least_load import LeastLoad
from cluster_cli.router.policy.p2c import PowerOfTwo
from cluster_cli.router.policy.round_robin import RoundRobin

POLICIES: dict[str, type[Policy]] = {"least_load": LeastLoad, "p2c": PowerOfTwo, "round_robin": RoundRobin}


def make_policy(name: str) -> Policy:
    return POLICIES[name]()


__all__ = ["POLICIES", "LeastLoad", "Policy", "PowerOfTwo", "RoundRobin", "make_policy"]
