"""Hypothesis strategies shared by the parser tests."""

from __future__ import annotations

from hypothesis import strategies as st


@st.composite
def mutated(draw: st.DrawFn, texts: list[str]) -> str:
    """A real fixture, cut, spliced and garbled a few times."""
    text = draw(st.sampled_from(texts))
    for _ in range(draw(st.integers(0, 4))):
        n = len(text)
        i = draw(st.integers(0, n))
        j = draw(st.integers(i, n))
        op = draw(st.sampled_from(["truncate", "delete", "insert", "duplicate", "swap-lines"]))
        if op == "truncate":
            text = text[:i]
        elif op == "delete":
            text = text[:i] + text[j:]
        elif op == "insert":
            text = text[:i] + draw(st.text(max_size=20)) + text[i:]
        elif op == "duplicate":
            text = text[:j] + text[i:j] + text[j:]
        else:
            text = "\n".join(draw(st.permutations(text.split("\n"))))
    return text
