"""What a request shares with earlier ones: its prompt as hashed blocks, its session key.

Pure, no I/O. An engine that has just processed a prompt keeps it in its KV cache (vLLM's
prefix caching, llama-server's slot cache); the ``prefix`` policy sends the next request
sharing that prompt's beginning to the same replica. This module gives it the pieces:

* :func:`prompt_text` normalises a request's prompt so that it does not depend on an
  engine's chat template: the messages in order, each as role and content (tools first).
* :func:`blocks` cuts that text into blocks of ``block_chars`` characters and hashes each
  with everything before it (a chain), so one hash names one whole prefix.
* :class:`PrefixIndex` is a trie over those blocks, stored flat (a prefix's chain hash is
  its node), bounded in nodes and evicted least recently used. Each node records which
  endpoints served that prefix, and in which of their cache generations: an endpoint whose
  cache is gone (restarted, removed, drained) bumps its generation and matches nothing.
* :class:`Sessions` maps a session key to the endpoint that served it, bounded too.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

CHAT_PATH = b"/v1/chat/completions"
COMPLETIONS_PATH = b"/v1/completions"
_SEP = "\x1e"  # between messages: a character no text is expected to hold


def _content(content: object) -> str:
    """A message's content as text: text parts as they are, other parts by their JSON."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                out.append(part["text"])
            else:
                out.append(json.dumps(part, sort_keys=True, separators=(",", ":")))
        return "".join(out)
    return "" if content is None else json.dumps(content, sort_keys=True, separators=(",", ":"))


def prompt_text(path: bytes, body: Mapping[str, Any]) -> str | None:
    """The request's prompt, normalised; None when it has none that can be matched."""
    if path == CHAT_PATH:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            return None
        parts = []
        tools = body.get("tools")
        if tools:
            parts.append("tools\n" + json.dumps(tools, sort_keys=True, separators=(",", ":")))
        for m in msgs:
            if not isinstance(m, dict):
                return None
            text = _content(m.get("content"))
            if m.get("tool_calls"):
                text += json.dumps(m["tool_calls"], sort_keys=True, separators=(",", ":"))
            parts.append(f"{m.get('role', '')}\n{text}")
        return _SEP.join(parts) + _SEP
    if path == COMPLETIONS_PATH:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return " ".join(map(str, prompt))  # token ids: a prefix of ids is a prefix of this
    return None


def blocks(text: str, block_chars: int, max_blocks: int) -> tuple[int, ...]:
    """The chain hashes of ``text``'s whole blocks, at most ``max_blocks`` of them.

    The hash of block ``i`` covers blocks ``0..i``: equal hashes mean equal prefixes (up to
    a 64-bit collision). A last partial block is left out: the next turn of a conversation
    extends it, so it would never match.
    """
    n = min(len(text) // block_chars, max_blocks)
    out = []
    h = 0
    for i in range(n):
        h = hash((h, text[i * block_chars : (i + 1) * block_chars]))
        out.append(h)
    return tuple(out)


class PrefixIndex:
    """Which endpoints recently served which prefixes: a trie over chain-hashed blocks.

    ``max_nodes`` bounds it; the least recently used nodes go first, deepest before their
    parents (a prefix is touched after its extensions), so a match walks no holes in the
    common case. A hole left by eviction ends a match early: it only loses affinity.
    """

    __slots__ = ("_nodes", "max_nodes")

    def __init__(self, max_nodes: int) -> None:
        self.max_nodes = max_nodes
        # chain hash -> {endpoint URL: its cache generation when it served the prefix}
        self._nodes: OrderedDict[int, dict[str, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._nodes)

    def match(self, hashes: Sequence[int], gens: Mapping[str, int]) -> tuple[int, list[str]]:
        """The deepest prefix of ``hashes`` that some of ``gens``' endpoints served in their
        current generation: (blocks matched, those endpoints). (0, []) when none did."""
        depth, best = 0, []
        nodes = self._nodes
        for i, h in enumerate(hashes):
            node = nodes.get(h)
            if node is None:
                break
            here = [u for u, g in node.items() if gens.get(u) == g]
            if not here:
                break
            depth, best = i + 1, here
        return depth, best

    def insert(self, hashes: Sequence[int], url: str, gen: int) -> None:
        """Record that ``url`` (in cache generation ``gen``) now holds every prefix of ``hashes``."""
        nodes = self._nodes
        for h in reversed(hashes):  # the shortest prefix ends up the most recently used
            node = nodes.get(h)
            if node is None:
                nodes[h] = {url: gen}
            else:
                node[url] = gen
                nodes.move_to_end(h)
        self.trim()

    def trim(self) -> None:
        """Evict the least recently used nodes down to ``max_nodes``."""
        nodes = self._nodes
        while len(nodes) > self.max_nodes:
            nodes.popitem(last=False)

    def forget(self, urls: Iterable[str]) -> None:
        """Drop every entry of ``urls`` now (their nodes too, once empty)."""
        drop = set(urls)
        if not drop:
            return
        for h in [h for h, node in self._nodes.items() if drop.intersection(node)]:
            node = self._nodes[h]
            for u in drop:
                node.pop(u, None)
            if not node:
                del self._nodes[h]


class Sessions:
    """Session key -> (endpoint URL, its cache generation), least recently used dropped past ``max_keys``."""

    __slots__ = ("_map", "max_keys")

    def __init__(self, max_keys: int) -> None:
        self.max_keys = max_keys
        self._map: OrderedDict[str, tuple[str, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._map)

    def get(self, key: str) -> tuple[str, int] | None:
        hit = self._map.get(key)
        if hit is not None:
            self._map.move_to_end(key)
        return hit

    def put(self, key: str, url: str, gen: int) -> None:
        self._map[key] = (url, gen)
        self._map.move_to_end(key)
        while len(self._map) > self.max_keys:
            self._map.popitem(last=False)


class Affinity:
    """One request's affinity: its model, prompt blocks and session key; the policy writes
    back what it decided (for the metrics and the access log)."""

    __slots__ = ("block_chars", "blocks", "full", "matched", "model", "outcome", "session")

    def __init__(self, model: str, blocks: tuple[int, ...], session: str | None = None, block_chars: int = 64) -> None:
        self.model = model
        self.blocks = blocks
        self.block_chars = block_chars  # what ``blocks`` were cut at: matched blocks as characters
        self.session = session
        self.full: tuple[Any, ...] = ()  # eligible endpoints left out for being saturated
        self.matched = 0  # blocks the chosen endpoint already held
        self.outcome = ""  # session, matched, overridden, full, miss, short

    @property
    def matched_chars(self) -> int:
        return self.matched * self.block_chars

    @property
    def prompt_chars(self) -> int:
        return len(self.blocks) * self.block_chars

    def note(self) -> str:
        return f"affinity {self.outcome}: {self.matched_chars}/{self.prompt_chars} chars"
