"""HTTP/1.1 wire helpers shared by the client side and the upstream side.

Just enough of HTTP/1.1 for an OpenAI-compatible proxy: request and response heads,
Content-Length and chunked bodies, keep-alive. Everything works on bytes; header
names are compared lower-cased. Errors the router itself produces use OpenAI's
shape ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple

REASONS = {
    100: b"Continue",
    200: b"OK",
    400: b"Bad Request",
    401: b"Unauthorized",
    404: b"Not Found",
    405: b"Method Not Allowed",
    408: b"Request Timeout",
    411: b"Length Required",
    413: b"Payload Too Large",
    429: b"Too Many Requests",
    431: b"Request Header Fields Too Large",
    500: b"Internal Server Error",
    501: b"Not Implemented",
    502: b"Bad Gateway",
    503: b"Service Unavailable",
    504: b"Gateway Timeout",
}

# Not forwarded in either direction (RFC 9110 7.6.1), plus what the proxy sets itself.
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)
# X-Forwarded-For and -Proto are written anew by the proxy (the client's own are not trusted as sent).
REQUEST_DROP = HOP_BY_HOP | {
    b"host",
    b"content-length",
    b"authorization",
    b"expect",
    b"x-forwarded-for",
    b"x-forwarded-proto",
}
RESPONSE_DROP = HOP_BY_HOP | {b"content-length"}

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "upstream_timeout",
}


# RFC 9110 5.6.2: a field name (and a method) is a token.
_TOKEN_CHARS = b"!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
# The header lines of a head, each "CRLF NAME: VALUE", matched in one C-level pass: a name
# that is a token (so no obs-fold continuation line, no "Name :"), and a value of visible
# ASCII, spaces, tabs and obs-text only. A bare CR or LF (which some upstream parsers take as
# a line end: request smuggling, response splitting), NUL or another control fails it.
_HEADER_BLOCK = re.compile(rb"(?:\r\n[" + re.escape(_TOKEN_CHARS) + rb"]+:[\t\x20-\x7e\x80-\xff]*)*")
# A request target is visible ASCII only (RFC 9112 3.2): no spaces, no controls, no 8-bit bytes.
_TARGET = re.compile(rb"[\x21-\x7e]+")
_TOKEN = rb"[" + re.escape(_TOKEN_CHARS) + rb"]+"
# RFC 9112 7.1.1: chunk-size *( ";" name [ "=" ( token / quoted-string ) ] ), the CRLF
# excluded. The RFC's optional whitespace (BWS) around ";" and "=" is refused, as llhttp
# refuses it: a request the router hands on must frame the same in every parser behind it.
# Nothing else either: a bare CR or LF inside (which another parser may take as the line's
# end, and so the body's framing) or a space after a size alone fails it.
_QUOTED = rb'"(?:[\t \x21\x23-\x5b\x5d-\x7e\x80-\xff]|\\[\t \x21-\x7e\x80-\xff])*"'
_CHUNK_LINE = re.compile(rb"([0-9A-Fa-f]{1,16})(?:;" + _TOKEN + rb"(?:=(?:" + _TOKEN + rb"|" + _QUOTED + rb"))?)*")
# A trailer line is a header line (RFC 9112 7.1.2): the rules of _HEADER_BLOCK, one line.
_FIELD_LINE = re.compile(_TOKEN + rb":[\t\x20-\x7e\x80-\xff]*")
MAX_LENGTH_DIGITS = 15  # a Content-Length beyond this is no body anyone sends (and int() of a huge one is slow)


def is_token(name: bytes) -> bool:
    return bool(name) and not name.translate(None, _TOKEN_CHARS)


def header_lines_ok(head: bytes, start: int) -> bool:
    """Whether everything in ``head`` from ``start`` (the CRLF that ends its first line) is
    well-formed header lines."""
    return _HEADER_BLOCK.fullmatch(head, start) is not None


def parse_length(value: bytes) -> int:
    """A Content-Length value: ASCII digits only (no sign, space, underscore or 0x). Raises ValueError."""
    if not value.isdigit() or len(value) > MAX_LENGTH_DIGITS:
        raise ValueError("bad Content-Length")
    return int(value)


def parse_chunk_size(line: bytes) -> int:
    """The size of a chunk-size line (without its CRLF), its extensions checked and ignored:
    1-16 hex digits, then only well-formed ``;name[=value]`` extensions. Raises ValueError.

    ``int(x, 16)`` alone would take "-6", "+6", "0x6", "6_0" and spaces: a negative size
    would send the decoder backwards for ever.
    """
    m = _CHUNK_LINE.fullmatch(line)
    if m is None:
        raise ValueError("bad chunk size line")
    return int(m.group(1), 16)


class BadRequest(Exception):
    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code


def error_body(status: int, message: str, code: str | None = None, etype: str | None = None) -> bytes:
    err = {"message": message, "type": etype or ERROR_TYPES.get(status, "server_error"), "param": None, "code": code}
    return json.dumps({"error": err}, separators=(",", ":")).encode()


def sse_error_event(message: str, code: str = "upstream_error", status: int = 502) -> bytes:
    return b"data: " + error_body(status, message, code) + b"\n\n"


def response(
    status: int,
    body: bytes,
    *,
    keep_alive: bool,
    ctype: bytes = b"application/json",
    extra: bytes = b"",
) -> bytes:
    head = b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n%s" % (
        status,
        REASONS.get(status, b"Unknown"),
        ctype,
        len(body),
        extra,
    )
    if not keep_alive:
        head += b"Connection: close\r\n"
    return head + b"\r\n" + body


def error_response(
    status: int,
    message: str,
    code: str | None = None,
    *,
    keep_alive: bool,
    extra: bytes = b"",
) -> bytes:
    return response(status, error_body(status, message, code), keep_alive=keep_alive, extra=extra)


class Request:
    """One parsed client request (body complete)."""

    __slots__ = (
        "body",
        "expect_continue",
        "forward",
        "forwarded_for",
        "has_host",
        "headers",
        "keep_alive",
        "method",
        "path",
        "target",
        "version",
    )

    def __init__(
        self,
        method: bytes,
        target: bytes,
        version: bytes,
        headers: list[tuple[bytes, bytes]],
        keep_alive: bool,
    ) -> None:
        self.method = method
        self.target = target
        self.path = target.split(b"?", 1)[0]
        self.version = version
        self.headers = headers  # (lower-cased name, value)
        self.keep_alive = keep_alive
        self.body = b""
        self.expect_continue = False
        self.forward = b""  # raw header lines to pass upstream, each followed by CRLF
        self.has_host = False  # a Host header came (HTTP/1.1 requires one: RFC 9112 3.2)
        self.forwarded_for = b""  # the X-Forwarded-For list received, the lines joined by ", "

    def header(self, name: bytes) -> bytes | None:
        for k, v in self.headers:
            if k == name:
                return v
        return None


_PLAIN_CONNECTION = frozenset({b"keep-alive", b"close"})


def connection_options(values: list[bytes], lines: list[bytes]) -> tuple[set[bytes], list[bytes]]:
    """The options of the Connection header lines ``values``, and ``lines`` (raw NAME:VALUE
    header lines) without the headers those options name: hop-by-hop, for this connection
    only (RFC 9110 7.6.1). The usual single ``close`` or ``keep-alive`` costs one lookup."""
    if len(values) == 1 and (only := values[0].strip(b" \t").lower()) in _PLAIN_CONNECTION:
        return {only}, lines
    # One comma-separated list of case-insensitive tokens across all the lines.
    tokens = {t for v in values for t in (x.strip(b" \t").lower() for x in v.split(b",")) if t}
    named = tokens - _PLAIN_CONNECTION
    if named and lines:
        lines = [line for line in lines if line.partition(b":")[0].lower() not in named]
    return tokens, lines


def origin_form(target: bytes) -> bytes | None:
    """The origin-form (path and query) of an absolute-form target ``http://host/path?q``
    (RFC 9112 3.2.2); None when ``target`` is not one."""
    scheme, sep, rest = target.partition(b"://")
    if not sep or scheme.lower() not in (b"http", b"https"):
        return None
    cut = len(rest)
    for c in (b"/", b"?"):
        i = rest.find(c)
        if 0 <= i < cut:
            cut = i
    if cut == 0:  # no authority
        return None
    path = rest[cut:]
    return path if path.startswith(b"/") else b"/" + path


def parse_request_head(head: bytes) -> tuple[Request, int | None, bool]:
    """Parse a request head (without the blank line). Returns (request, content_length, chunked).

    Strict where a lenient parse would let a request mean one thing here and another to the
    engine behind (smuggling): bare CR/LF, NUL and other controls, header names that are not
    tokens (which covers obs-fold continuation lines and "Name :"), targets with spaces or
    controls, signed or padded lengths, more than one Host. An absolute-form target is taken
    as its origin-form (path and query). Whether an HTTP/1.1 request lacks Host is left to
    the caller (``Request.has_host``).
    """
    eol = head.find(b"\r\n")
    if not header_lines_ok(head, eol if eol >= 0 else len(head)):
        raise BadRequest(400, "malformed header line (not NAME: VALUE, or a control character)", "bad_request")
    lines = head.split(b"\r\n")
    try:
        method, target, version = lines[0].split(b" ")
    except ValueError:
        raise BadRequest(400, "malformed request line", "bad_request") from None
    if version not in (b"HTTP/1.1", b"HTTP/1.0"):
        raise BadRequest(400, "unsupported HTTP version", "bad_request")
    if not is_token(method) or not _TARGET.fullmatch(target):
        raise BadRequest(400, "malformed request line", "bad_request")
    if not target.startswith(b"/"):
        origin = origin_form(target)
        if origin is not None:
            target = origin
    headers: list[tuple[bytes, bytes]] = []
    forward: list[bytes] = []
    clen: int | None = None
    chunked = False
    conns: list[bytes] | None = None
    expect = False
    hosts = 0
    xff: list[bytes] = []
    for line in lines[1:]:  # each is NAME:VALUE (header_lines_ok)
        name, _, value = line.partition(b":")
        name = name.lower()
        value = value.strip(b" \t")
        if name not in REQUEST_DROP:
            forward.append(line)
        elif name == b"content-length":
            try:
                n = parse_length(value)
            except ValueError:
                raise BadRequest(400, "bad Content-Length", "bad_request") from None
            if clen is not None and n != clen:
                raise BadRequest(400, "bad Content-Length", "bad_request")
            clen = n
        elif name == b"host":
            hosts += 1
        elif name == b"transfer-encoding":
            if chunked:  # chunked twice is not a body anyone can agree on
                raise BadRequest(400, "repeated Transfer-Encoding", "bad_request")
            if value.lower() != b"chunked":
                raise BadRequest(501, "unsupported Transfer-Encoding", "bad_request")
            chunked = True
        elif name == b"connection":
            if conns is None:
                conns = [value]
            else:
                conns.append(value)
        elif name == b"expect":
            expect = value.lower() == b"100-continue"
        elif name == b"x-forwarded-for" and value:
            xff.append(value)
        headers.append((name, value))
    if chunked and clen is not None:
        raise BadRequest(400, "both Content-Length and chunked", "bad_request")
    if chunked and version == b"HTTP/1.0":  # RFC 9112 6.1: faulty framing, the connection closes
        raise BadRequest(400, "Transfer-Encoding in an HTTP/1.0 request", "bad_request")
    if hosts > 1:
        raise BadRequest(400, "more than one Host header", "bad_request")
    close = False
    if conns is not None:
        options, forward = connection_options(conns, forward)  # what it names is for this hop only
        close = b"close" in options
    # HTTP/1.0's keep-alive is an extension a server may decline: declined (the response says
    # "Connection: close" and the connection closes after it), never half-kept.
    http11 = version == b"HTTP/1.1"
    req = Request(method, target, version, headers, http11 and not close)
    req.has_host = hosts == 1
    if xff:
        req.forwarded_for = b", ".join(xff)
    # An HTTP/1.0 client knows no 100 Continue: the expectation is ignored (RFC 9110 10.1.1).
    req.expect_continue = expect and http11
    if forward:
        forward.append(b"")
        req.forward = b"\r\n".join(forward)
    return req, clen, chunked


class ResponseHead(NamedTuple):
    """A parsed response head: what the router relays of it and how its body is framed."""

    status: int
    status_line: bytes
    keep_alive: bool  # the connection may carry another exchange after this one
    length: int  # Content-Length, -1 when none
    chunked: bool
    ctype: bytes  # Content-Type, lower-cased ("" when none)
    lines: list[bytes]  # the NAME:VALUE lines to relay: hop-by-hop ones and Content-Length dropped


def parse_response_head(head: bytes) -> ResponseHead:
    """Parse an engine's response head (without the blank line): the one parser of every
    response the router reads (relayed answers, health checks, metric scrapes). Raises
    ValueError with a message naming the fault.

    As strict as a client's head: a bare CR or LF in a relayed line would split the response
    the client sees. Only plain ``chunked`` is a transfer coding (de-chunking "gzip, chunked"
    would hand the client a compressed body with nothing saying so), and a response with both
    Content-Length and Transfer-Encoding is refused (RFC 9112 6.3: it is an attack or a bug).
    """
    eol = head.find(b"\r\n")
    if not header_lines_ok(head, eol if eol >= 0 else len(head)):
        raise ValueError("malformed upstream header line (not NAME: VALUE, or a control character)")
    lines = head.split(b"\r\n")
    version, _, rest = lines[0].partition(b" ")
    code = rest[:3]
    if (
        version not in (b"HTTP/1.1", b"HTTP/1.0")
        or not code.isdigit()
        or rest[3:4] not in (b"", b" ")
        or code < b"100"
        or code > b"599"
    ):
        raise ValueError("upstream sent a malformed status line")
    keep = version == b"HTTP/1.1"
    clen = -1
    chunked = False
    ctype = b""
    conns: list[bytes] | None = None
    kept: list[bytes] = []
    for line in lines[1:]:  # each is NAME:VALUE (header_lines_ok)
        name, _, value = line.partition(b":")
        lname = name.lower()
        if lname in RESPONSE_DROP:
            if lname == b"content-length":
                try:
                    n = parse_length(value.strip(b" \t"))
                except ValueError:
                    n = -2
                if n < 0 or (clen >= 0 and n != clen):
                    raise ValueError("bad upstream Content-Length")
                clen = n
            elif lname == b"transfer-encoding":
                if chunked or value.strip(b" \t").lower() != b"chunked":
                    raise ValueError("unsupported upstream Transfer-Encoding")
                chunked = True
            elif lname == b"connection":
                if conns is None:
                    conns = [value]
                else:
                    conns.append(value)
            continue
        if lname == b"content-type":
            ctype = value.strip().lower()
        kept.append(line)
    if chunked and clen >= 0:
        raise ValueError("upstream response has both Content-Length and Transfer-Encoding")
    if conns is not None:
        options, kept = connection_options(conns, kept)  # what it names is for this hop only
        if b"close" in options:
            keep = False
        elif b"keep-alive" in options:
            keep = True
    return ResponseHead(int(code), lines[0], keep, clen, chunked, ctype, kept)


class ChunkedDecoder:
    """Incremental decoder of a chunked body (RFC 9112 7.1). ``feed`` returns (payload, leftover).

    Every line is checked whole before it counts, and a line end is CRLF only: a bare LF
    anywhere in a size line or a trailer section is refused as soon as it arrives, not read
    as a line end (a front proxy that reads it so would see other messages than the router).
    Trailer fields are checked as header lines and dropped.
    """

    __slots__ = ("_buf", "_rem", "_state", "_trailer", "done")

    SIZE, DATA, CRLF, TRAILER = range(4)
    MAX_SIZE_LINE = 1024
    MAX_TRAILER = 16384

    def __init__(self) -> None:
        self._buf = b""
        self._rem = 0
        self._state = self.SIZE
        self._trailer = 0  # bytes of trailer section read so far
        self.done = False

    def feed(self, data: bytes) -> tuple[bytes, bytes]:
        """Returns (payload bytes decoded so far from ``data``, leftover bytes after the body's end).
        Raises ValueError on a malformed body."""
        buf = self._buf + data if self._buf else data
        self._buf = b""
        out: list[bytes] = []
        pos = 0
        n = len(buf)
        st = self._state
        while pos < n:
            if st == self.DATA:
                take = min(self._rem, n - pos)
                out.append(buf[pos : pos + take])
                pos += take
                self._rem -= take
                if self._rem == 0:
                    st = self.CRLF
            elif st == self.CRLF:
                if n - pos < 2:
                    if buf[pos] != 13:  # 13: CR
                        raise ValueError("bad chunk terminator")
                    break
                if buf[pos : pos + 2] != b"\r\n":
                    raise ValueError("bad chunk terminator")
                pos += 2
                st = self.SIZE
            elif st == self.SIZE:
                eol = buf.find(b"\r\n", pos)
                if eol < 0:
                    _incomplete_line(buf, pos, self.MAX_SIZE_LINE, "chunk size line too long")
                    break
                if eol - pos > self.MAX_SIZE_LINE:
                    raise ValueError("chunk size line too long")
                size = parse_chunk_size(buf[pos:eol])
                pos = eol + 2
                if size == 0:
                    st = self.TRAILER
                else:
                    self._rem = size
                    st = self.DATA
            else:  # TRAILER: field lines until an empty one
                eol = buf.find(b"\r\n", pos)
                if eol < 0:
                    _incomplete_line(buf, pos, self.MAX_TRAILER - self._trailer, "trailer too long")
                    break
                if eol == pos:
                    pos += 2
                    self.done = True
                    self._state = st
                    return b"".join(out), buf[pos:]
                self._trailer += eol + 2 - pos
                if self._trailer > self.MAX_TRAILER:
                    raise ValueError("trailer too long")
                if _FIELD_LINE.fullmatch(buf, pos, eol) is None:
                    raise ValueError("malformed trailer line")
                pos = eol + 2
        self._state = st
        self._buf = buf[pos:]
        return b"".join(out) if len(out) != 1 else out[0], b""


def _incomplete_line(buf: bytes, pos: int, limit: int, too_long: str) -> None:
    """Check the start of a line whose CRLF has not arrived: refused at once when it holds a
    bare LF (no CRLF follows it: it can only be a line end another parser would take), a CR
    not at its very end, or more than ``limit`` bytes."""
    if buf.find(b"\n", pos) >= 0:
        raise ValueError("a line ends in a bare LF")
    cr = buf.find(b"\r", pos)
    if 0 <= cr < len(buf) - 1:
        raise ValueError("a bare CR in a line")
    if len(buf) - pos > limit:
        raise ValueError(too_long)


def host_header(host: str, port: int) -> bytes:
    """The Host header value for ``host`` (a name, an IPv4 or an IPv6 literal) and ``port``.

    An IPv6 literal goes in brackets, as in a URI (RFC 9112 3.2, RFC 3986 3.2.2): "::1" and
    8000 give "[::1]:8000"; a zone ID ("fe80::1%eth0") has only local meaning and is left
    out (RFC 6874 4)."""
    if ":" in host and not host.startswith("["):
        host = "[" + host.partition("%")[0] + "]"
    return b"%s:%d" % (host.encode(), port)


def bearer_line(api_key: str | None) -> bytes:
    """The ``Authorization: Bearer KEY`` header line (with its CRLF) that carries an engine's
    key, or b"" for none. A key that would not be one header token (a blank, a CR or LF, a
    non-ASCII character) raises ValueError, whose message does not show it."""
    if not api_key:
        return b""
    if not all(0x21 <= ord(c) <= 0x7E for c in api_key):
        raise ValueError("an engine key must be visible ASCII characters without blanks")
    return b"Authorization: Bearer " + api_key.encode("ascii") + b"\r\n"


async def fetch(
    host: str,
    port: int,
    path: str,
    timeout: float,
    max_bytes: int = 4 << 20,
    *,
    connect: Callable[[str, int], Awaitable[tuple[Any, Any]]] | None = None,
    api_key: str | None = None,
) -> tuple[int, bytes]:
    """A small GET (health checks, metric scrapes): returns (status, body). Raises
    OSError/TimeoutError/ValueError. The response is read by ``parse_response_head``, as every
    response the router relays. ``connect`` opens the connection (default: TCP from here; an
    SSH session's ``open_connection`` reaches an engine only its node can). ``api_key``: the
    engine's key, sent as ``Authorization: Bearer KEY`` (llama-server wants it for /metrics)."""
    auth = bearer_line(api_key)

    async def go() -> tuple[int, bytes]:
        reader, writer = await (connect or asyncio.open_connection)(host, port)
        try:
            writer.write(
                b"GET %s HTTP/1.1\r\nHost: %s\r\n%sAccept: */*\r\nConnection: close\r\n\r\n"
                % (path.encode(), host_header(host, port), auth)
            )
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.LimitOverrunError:
                    raise ValueError("response head too large") from None
                except asyncio.IncompleteReadError:
                    raise ValueError("connection closed before a response head") from None
                rh = parse_response_head(head[:-4])  # an engine's fault, not ours
                if not 100 <= rh.status < 200:  # an interim response: the real one follows
                    break
            status = rh.status
            clen = rh.length if rh.length >= 0 else None
            chunked = rh.chunked
            if status in (204, 304):
                body = b""
            elif clen is not None:
                if clen > max_bytes:
                    raise ValueError("response too large")
                body = await reader.readexactly(clen)
            elif chunked:
                dec = ChunkedDecoder()
                parts: list[bytes] = []
                size = 0
                while not dec.done:
                    data = await reader.read(65536)
                    if not data:
                        raise ValueError("truncated chunked body")
                    payload, _ = dec.feed(data)
                    parts.append(payload)
                    size += len(payload)
                    if size > max_bytes:
                        raise ValueError("response too large")
                body = b"".join(parts)
            else:  # no length: the body ends with the connection (HTTP/1.0 servers, prometheus_client)
                parts = []
                size = 0
                while True:
                    data = await reader.read(65536)
                    if not data:
                        break
                    size += len(data)
                    if size > max_bytes:
                        raise ValueError("response too large")
                    parts.append(data)
                body = b"".join(parts)
            return status, body
        finally:
            writer.close()

    return await asyncio.wait_for(go(), timeout)


def head_only(response_bytes: bytes) -> bytes:
    """A whole response's head: what a HEAD request gets (same headers, no body)."""
    return response_bytes[: response_bytes.find(b"\r\n\r\n") + 4]
