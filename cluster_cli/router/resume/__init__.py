"""Continue a stream that its engine cut, on another replica, as one stream to the client.

Pure pieces, no I/O: the forwarding loop feeds them bytes and sends what they return.

* :class:`StreamState` records what the client has been sent: the response's ``id``,
  ``model``, ``created`` and ``object``, the text of choice 0, the tokens relayed, whether
  a ``finish_reason`` and ``data: [DONE]`` went out, and whatever makes the stream
  impossible to continue faithfully (several choices, logprobs, a tool call, reasoning).
* :class:`Seam` rewrites one upstream response's SSE events into the client's stream. The
  first upstream's events pass as sent, less the usage the router asked for on its own
  behalf; a continuation's events get the first response's ``id``, ``model``, ``created``
  and ``object``, lose the role chunk and leading empty chunks the client already had, and
  the usage the client asked for comes once, at the end, summed across the seams.
* :func:`upstream_body` is the first upstream request (usage asked for, to count tokens);
  :func:`can_resume` says whether a cut stream may be continued (``None``) or why not;
  :func:`continuation` is the request that continues it; :func:`cut_event` is the SSE
  error event a stream that cannot go on ends with (the shape the router sends today).

A cut stream is handled so::

    state = StreamState()                           # a retry before any byte went out: a new one
    seam = Seam(state, body)                        # one Seam per upstream response
    send(upstream_body(body, engine))
    for data in reads: client.write(seam.feed(data))
    # clean end of the upstream body: client.write(seam.end())
    # a cut, once a byte reached the client:
    if tail := seam.close(): client.write(tail)     # it needed no more tokens: ended here
    elif (why := can_resume(body, path, state, tries, limit)) is None:
        tries += 1; seam = Seam(state, body); send(continuation(body, path, state, engine))
    else: client.write(cut_event(cause, why))

How tokens are counted. The router never tokenizes text. :func:`upstream_body` and
:func:`continuation` ask the engine for its own count as it goes: vLLM's
``stream_options.continuous_usage_stats`` (usage on every chunk) and llama-server's
``timings_per_token`` (``timings.predicted_n`` on every chunk), plus ``include_usage``
(the final usage chunk) from both. Where a chunk carries no count (an engine that ignores
these, or a first request sent as the client wrote it), each chunk with content counts as
one token: exact for engines that send one token per chunk (llama-server, vLLM by
default), a lower bound where a chunk holds several (vLLM's ``stream_interval``, text
held back across a stop string or a split UTF-8 character). A lower bound errs towards
more tokens than ``max_tokens`` over the whole stream, never fewer, and never ends a
stream early. The original prompt's tokens are the first engine's report; when the cut
came before it reported them, they are the continuation's prompt tokens less the tokens
already relayed (the engine's count of the same text, give or take the tokenizer's
merges at the seam). An engine's count may include tokens whose text it still holds back
(a possible stop string): the continuation writes that text again, within a slightly
smaller ``max_tokens``.

Known limits, each left to the engines: a chat template that trims the final assistant
message drops trailing whitespace of the text so far, and the model may write it again;
a stop string that straddles the seam is not seen (its first part is in the prompt);
penalties over generated tokens (presence, frequency) restart at the seam.
"""

from cluster_cli.router.resume.requests import can_resume, continuation, cut_event, refusal, upstream_body
from cluster_cli.router.resume.seam import Seam, ending
from cluster_cli.router.resume.state import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    DONE_EVENT,
    LLAMACPP,
    RESUME_LIMIT,
    VLLM,
    StreamState,
)
from cluster_cli.router.sse import SSEParser, parse_event

__all__ = [
    "CHAT_PATH",
    "COMPLETIONS_PATH",
    "DONE_EVENT",
    "LLAMACPP",
    "RESUME_LIMIT",
    "VLLM",
    "SSEParser",
    "Seam",
    "StreamState",
    "can_resume",
    "continuation",
    "cut_event",
    "ending",
    "parse_event",
    "refusal",
    "upstream_body",
]
