"""Load-balancing policies. Each gets only eligible, unsaturated endpoints and picks one.

``least_load`` (default) scans every candidate; ``p2c`` samples two; ``round_robin``
ignores load; ``prefix`` sends a request where its prompt's beginning was served, guarded
by load. ``bench/router.py`` compares them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cluster_cli.router.policy.base import Policy
from cluster_cli.router.policy.least_load import LeastLoad
from cluster_cli.router.policy.p2c import PowerOfTwo
from cluster_cli.router.policy.prefix import PrefixAffinity
from cluster_cli.router.policy.round_robin import RoundRobin

if TYPE_CHECKING:
    from cluster_cli.router.config import PrefixSpec

POLICIES: dict[str, type[Policy]] = {
    "least_load": LeastLoad,
    "p2c": PowerOfTwo,
    "round_robin": RoundRobin,
    "prefix": PrefixAffinity,
}


def make_policy(name: str, prefix: PrefixSpec | None = None) -> Policy:
    if name == "prefix":
        return PrefixAffinity(prefix)
    return POLICIES[name]()


__all__ = ["POLICIES", "LeastLoad", "Policy", "PowerOfTwo", "PrefixAffinity", "RoundRobin", "make_policy"]
