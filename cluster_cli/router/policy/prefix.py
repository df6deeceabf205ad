"""Prefix and session affinity, guarded by load: send a request where its prompt is cached.

Per model, a :class:`~cluster_cli.router.affinity.PrefixIndex` remembers which endpoints
recently served which prompt prefixes. A request goes, in order of preference:

1. to its session's endpoint (``X-Session-ID`` or the body's ``user``), if still eligible,
   in the same cache generation and not over the guard;
2. to the endpoint holding its longest prefix, if that match is at least
   ``min_match_chars`` long and the endpoint is not over the guard (several holding it:
   the least loaded of them);
3. otherwise to the least loaded endpoint (``least_load``).

A saturated replica is never a candidate: when one held more of the prompt than any
candidate, the decision is counted as ``full`` (affinity lost to load), whatever it was.

The guard: an endpoint is too busy for affinity when its load exceeds the least loaded
candidate's by more than ``balance_abs`` requests *and* is more than ``balance_rel`` times it
(the two thresholds of the SGLang gateway's cache-aware policy). The chosen endpoint then
holds the request's prefixes, in its current cache generation.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import TYPE_CHECKING

from cluster_cli.router.affinity import Affinity, PrefixIndex, Sessions
from cluster_cli.router.endpoint import Endpoint
from cluster_cli.router.policy.least_load import LeastLoad

if TYPE_CHECKING:
    from cluster_cli.router.config import PrefixSpec


class PrefixAffinity:
    name = "prefix"

    def __init__(self, spec: PrefixSpec | None = None, rng: random.Random | None = None) -> None:
        from cluster_cli.router.config import PrefixSpec

        self.spec = spec or PrefixSpec()
        self._load = LeastLoad(rng)
        self.indexes: dict[str, PrefixIndex] = {}
        self.sessions: dict[str, Sessions] = {}

    def configure(self, spec: PrefixSpec) -> None:
        """New thresholds and bounds from a reload; what was learned stays (trimmed to the bounds)."""
        if spec.block_chars != self.spec.block_chars:
            self.indexes.clear()  # hashes of other blocks: nothing would match again
        self.spec = spec
        for index in self.indexes.values():
            index.max_nodes = spec.max_nodes
            index.trim()
        for s in self.sessions.values():
            s.max_keys = spec.max_sessions

    def forget_model(self, model: str) -> None:
        self.indexes.pop(model, None)
        self.sessions.pop(model, None)

    def over_guard(self, w: Endpoint, least: Endpoint, now: float) -> bool:
        lw, lm = w.load(now), least.load(now)
        return lw - lm > self.spec.balance_abs and lw > self.spec.balance_rel * lm

    def select(self, endpoints: Sequence[Endpoint], now: float, hint: Affinity | None = None) -> Endpoint | None:
        least = self._load.select(endpoints, now)
        if hint is None or least is None:
            return least
        spec = self.spec
        index = self.indexes.get(hint.model)
        if index is None:
            index = self.indexes[hint.model] = PrefixIndex(spec.max_nodes)
        by_url = {w.url: w for w in endpoints}
        gens = {u: w.cache_gen for u, w in by_url.items()}
        depth, holders = index.match(hint.blocks, gens)
        choice = None
        sessions = None
        if hint.session is not None:
            sessions = self.sessions.get(hint.model)
            if sessions is None:
                sessions = self.sessions[hint.model] = Sessions(spec.max_sessions)
            hit = sessions.get(hint.session)
            if hit is not None and gens.get(hit[0]) == hit[1]:
                w = by_url[hit[0]]
                if not self.over_guard(w, least, now):
                    choice, hint.outcome = w, "session"
                    hint.matched = depth if w.url in holders else 0
        if choice is None:
            if depth * spec.block_chars < spec.min_match_chars:
                choice, hint.outcome = least, ("short" if depth else "miss")
                hint.matched = depth if least.url in holders else 0
            else:
                best = least if least.url in holders else self._load.select([by_url[u] for u in holders], now)
                assert best is not None
                if self.over_guard(best, least, now):
                    choice, hint.outcome, hint.matched = least, "overridden", 0
                else:
                    choice, hint.outcome, hint.matched = best, "matched", depth
        if hint.full and hint.outcome != "session":
            # A full replica held more of the prompt than any candidate: affinity lost to load.
            deeper, _ = index.match(hint.blocks, {w.url: w.cache_gen for w in hint.full})
            if deeper > depth and deeper * spec.block_chars >= spec.min_match_chars:
                hint.outcome = "full"
        index.insert(hint.blocks, choice.url, choice.cache_gen)
        if sessions is not None and hint.session is not None:
            sessions.put(hint.session, choice.url, choice.cache_gen)
        return choice
