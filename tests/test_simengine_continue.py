"""The simulated engine continues its own text (tests/simengine.py), as a router asks it to
when it continues a cut stream: the whole text must equal an uncut reply's."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from simengine import WORDS, Fleet, LoopThread, SimEngine, held_pieces

MSG = [{"role": "user", "content": "hi"}]


def uncut(n: int, start: int = 0) -> str:
    return "".join(WORDS[i % len(WORDS)].decode() + " " for i in range(start, start + n))


@pytest.fixture(params=[0.0, 0.001], ids=["instant", "paced"])
def engine(request: pytest.FixtureRequest) -> Iterator[SimEngine]:
    lt = LoopThread()
    eng = SimEngine(tokens=20, token_delay_s=request.param)
    lt.run(eng.start())
    try:
        yield eng
    finally:
        lt.run(eng.stop())
        lt.close()


def stream(url: str, path: str, body: dict) -> tuple[str, list[dict]]:
    """The text of a streamed reply and its chunks."""
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=10) as r:
        assert r.status_code == 200
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(x) for x in lines[:-1]]
    key = "text" if path.endswith("/completions") and "chat" not in path else None
    text = "".join((c["choices"][0]["text"] if key else c["choices"][0]["delta"].get("content") or "") for c in chunks)
    return text, chunks


def test_held_pieces():
    assert held_pieces(uncut(3)) == (3, "")
    assert held_pieces(uncut(9)) == (9, "")  # across the words' cycle
    assert held_pieces("lorem ipsum") == (1, " ")  # a template that trimmed the trailing space
    assert held_pieces("lorem ip") == (1, "sum ")
    assert held_pieces("ipsum ") is None and held_pieces("lorem lorem ") is None


def test_chat_continues_the_final_assistant_message(engine: SimEngine):
    done = uncut(7)
    body = {
        "messages": [*MSG, {"role": "assistant", "content": done}],
        "continue_final_message": True,
        "add_generation_prompt": False,
        "max_tokens": 13,
    }
    text, chunks = stream(engine.url, "/v1/chat/completions", body)
    assert done + text == uncut(20)
    assert all(c["sim_continued_from"] == 7 for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert engine.continued == 1
    r = httpx.post(engine.url + "/v1/chat/completions", json=body, timeout=10).json()  # not streamed
    assert done + r["choices"][0]["message"]["content"] == uncut(20)


def test_chat_continues_inside_a_piece(engine: SimEngine):
    body = {"messages": [*MSG, {"role": "assistant", "content": "lorem ipsum dol"}], "continue_final_message": True}
    text, chunks = stream(engine.url, "/v1/chat/completions", {**body, "max_tokens": 3})
    assert text == "or sit amet " and chunks[0]["sim_continued_from"] == 2


def test_completions_prompt_ending_with_the_engines_text(engine: SimEngine):
    done = uncut(5)
    text, chunks = stream(engine.url, "/v1/completions", {"prompt": "say lorem: " + done, "max_tokens": 4})
    assert text == uncut(4, 5) and chunks[0]["sim_continued_from"] == 5
    text, _ = stream(engine.url, "/v1/completions", {"prompt": [done], "max_tokens": 2})
    assert text == uncut(2, 5)


def test_other_requests_start_from_the_beginning(engine: SimEngine):
    # An assistant message without continue_final_message, other text, a prompt's own word.
    for path, body in (
        ("/v1/chat/completions", {"messages": [*MSG, {"role": "assistant", "content": uncut(3)}]}),
        ("/v1/chat/completions", {"messages": [*MSG, {"role": "assistant", "content": "hello"}], "continue_final_message": True}),
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/completions", {"prompt": "Say lorem"}),
    ):  # fmt: skip
        text, chunks = stream(engine.url, path, {**body, "max_tokens": 4})
        assert text == uncut(4) and not any("sim_continued_from" in c for c in chunks), body
    assert engine.continued == 0
    assert "sim_requests_continued_total 0" in httpx.get(engine.url + "/metrics").text


def test_a_stream_cut_twice_reads_as_one_through_the_router():
    """Each engine cuts after 5 tokens; the router continues on the next: the text is whole."""
    f = Fleet(3, capacity=4, token_delay_s=0.001, tokens=12).start()
    try:
        for e in f.engines:
            f.lt.call(lambda e=e: setattr(e, "cut_after", 5))
        text, chunks = stream(f.base, "/chat/completions", {"model": "sim", "messages": MSG, "max_tokens": 12})
        assert text == uncut(12)
        assert len({c["id"] for c in chunks}) == 1
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]] == ["length"]
        marks = [c.get("sim_continued_from") for c in chunks if c["choices"][0]["delta"].get("content")]
        assert marks == [None] * 5 + [5] * 5 + [10] * 2
        assert sum(e.continued for e in f.engines) == 2
    finally:
        f.close()
