"""API-surface edges: the access log, the API-keys file, what /metrics
counts, the listen address, error messages."""

from __future__ import annotations

import io
import json
from pathlib import Path

import httpx
import pytest
from simengine import Fleet
from typer.testing import CliRunner

from cluster_cli.cli.main import app
from cluster_cli.errors import ConfigError
from cluster_cli.router.accesslog import AccessLog
from cluster_cli.router.keys import ApiKeys


def test_a_model_name_the_log_file_cannot_encode_loses_no_line(tmp_path: Path) -> None:
    """A lone surrogate (valid in JSON as \\ud800) in one request's model name made the write of
    the whole buffered batch fail, and every line in it was dropped."""
    path = tmp_path / "access.log"
    with open(path, "a", encoding="utf-8") as f:
        log = AccessLog(f)
        for i, model in enumerate(["before", "evil\ud800", 'q"uote\nline\x1b[31m', "after"]):
            log.log(i, "127.0.0.1:1", "POST", "/v1/chat/completions", model, "", 404, 0, None, 0.001)
        log.flush()
    lines = path.read_text().splitlines()
    # The lone surrogate is written as U+FFFD: a line any JSON parser takes (RFC 8259 leaves it undefined).
    assert [json.loads(line)["model"] for line in lines] == ["before", "evil\ufffd", 'q"uote\nline\x1b[31m', "after"]


def test_an_api_keys_file_saved_with_a_bom_keeps_its_first_key(tmp_path: Path) -> None:
    keys = ApiKeys.load(tmp_path / "k", data=b"\xef\xbb\xbfkey-one\r\n# a comment\r\n\r\n  key-two  \r\n")
    assert keys.check(b"Bearer key-one") and keys.check(b"Bearer key-two")
    assert not keys.check(b"Bearer \xef\xbb\xbfkey-one")
    comment_first = ApiKeys.load(
        tmp_path / "k", data=b"\xef\xbb\xbf# my keys\nkey-one\n"
    )  # was "may not contain spaces"
    assert comment_first.check(b"Bearer key-one") and not comment_first.check(b"Bearer #")


def test_requests_the_router_answers_itself_are_counted_and_say_why_in_the_log() -> None:
    buf = io.StringIO()
    f = Fleet(1, capacity=4, token_delay_s=0.001, tokens=2).start(access_log=AccessLog(buf))
    try:
        assert httpx.get(f.url + "/no-such-path", timeout=10).status_code == 404
        assert httpx.get(f.url + "/health", timeout=10).status_code == 200
        r = httpx.post(f.base + "/chat/completions", content=b"[1, 2]", timeout=10)
        assert (
            r.status_code == 400 and r.json()["error"]["message"] == "the request body must be a JSON object, not list"
        )
        text = httpx.get(f.url + "/metrics", timeout=10).text
        for status in (404, 200, 400):
            assert f'clusterctl_router_requests_total{{endpoint="",model="",status="{status}"}} 1.0' in text, status
        f.lt.call(f.router.access.flush)
        (bad,) = [json.loads(line) for line in buf.getvalue().splitlines() if '"status":400' in line]
        assert bad["note"].startswith("invalid_json: the request body must be a JSON object")
    finally:
        f.close()


def test_an_empty_listen_address_is_refused(tmp_path: Path) -> None:
    """An unset $HOST in a script would have listened on every interface."""
    cfg = tmp_path / "r.yaml"
    cfg.write_text("models: {m: {endpoints: [{url: 'http://127.0.0.1:9', engine: vllm}]}}\n")
    r = CliRunner().invoke(app, ["serve-router", "--config", str(cfg), "--host", "", "--port", "0"])
    assert r.exit_code == 2
    (line,) = [ln for ln in r.output.splitlines() if ln.strip()]
    assert line == "error: --host is empty: give an address (0.0.0.0 to listen on every interface)"


def test_the_access_log_is_reopened_for_log_rotation(tmp_path: Path) -> None:
    """logrotate moves the file away and sends SIGHUP: what was buffered goes to the old
    file, what follows to a new one at the path; a path that cannot be opened keeps the old."""
    path = tmp_path / "access.log"
    log = AccessLog.to_file(str(path))
    log.log(1, "c", "GET", "/health", "", "", 200, 0, None, 0.001)
    path.rename(tmp_path / "access.log.1")
    log.log(2, "c", "GET", "/health", "", "", 200, 0, None, 0.001)
    log.reopen()
    log.log(3, "c", "GET", "/health", "", "", 200, 0, None, 0.001)
    log.flush()
    ids = [[json.loads(line)["id"] for line in p.read_text().splitlines()] for p in (tmp_path / "access.log.1", path)]
    assert ids == [[1, 2], [3]]
    path.rename(tmp_path / "access.log.2")
    (tmp_path / "access.log").mkdir()  # cannot be opened as a file: the old one is kept
    log.reopen()
    log.log(4, "c", "GET", "/health", "", "", 200, 0, None, 0.001)
    log.flush()
    assert [json.loads(line)["id"] for line in (tmp_path / "access.log.2").read_text().splitlines()] == [3, 4]


def test_api_keys_file_rules(tmp_path: Path) -> None:
    p = tmp_path / "keys"
    with pytest.raises(ConfigError, match="no API keys"):
        ApiKeys.load(p, b"# nobody yet\n\n")
    with pytest.raises(ConfigError, match="64 hex digits"):
        ApiKeys.load(p, b"sha256:" + b"ab" * 16)
    keys = ApiKeys.load(p, b"sk-a\n")
    assert keys.check(b"Bearer sk-a") and keys.check(b"bearer sk-a") and keys.check(b"BEARER sk-a")
    assert not keys.check(b"Bearer sk-b") and not keys.check(b"Basic sk-a")
