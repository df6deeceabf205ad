"""Router config parsing, metric-mapping resolution, and the serve-router command line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest
from helpers import router_config
from typer.testing import CliRunner

from cluster_cli.cli.main import app
from cluster_cli.engines.base import VLLM_KV_CACHE, VLLM_KV_CACHE_LEGACY, VLLM_RUNNING, VLLM_WAITING
from cluster_cli.engines.metrics import parse_metrics, resolve
from cluster_cli.errors import ConfigError
from cluster_cli.router.breaker import State
from cluster_cli.router.config import RouterConfig, endpoint_views, load_router_config, with_overrides
from cluster_cli.router.registry import build_table

ISSUE_EXAMPLE = """\
engines:
  vllm: {metrics: {}}                       # empty = vLLM's names
  llamacpp: {metrics: {running: "llamacpp:requests_processing", waiting: "llamacpp:requests_deferred"}}
models:
  tiny:
    endpoints:
      - {url: "http://198.18.0.11:8080", engine: llamacpp, replica: tiny-0}
      - {url: "http://198.18.0.12:8080", engine: llamacpp, replica: tiny-1, draining: true}
"""


# ``python -m cluster_cli.cli.main`` would build a second Typer app as __main__; call run() instead.
CLI = [sys.executable, "-c", "from cluster_cli.cli.main import run; run()"]


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "router.yaml"
    p.write_text(textwrap.dedent(text))
    return p


def test_issue_example_parses(tmp_path):
    cfg = load_router_config(write(tmp_path, ISSUE_EXAMPLE))
    views = endpoint_views(cfg)
    a, b = views["http://198.18.0.11:8080"], views["http://198.18.0.12:8080"]
    assert (a.replica, a.draining, b.draining) == ("tiny-0", False, True)
    assert a.metrics.running == "llamacpp:requests_processing" and a.metrics.kv_cache_usage is None
    assert cfg.metric_mapping("vllm").names("kv_cache_usage") == (VLLM_KV_CACHE, VLLM_KV_CACHE_LEGACY)
    assert cfg.router.policy == "prefix"


@pytest.mark.parametrize(
    ("text", "expect"),
    [
        (
            "models: {m: {endpoints: [{url: 'http://h:1', bogus: 1}]}}",
            "router.yaml: line 1: models.m.endpoints.0.bogus: unknown key",
        ),
        ("models: {m: {endpoints: [{url: 'https://h:1'}]}}", "only http:// upstreams"),
        ("models: {m: {endpoints: [{url: 'http://h:1/v1'}]}}", "without a path"),
        (
            "models: {m: {endpoints: [{url: 'http://h:1', engine: sglangx}]}}",
            "models.m.endpoints.0.engine: unknown engine 'sglangx'",
        ),
        ("models: {m: {endpoints: [{url: 'http://h:1'}, {url: 'http://h:1'}]}}", "listed twice"),
        (
            "engines: {vllm: {metrics: {runing: x}}}\nmodels: {m: {endpoints: [{url: 'http://h:1'}]}}",
            "unknown metric key",
        ),
        ("models: {m: {endpoints: [{url: 'http://h:1'}]}}\nrouter: {policy: random}", "router.policy"),
        (
            "models: {m: {endpoints: [{url: 'http://h:1'}]}}\nrouter: {limits: {idle_timeout_s: 0}}",
            "router.limits.idle_timeout_s",
        ),
        ("models: [", "invalid YAML"),
        # YAML that parses but that PyYAML cannot build: a one-line error, never a traceback
        ("models: {[1, 2]: x}", "invalid YAML: a mapping key must be a plain value"),
        ("models: {m: {endpoints: [{url: 'http://h:1', replica: 2024-13-01}]}}", "invalid YAML: month must be"),
        pytest.param("models: " + "[" * 5000 + "]" * 5000, "invalid YAML: nested too deeply", marks=pytest.mark.slow),
    ],
)
def test_bad_configs_give_one_line_errors(tmp_path, text, expect):
    with pytest.raises(ConfigError) as ei:
        load_router_config(write(tmp_path, text))
    msg = ei.value.message
    assert expect in msg and "\n" not in msg and "router.yaml" in msg


def test_metric_mapping_semantics(tmp_path):
    cfg = load_router_config(
        write(
            tmp_path,
            """\
            engines:
              vllm: {metrics: {}}
              custom: {metrics: {running: "x:run"}}
              partial: {metrics: {waiting: "x:wait"}}
            models:
              m:
                endpoints:
                  - {url: "http://h:1", engine: vllm}
                  - {url: "http://h:2", engine: custom}
                  - {url: "http://h:3", engine: partial}
                  - {url: "http://h:4", engine: llamacpp}
            """,
        )
    )
    v = {u.rsplit(":", 1)[1]: e.metrics for u, e in endpoint_views(cfg).items()}
    assert (v["1"].running, v["1"].waiting) == (VLLM_RUNNING, VLLM_WAITING)
    assert (v["2"].running, v["2"].waiting, v["2"].kv_cache_usage) == ("x:run", None, None)  # complete as named
    assert (v["3"].running, v["3"].waiting) == (VLLM_RUNNING, "x:wait")  # overrides on top of vLLM's
    assert v["4"].running == "llamacpp:requests_processing" and v["4"].kv_cache_usage is None  # adapter default


ONE = "models: {m: {endpoints: [{url: 'http://h:1'}]}}\n"


@pytest.mark.parametrize(
    ("text", "expect"),
    [
        # one replica name, two URLs: their metrics and access-log lines would merge
        (
            "models: {m: {endpoints: [{url: 'http://h:1', replica: big-0}, {url: 'http://h:2', replica: big-0}]}}",
            "router.yaml: line 1: models.m.endpoints.1.replica: 'big-0' is also m's endpoint http://h:1",
        ),
        (
            "models:\n  a: {endpoints: [{url: 'http://h:1', replica: big-0}]}\n"
            "  b:\n    endpoints:\n      - {url: 'http://h:2', replica: big-0}\n",
            "router.yaml: line 5: models.b.endpoints.0.replica: 'big-0' is also a's endpoint http://h:1",
        ),
        (  # an unnamed endpoint is named by its host:port
            "models: {m: {endpoints: [{url: 'http://h:1'}, {url: 'http://h:2', replica: 'h:1'}]}}",
            "models.m.endpoints.1.replica: 'h:1' is also m's endpoint http://h:1",
        ),
        # one URL, two replica names: which one it got depended on the order of the models
        (
            "models:\n  a: {endpoints: [{url: 'http://h:1', replica: x}]}\n  b: {endpoints: [{url: 'http://h:1', replica: y}]}",
            "router.yaml: line 3: models.b.endpoints.0.replica: http://h:1 is 'y' here but 'x' under a: give it one name",
        ),
        (
            "models: {a: {endpoints: [{url: 'http://h:1'}]}, b: {endpoints: [{url: 'http://h:1', replica: y}]}}",
            "models.b.endpoints.0.replica: http://h:1 is 'y' here but unnamed ('h:1') under a",
        ),
        # wrong types are errors, not converted
        (
            "models: {m: {endpoints: [{url: 'http://h:1', max_inflight: true}]}}",
            "endpoints.0.max_inflight: Input should be a valid integer",
        ),
        (
            "models: {m: {endpoints: [{url: 'http://h:1', max_inflight: 4.0}]}}",
            "endpoints.0.max_inflight: Input should be a valid integer",
        ),
        (
            "models: {m: {endpoints: [{url: 'http://h:1', draining: 'yes'}]}}",
            "endpoints.0.draining: Input should be a valid boolean",
        ),
        (
            "models: {m: {endpoints: [{url: 'http://h:1', draining: 1}]}}",
            "endpoints.0.draining: Input should be a valid boolean",
        ),
        (
            "models: {m: {endpoints: [{url: 'http://h:1'}], admission: {max_queue: true}}}",
            "models.m.admission.max_queue: Input should be a valid integer",
        ),
        (
            ONE + "router: {admission: {max_queue: 256.0}}",
            "router.admission.max_queue: Input should be a valid integer",
        ),
        (ONE + "router: {retry: {max_attempts: true}}", "router.retry.max_attempts: Input should be a valid integer"),
        (
            ONE + "router: {breaker: {failure_threshold: 2.0}}",
            "router.breaker.failure_threshold: Input should be a valid integer",
        ),
        (
            ONE + "router: {limits: {max_connections: 100.0}}",
            "router.limits.max_connections: Input should be a valid integer",
        ),
        (
            ONE + "router: {limits: {max_body_bytes: '4096'}}",
            "router.limits.max_body_bytes: Input should be a valid integer",
        ),
        (
            ONE + "router: {admission: {max_wait_s: true}}",
            "router.admission.max_wait_s: Input should be a valid number",
        ),
        # a base above its cap
        (
            ONE + "router:\n  retry: {backoff_base_s: 5, backoff_max_s: 0.1}",
            "router.yaml: line 3: router.retry.backoff_base_s: 5 is above backoff_max_s (0.1)",
        ),
        (
            ONE + "router: {retry: {backoff_base_s: 1}}",
            "router.retry.backoff_base_s: 1 is above backoff_max_s (0.25, the default)",
        ),
        (
            ONE + "router: {retry: {backoff_max_s: 0.001}}",
            "router.retry.backoff_max_s: 0.001 is below backoff_base_s (0.005, the default)",
        ),
        (
            ONE + "router:\n  breaker:\n    open_for_s: 100\n    max_open_for_s: 10",
            "router.yaml: line 4: router.breaker.open_for_s: 100 is above max_open_for_s (10)",
        ),
        # scheme and host are case-insensitive
        (
            "models: {m: {endpoints: [{url: 'http://LOCALHOST:9101'}, {url: 'http://localhost:9101/'}]}}",
            "models.m: endpoint http://localhost:9101 is listed twice (endpoints 0 and 1)",
        ),
        ("models: {m: {endpoints: [{url: 'HTTP://h:1'}, {url: 'http://H:1'}]}}", "endpoint http://h:1 is listed twice"),
        # :80 is http's own port
        ("models: {m: {endpoints: [{url: 'http://h'}, {url: 'http://h:80/'}]}}", "endpoint http://h is listed twice"),
        (
            "models: {m: {endpoints: [{url: 'http://[fd00::1]:80'}, {url: 'http://[FD00::1]'}]}}",
            "endpoint http://[fd00::1] is listed twice",
        ),
    ],
)
def test_inconsistent_or_mistyped_configs_are_refused(tmp_path, text, expect):
    with pytest.raises(ConfigError) as ei:
        load_router_config(write(tmp_path, text))
    msg = ei.value.message
    assert expect in msg and "\n" not in msg and msg.startswith(str(tmp_path / "router.yaml")), msg


def test_what_stays_accepted(tmp_path):
    """A URL shared by models under one name (or none) is one upstream; numbers of seconds take
    integers; a URL's host keeps neither its case nor a trailing "/", its port no leading zero."""
    cfg = load_router_config(
        write(
            tmp_path,
            """\
            models:
              a: {endpoints: [{url: "http://GPU-1:80", replica: big-0, max_inflight: 4}, {url: "http://h:2"}]}
              b: {endpoints: [{url: "http://gpu-1:80/", replica: big-0, draining: true}, {url: "http://h:2"}]}
              c: {endpoints: [{url: "http://h:2", replica: "h:2"}, {url: "http://H:03"}]}
            router:
              admission: {max_queue: 0, max_wait_s: 30}
              retry: {backoff_base_s: 0.25, backoff_max_s: 0.25}
              breaker: {open_for_s: 1, max_open_for_s: 1}
            """,
        )
    )
    views = endpoint_views(cfg)
    assert sorted(views) == ["http://gpu-1", "http://h:2", "http://h:3"]  # :80 is http's own port; 03 is 3
    big = views["http://gpu-1"]
    assert big.port == 80
    assert (big.replica, big.draining, big.max_inflight, big.models, big.host) == (
        "big-0",
        True,
        4,
        ("a", "b"),
        "gpu-1",
    )
    assert (views["http://h:2"].replica, views["http://h:2"].models) == ("h:2", ("a", "b", "c"))
    assert cfg.router.admission.max_wait_s == 30.0 and isinstance(cfg.router.admission.max_wait_s, float)
    assert cfg.router.breaker.open_for_s == 1.0 and cfg.router.retry.backoff_max_s == 0.25


def test_scrape_parsing_unknown_is_not_zero():
    text = textwrap.dedent(
        """\
        # HELP vllm:num_requests_running x
        vllm:num_requests_running{model_name="a"} 3
        vllm:num_requests_running{model_name="b"} 2
        vllm:gpu_cache_usage_perc{model_name="a"} 0.25
        vllm:gpu_cache_usage_perc{model_name="b"} 0.5
        """
    )
    from cluster_cli.engines import MetricMapping

    m = MetricMapping.vllm()
    running, waiting, kv = resolve(
        parse_metrics(text, m.names("running") + m.names("waiting") + m.names("kv_cache_usage")), m
    )
    assert (running, waiting, kv) == (5.0, None, 0.5)  # waiting absent: unknown; legacy KV name found


def test_overrides_are_validated(tmp_path):
    cfg = load_router_config(write(tmp_path, "models: {m: {endpoints: [{url: 'http://h:1'}]}}"))
    out = with_overrides(cfg, {"limits": {"max_body_bytes": 4096, "idle_timeout_s": None}, "": {"policy": "p2c"}})
    assert out.router.limits.max_body_bytes == 4096 and out.router.policy == "p2c"
    assert out.router.limits.idle_timeout_s == cfg.router.limits.idle_timeout_s


def _app():
    from cluster_cli.cli.main import app

    return app


def test_cli_help_shows_example():
    res = CliRunner().invoke(_app(), ["serve-router", "--help"], terminal_width=200)
    assert res.exit_code == 0
    assert "--config" in res.output and "--api-keys-file" in res.output and "endpoints:" in res.output


def test_cli_help_states_defaults_choices_and_exit_codes():
    """Every option's help is a sentence naming its default; choices are listed; exit codes are documented."""
    import typing

    from cluster_cli.cli.serve_router import LogLevel, Policy
    from cluster_cli.router.config import RouterSpec
    from cluster_cli.router.policy import POLICIES

    allowed = set(typing.get_args(RouterSpec.model_fields["policy"].annotation))
    assert {p.value for p in Policy} == set(POLICIES) == allowed
    res = CliRunner().invoke(_app(), ["serve-router", "--help"], env={"COLUMNS": "250"})  # one row per option
    assert res.exit_code == 0
    out = res.output
    assert " ." not in out  # rich ate "[default: ...]" in the help text and left the period behind
    rows = {}
    last = None
    for line in out.splitlines():
        parts = line.strip("│ *").split()
        if parts and parts[0].startswith("--"):
            last = parts[0]
            rows[last] = " ".join(parts[1:])
        elif parts and last and line.startswith("│") and not line[1:30].strip(" *"):
            rows[last] += " " + " ".join(parts)  # the row's help, wrapped
        else:
            last = None
    assert set(rows) >= {"--config", "--policy", "--max-body-bytes", "--connect-timeout", "--idle-timeout",
                         "--max-queue", "--queue-timeout", "--log-level", "--watch-interval"}  # fmt: skip
    for opt, row in rows.items():
        if opt not in ("--config", "--help"):
            assert "default" in row, (opt, row)
    assert "<least_load|p2c|round_robin|prefix>" in rows["--policy"] and "prefix if unset" in rows["--policy"]
    assert "<debug|info|warning|error>" in rows["--log-level"] and "[default: warning]" in rows["--log-level"]
    assert "32 MiB" in rows["--max-body-bytes"] and "5 if unset" in rows["--connect-timeout"]
    assert "300 if unset" in rows["--idle-timeout"] and "256 if unset" in rows["--max-queue"]
    assert "30 if unset" in rows["--queue-timeout"]
    assert "Exit codes: 0 clean shutdown" in out and "2 bad config" in out and "130 interrupted" in out
    assert "clusterctl serve-router --config router.yaml" in out  # the example stays
    assert [m.value for m in LogLevel] == ["debug", "info", "warning", "error"]


def test_cli_rejects_unknown_choices_with_exit_2(tmp_path):
    p = write(tmp_path, "models: {m: {endpoints: [{url: 'http://h:1'}]}}")
    for flag, value in (("--policy", "random"), ("--log-level", "loud")):
        res = CliRunner().invoke(_app(), ["serve-router", "--config", str(p), flag, value])
        assert res.exit_code == 2 and value in res.output, res.output


@pytest.mark.slow
def test_cli_flag_values_the_config_refuses_name_the_flag(tmp_path):
    p = write(tmp_path, "models: {m: {endpoints: [{url: 'http://h:1'}]}}")
    for args, needle in (
        (["--max-body-bytes", "10"], "--max-body-bytes 10: Input should be greater than or equal to 1024"),
        (["--queue-timeout", "-1"], "--queue-timeout -1.0: Input should be greater than 0"),
    ):
        res = subprocess.run(
            [*CLI, "serve-router", "--config", str(p), "--port", "0", *args], capture_output=True, text=True, timeout=60
        )
        lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
        assert res.returncode == 2 and len(lines) == 1 and needle in lines[0], res.stderr


@pytest.mark.slow
def test_cli_bad_config_exits_2_with_one_line(tmp_path):
    p = write(tmp_path, "models: {m: {endpoints: [{url: 'http://h:1', nope: 1}]}}")
    res = subprocess.run(
        [*CLI, "serve-router", "--config", str(p), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "models.m.endpoints.0.nope: unknown key" in lines[0]
    res = subprocess.run(  # --log-level is case-insensitive, as before
        [*CLI, "serve-router", "--config", str(tmp_path / "missing.yaml"), "--log-level", "INFO", "--policy", "p2c"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2 and "file not found" in res.stderr


@pytest.mark.slow
def test_cli_serves_reloads_on_sighup_and_stops(tmp_path):
    """The real command: listens on 127.0.0.1, answers /v1/models, reloads on SIGHUP (and
    reopens its access log, rotated away meanwhile), exits on SIGTERM."""
    p = write(tmp_path, "models: {a: {endpoints: [{url: 'http://127.0.0.1:9'}]}}")
    alog = tmp_path / "access.log"
    with socket_port() as port:
        pass
    proc = subprocess.Popen(
        [*CLI, "serve-router", "--config", str(p), "--port", str(port),
         "--watch-interval", "60", "--access-log", str(alog)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}/v1/models"
        ids = _poll(lambda: [m["id"] for m in httpx.get(url, timeout=2).json()["data"]])
        assert ids == ["a"]
        assert _poll(lambda: alog.stat().st_size > 0, until=True) is True  # its line, flushed
        alog.rename(tmp_path / "access.log.1")  # log rotation
        p.write_text("models: {b: {endpoints: [{url: 'http://127.0.0.1:9'}]}}")
        os.kill(proc.pid, signal.SIGHUP)
        assert _poll(lambda: [m["id"] for m in httpx.get(url, timeout=2).json()["data"]], until=["b"]) == ["b"]
        assert _poll(lambda: alog.exists() and '"path":"/v1/models"' in alog.read_text(), until=True) is True
    finally:
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err


class socket_port:
    """A free TCP port on 127.0.0.1 (bound and released)."""

    def __enter__(self) -> int:
        import socket

        self.s = socket.socket()
        self.s.bind(("127.0.0.1", 0))
        return self.s.getsockname()[1]

    def __exit__(self, *exc: object) -> None:
        self.s.close()


def _poll(fn, until=None, timeout: float = 90.0):
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            last = fn()
            if until is None or last == until:
                return last
        except (httpx.HTTPError, KeyError, ValueError):
            pass
        time.sleep(0.1)
    return last


@pytest.mark.slow
def test_cli_unusable_keys_file_or_watch_interval_exits_2(tmp_path):
    p = write(tmp_path, "models: {m: {endpoints: [{url: 'http://h:1'}]}}")
    keys = tmp_path / "keys.txt"
    keys.write_bytes(b"\xff\xfe not utf-8\n")
    res = subprocess.run([*CLI, "serve-router", "--config", str(p), "--port", "0", "--api-keys-file", str(keys)],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert res.returncode == 2 and "keys.txt: cannot read API keys: not UTF-8 text (byte 0)" in res.stderr
    assert "Traceback" not in res.stderr
    for value in ("0", "-1"):  # 0 would poll in a busy loop
        res = subprocess.run([*CLI, "serve-router", "--config", str(p), "--watch-interval", value],
                             capture_output=True, text=True, timeout=60)  # fmt: skip
        assert res.returncode == 2 and "--watch-interval" in res.stderr, res.stderr


@pytest.mark.slow
def test_cli_watches_the_api_keys_file(tmp_path):
    """A key removed from the file stops working without a SIGHUP; a file that becomes
    unusable keeps the previous keys, and /health says so until it is fixed."""
    p = write(tmp_path, "models: {a: {endpoints: [{url: 'http://127.0.0.1:9'}]}}")
    keys = tmp_path / "keys.txt"
    keys.write_text("old-key\n")
    with socket_port() as port:
        pass
    proc = subprocess.Popen(
        [*CLI, "serve-router", "--config", str(p), "--port", str(port), "--api-keys-file", str(keys),
         "--watch-interval", "0.1", "--access-log", "off"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"

    def status(key: str) -> int:
        return httpx.get(base + "/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=2).status_code

    try:
        assert _poll(lambda: status("old-key"), until=200) == 200
        keys.write_text("new-key\n")
        assert _poll(lambda: (status("old-key"), status("new-key")), until=(401, 200)) == (401, 200)
        keys.write_bytes(b"\xff\n")  # unusable: the previous keys stay

        def health_of(key: str | None) -> dict:
            auth = {"Authorization": f"Bearer {key}"} if key else {}
            return httpx.get(base + "/health", headers=auth, timeout=2).json()

        def keys_error(key: str) -> object:  # /health's detail needs a valid key: "no detail" without one
            return health_of(key).get("last_keys_error", "no detail")

        assert _poll(lambda: keys_error("new-key") is not None, until=True)
        health = health_of("new-key")
        assert health["status"] == "degraded" and "not UTF-8" in health["last_keys_error"]
        assert health_of(None) == health_of("wrong-key") == {"status": "degraded"}  # no detail without a key
        assert status("new-key") == 200
        metrics = httpx.get(base + "/metrics", timeout=2).text
        assert 'clusterctl_router_api_keys_reloads_total{result="rejected"} 1.0' in metrics
        keys.write_text("third-key\n")
        assert _poll(lambda: keys_error("third-key") is None, until=True)
        assert (status("new-key"), status("third-key")) == (401, 200)
    finally:
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("http://h:8080", "http://h:08080"),  # one port, two spellings: twice the engine's max_inflight
        ("http://[::1]:8080", "http://[0:0:0:0:0:0:0:1]:8080"),
        ("http://HOST:8080/", "http://host:8080"),
    ],
)
def test_one_engine_under_two_spellings_is_listed_twice(a: str, b: str) -> None:
    with pytest.raises(ValueError, match="listed twice"):
        RouterConfig.model_validate({"models": {"m": {"endpoints": [{"url": a}, {"url": b}]}}})


def test_credentials_in_an_endpoint_url_are_refused_not_ignored() -> None:
    with pytest.raises(ValueError, match="credentials in an endpoint URL are not supported"):
        RouterConfig.model_validate({"models": {"m": {"endpoints": [{"url": "http://me:pw@h:8080"}]}}})


def test_a_models_admission_overrides_the_routers_key_by_key() -> None:
    """A model that sets only max_queue keeps router.admission's max_wait_s (it got the
    built-in 30 s), and so the --queue-timeout flag's, which sets router.admission."""
    from cluster_cli.router.registry import build_table

    cfg = RouterConfig.model_validate(
        {
            "models": {
                "a": {"endpoints": [{"url": "http://h:1"}], "admission": {"max_queue": 10}},
                "b": {"endpoints": [{"url": "http://h:2"}], "admission": {"max_wait_s": 5}},
                "c": {"endpoints": [{"url": "http://h:3"}]},
            },
            "router": {"admission": {"max_queue": 7, "max_wait_s": 2}},
        }
    )
    limits = {
        name: (e.queue.limits.max_queue, e.queue.limits.max_wait_s) for name, e in build_table(cfg).models.items()
    }
    assert limits == {"a": (10, 2.0), "b": (7, 5.0), "c": (7, 2.0)}


def test_an_endpoint_under_two_models_drains_if_either_says_so_and_takes_the_tighter_limit() -> None:
    url = "http://10.0.0.1:8000"
    cfg = router_config(
        {
            "a": {"endpoints": [{"url": url, "draining": True, "max_inflight": 8}]},
            "b": {"endpoints": [{"url": url, "max_inflight": 2}]},
        }
    )
    (view,) = endpoint_views(cfg).values()
    assert view.draining is True and view.max_inflight == 2 and view.models == ("a", "b")
    flipped = router_config(
        {
            "a": {"endpoints": [{"url": url, "max_inflight": 2}]},
            "b": {"endpoints": [{"url": url, "draining": True, "max_inflight": 8}]},
        }
    )
    (view,) = endpoint_views(flipped).values()
    assert view.draining is True and view.max_inflight == 2


def test_the_configured_health_failure_threshold_reaches_the_breakers() -> None:
    cfg = router_config(
        {"m": {"endpoints": [{"url": "http://10.0.0.1:8000"}]}}, {"breaker": {"health_failure_threshold": 4}}
    )
    (w,) = build_table(cfg).endpoints.values()
    for _ in range(3):
        w.breaker.on_health(False)
    assert w.breaker.current() is State.CLOSED
    w.breaker.on_health(False)
    assert w.breaker.current() is State.OPEN


def test_retry_attempts_are_bounded() -> None:
    from pydantic import ValidationError

    models = {"m": {"endpoints": [{"url": "http://10.0.0.1:8000"}]}}
    assert router_config(models, {"retry": {"max_attempts": 10}}).router.retry.max_attempts == 10
    with pytest.raises(ValidationError):
        router_config(models, {"retry": {"max_attempts": 11}})


def test_serve_router_help_paragraphs_wrap_at_the_terminal_width() -> None:
    # rich keeps a help text's own line breaks: a paragraph written over several source lines
    # broke there and again at the terminal's width, leaving ragged one-word lines.
    r = CliRunner().invoke(app, ["serve-router", "--help"], env={"COLUMNS": "240"}, terminal_width=240)
    assert r.exit_code == 0
    lines = [ln.strip() for ln in r.output.splitlines()]
    assert any("SIGHUP; an invalid new one is logged and the previous one keeps serving." in ln for ln in lines)
    assert any("2 bad config, API keys file or option value, an access log" in ln for ln in lines)
    assert any(ln.startswith("- {url:") and "draining: true}" in ln for ln in lines)  # the example stays verbatim


def test_an_endpoint_may_carry_its_engines_key(tmp_path) -> None:
    p = write(
        tmp_path,
        """\
        models:
          tiny:
            endpoints:
              - {url: "http://198.18.0.11:8080", engine: llamacpp, replica: tiny/0, api_key: "ck-0123abcd"}
              - {url: "http://198.18.0.12:8080", engine: llamacpp, replica: tiny/1}
        """,
    )
    views = endpoint_views(load_router_config(p))
    assert views["http://198.18.0.11:8080"].api_key == "ck-0123abcd"
    assert views["http://198.18.0.12:8080"].api_key is None  # an engine without one: nothing is sent
    table = build_table(load_router_config(p))
    w = table.endpoints["http://198.18.0.11:8080"]
    assert w.head_lines == b"198.18.0.11:8080\r\nAuthorization: Bearer ck-0123abcd\r\n"
    assert table.endpoints["http://198.18.0.12:8080"].head_lines == b"198.18.0.12:8080\r\n"
    assert "ck-0123abcd" not in json.dumps(w.snapshot(0.0))  # /health's detail never shows it


def test_a_password_in_an_endpoint_url_is_not_repeated_in_the_error() -> None:
    with pytest.raises(ValueError, match="give api_key") as e:
        RouterConfig.model_validate({"models": {"m": {"endpoints": [{"url": "http://me:hunter2@h:8080"}]}}})
    assert "hunter2" not in e.value.errors()[0]["msg"] and "***@h:8080" in e.value.errors()[0]["msg"]
