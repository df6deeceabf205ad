"""Engines behind the router's keys: the cluster secret, each replica generation's key, the key in
the shard's environment (never its argv), the router config that carries it (0600), and the
router that sends it to the engine (never the client's own) without ever showing it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import io
import json
import os
import shlex
import stat
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
from gguf_tiny import make_tiny_gguf
from llama import find_llama_server, free_port
from simengine import Fleet

from cluster_cli.config.catalog import Catalog
from cluster_cli.config.inventory import Inventory
from cluster_cli.engines import LaunchSpec, get_engine
from cluster_cli.errors import ConfigError, StateError
from cluster_cli.facts import Replica, Shard
from cluster_cli.launch import keys, routerconf
from cluster_cli.launch.shards import shard_starts
from cluster_cli.router.accesslog import AccessLog
from cluster_cli.router.config import RouterConfig, endpoint_views, load_router_config
from cluster_cli.router.keys import ApiKeys, digest
from cluster_cli.state.records import READY, ReplicaRecord

SECRET = bytes(range(32))


# ---------------------------------------------------------------------------- the secret


def test_the_secret_lives_beside_the_state() -> None:
    assert keys.secret_path(Path(".clusterctl/state.db")) == Path(".clusterctl/state.secret")
    assert keys.secret_path(Path("/x/state")) == Path("/x/state.secret")
    assert keys.secret_path(Path("/x/s.secret")) == Path("/x/s.secret.key")  # never the state itself


def test_the_secret_is_made_once_0600_whatever_the_umask(tmp_path: Path) -> None:
    path = tmp_path / "new" / "state.secret"
    old = os.umask(0)
    try:
        first = keys.ensure_secret(path)
    finally:
        os.umask(old)
    assert len(first) == 32 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert keys.ensure_secret(path) == first == keys.load_secret(path)  # kept: every key stays the same
    assert [p.name for p in path.parent.iterdir()] == ["state.secret"]  # no temporary file left


def test_commands_making_the_secret_at_once_end_up_with_one(tmp_path: Path) -> None:
    path = tmp_path / "state.secret"
    got: list[bytes] = []
    go = threading.Barrier(8)

    def make() -> None:
        go.wait()
        got.append(keys.ensure_secret(path))

    threads = [threading.Thread(target=make) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 8 and len(set(got)) == 1 and got[0] == path.read_bytes()


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644, 0o620, 0o660])
def test_a_secret_open_to_others_is_refused(tmp_path: Path, mode: int) -> None:
    path = tmp_path / "state.secret"
    path.write_bytes(SECRET)
    path.chmod(mode)
    for fn in (keys.load_secret, keys.ensure_secret):
        with pytest.raises(StateError, match=rf"open to others \(mode {mode:04o}\).*chmod 600") as e:
            fn(path)
        assert SECRET.hex() not in str(e.value)
    assert path.read_bytes() == SECRET  # never replaced


def test_a_secret_that_is_no_secret_is_refused(tmp_path: Path) -> None:
    short = tmp_path / "short.secret"
    short.write_bytes(b"abc")
    short.chmod(0o600)
    with pytest.raises(StateError, match="3 bytes, not 32"):
        keys.ensure_secret(short)
    real = tmp_path / "real.secret"
    real.write_bytes(SECRET)
    real.chmod(0o600)
    link = tmp_path / "link.secret"
    link.symlink_to(real)
    with pytest.raises(StateError, match="symbolic link"):
        keys.load_secret(link)
    (tmp_path / "dir.secret").mkdir(mode=0o700)
    with pytest.raises(StateError):
        keys.load_secret(tmp_path / "dir.secret")
    with pytest.raises(FileNotFoundError):
        keys.load_secret(tmp_path / "none.secret")


# ---------------------------------------------------------------------------- the keys


def test_each_generation_of_each_replica_has_its_own_key() -> None:
    k = keys.replica_key(SECRET, "llama-70b", 0, 1)
    assert k.startswith("ck-") and len(k) == 3 + 64 and all(c in "0123456789abcdef" for c in k[3:])
    assert keys.replica_key(SECRET, "llama-70b", 0, 1) == k  # computed again, never stored
    others = {
        keys.replica_key(SECRET, "llama-70b", 0, 2),  # the next generation
        keys.replica_key(SECRET, "llama-70b", 1, 1),
        keys.replica_key(SECRET, "llama-70", 0, 1),
        keys.replica_key(SECRET, "llama-70b0", 0, 1),  # no run-together ambiguity ("b" + "0" / "b0")
        keys.replica_key(bytes(32), "llama-70b", 0, 1),  # another cluster
    }
    assert k not in others and len(others) == 5
    # As HMAC-SHA256 of the secret over the replica's identity: anyone with the secret agrees.
    want = hmac.new(SECRET, b"clusterctl engine key v1\0llama-70b\x000\x001", hashlib.sha256).hexdigest()
    assert k == "ck-" + want


def _rec(
    model: str, i: int, gen: int, *, status: str = READY, endpoint: str | None = "http://n1:8000"
) -> ReplicaRecord:
    return ReplicaRecord(Replica(model, i, "p", "vllm", (Shard("n1", (0,)),)), generation=gen, status=status,
                         endpoint=endpoint, port=8000)  # fmt: skip


def test_published_keys_are_those_of_the_generations_render_publishes() -> None:
    recs = [_rec("m", 0, 3), _rec("m", 1, 1, status="starting"), _rec("m", 2, 1, endpoint=None)]
    got = keys.published_keys(SECRET, recs)
    assert got == {"m/0": keys.replica_key(SECRET, "m", 0, 3)}
    assert keys.record_key(SECRET, recs[0]) == got["m/0"]


# ---------------------------------------------------------------------------- shards


def _inputs(engine: str, nodes: int = 1) -> tuple[Catalog, Inventory]:
    prof = {"name": "p", "engine": engine, "model": "/models/m.gguf" if engine == "llamacpp" else "/models/m",
            "env": {"VLLM_API_KEY": "from-profile", "HF_TOKEN": "hf"}}  # fmt: skip
    if engine == "vllm":
        prof.update(gpu_class="H100", gpus=2, nodes=nodes)
    else:
        prof.update(cpus=4)
    engines = {"vllm": {"command": "/opt/v/bin/vllm"}, "llamacpp": {"command": "llama-server"}}
    cat = Catalog.model_validate({"engines": engines, "models": [{"name": "m", "profiles": [prof]}]})
    inv = Inventory.model_validate({"nodes": [{"name": f"n{i}", "host": f"10.0.0.{i}"} for i in (1, 2)]})
    return cat, inv


def _shard_rec(engine: str, nodes: int = 1) -> ReplicaRecord:
    shards = tuple(Shard(f"n{i + 1}", (0, 1) if engine == "vllm" else ()) for i in range(nodes))
    cpus = 4 if engine == "llamacpp" else None
    extra = (6390,) if nodes > 1 else ()
    return ReplicaRecord(Replica("m", 0, "p", engine, shards, cpus=cpus), generation=5, port=8001, extra_ports=extra)


@pytest.mark.parametrize(("engine", "var"), [("vllm", "VLLM_API_KEY"), ("llamacpp", "LLAMA_API_KEY")])
def test_shard_starts_gives_the_key_in_the_environment_only(engine: str, var: str) -> None:
    cat, inv = _inputs(engine)
    rec = _shard_rec(engine)
    key = keys.record_key(SECRET, rec)
    (s,) = shard_starts(rec, cat, inv, {}, api_key=key)
    assert s.script.env[var] == key
    assert not any(key in a for a in s.script.argv)
    (plain,) = shard_starts(rec, cat, inv, {})  # callers not yet updated: as before
    assert plain.script.argv == s.script.argv
    assert {k: v for k, v in s.script.env.items() if k != var} == {
        k: v for k, v in plain.script.env.items() if k != var
    }
    if engine == "vllm":
        assert plain.script.env[var] == "from-profile"  # no key given: the profile's own stays
    else:
        assert var not in plain.script.env


def test_a_multi_node_replica_gives_the_key_to_vllm_serve_alone() -> None:
    cat, inv = _inputs("vllm", nodes=2)
    rec = _shard_rec("vllm", nodes=2)
    key = keys.record_key(SECRET, rec)
    head, worker = shard_starts(rec, cat, inv, {}, api_key=key)
    assert head.script.env["VLLM_API_KEY"] == key
    assert worker.script.env["VLLM_API_KEY"] == "from-profile"  # a Ray worker serves no HTTP: not given it
    script = head.script.argv[2]
    assert key not in script and key not in " ".join(worker.script.argv)
    # The Ray head (its daemons outlive this shell) is started without the key in its environment.
    start, _, rest = script.partition(" && unset NCCL_IB_HCA && ")
    assert start.startswith("(unset VLLM_API_KEY && exec ") and start.endswith(")")
    assert shlex.split(start[len("(unset VLLM_API_KEY && exec ") : -1])[:3] == ["/opt/v/bin/ray", "start", "--head"]
    assert rest.startswith("RAY_ADDRESS=10.0.0.1:6390 && export RAY_ADDRESS && exec /opt/v/bin/vllm serve ")
    # Without a key the script is the one it always was.
    plain = shard_starts(rec, cat, inv, {})[0].script.argv[2]
    assert plain.startswith("/opt/v/bin/ray start --head --port=6390 ")


def test_the_key_is_not_in_the_repr_of_a_launch_spec() -> None:
    spec = LaunchSpec(model="m", served_name="m", host="h", port=1, api_key="ck-topsecret")
    assert "ck-topsecret" not in repr(spec)


# ---------------------------------------------------------------------------- the router config file


def _ready(model: str, i: int, gen: int, port: int, engine: str = "vllm") -> ReplicaRecord:
    return ReplicaRecord(Replica(model, i, "p", engine, (Shard("n1"),)), generation=gen, status=READY,
                         endpoint=f"http://10.0.0.1:{port}", port=port)  # fmt: skip


def test_render_gives_each_endpoint_its_key() -> None:
    recs = [_ready("m", 0, 2, 8000), _ready("m", 1, 1, 8001), _ready("tiny", 0, 1, 8002, "llamacpp")]
    by_name = {"m/0": "ck-a", "tiny/0": "ck-c"}  # m/1: started before keys, none
    doc = routerconf.render(recs, None, keys=by_name)
    eps = {e["replica"]: e for m in doc["models"].values() for e in m["endpoints"]}
    assert eps["m/0"]["api_key"] == "ck-a" and eps["tiny/0"]["api_key"] == "ck-c" and "api_key" not in eps["m/1"]
    by_rec = routerconf.render(recs, None, keys=lambda rec: keys.record_key(SECRET, rec))
    assert by_rec["models"]["m"]["endpoints"][0]["api_key"] == keys.replica_key(SECRET, "m", 0, 2)
    # The old signature, and no keys: no api_key anywhere (as before).
    assert routerconf.render(recs, None) == routerconf.render(recs, None, keys=None)
    assert "api_key" not in json.dumps(routerconf.render(recs, None))


def test_the_router_config_is_written_0600_and_read_back_with_its_keys(tmp_path: Path) -> None:
    path = tmp_path / "router.yaml"
    path.write_text("router: {policy: p2c}\nmodels: {}\n")
    path.chmod(0o644)  # as an older clusterctl wrote it
    recs = [_ready("m", 0, 2, 8000)]
    doc = routerconf.render(recs, None, keys=keys.published_keys(SECRET, recs))
    old = os.umask(0)
    try:
        routerconf.write(path, doc)
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    cfg = load_router_config(path)
    assert cfg.router.policy == "p2c"  # other sections kept
    (view,) = endpoint_views(cfg).values()
    assert view.api_key == keys.replica_key(SECRET, "m", 0, 2)
    # Unchanged content is not rewritten, but a file opened to others meanwhile is closed.
    path.chmod(0o644)
    before = path.stat().st_mtime_ns
    routerconf.write(path, doc)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.stat().st_mtime_ns == before
    new = tmp_path / "sub" / "new.yaml"
    routerconf.write(new, doc)
    assert stat.S_IMODE(new.stat().st_mode) == 0o600


def test_a_bad_key_in_the_config_is_refused_without_showing_it(tmp_path: Path) -> None:
    for bad in ("ck-has space-secret1", "ck-tab\tsecret1", "ck-newline\nsecret1", "ck-secret1\n", "", "ck-é-secret1"):
        p = tmp_path / "r.yaml"
        p.write_text(json.dumps({"models": {"m": {"endpoints": [{"url": "http://h:1", "api_key": bad}]}}}))
        with pytest.raises(ConfigError, match=r"api_key: an engine key is 1-4096 visible ASCII") as e:
            load_router_config(p)
        assert "secret1" not in str(e.value)
    p.write_text(json.dumps({"models": {"m": {"endpoints": [{"url": "http://h:1", "api_key": 12345}]}}}))
    with pytest.raises(ConfigError) as e:
        load_router_config(p)
    assert "12345" not in str(e.value)


def test_one_url_under_two_models_has_one_key() -> None:
    ep = {"url": "http://h:1", "replica": "r", "api_key": "ck-one-secret"}
    with pytest.raises(ValueError, match=r"api_key: http://h:1 has another api_key \(or none\) under a") as e:
        RouterConfig.model_validate(
            {"models": {"a": {"endpoints": [ep]}, "b": {"endpoints": [{**ep, "api_key": "ck-two"}]}}}
        )
    assert "ck-one-secret" not in e.value.errors()[0]["msg"]
    cfg = RouterConfig.model_validate({"models": {"a": {"endpoints": [ep]}, "b": {"endpoints": [ep]}}})
    (view,) = endpoint_views(cfg).values()
    assert view.api_key == "ck-one-secret" and view.models == ("a", "b")
    assert "ck-one-secret" not in repr(view) and "ck-one-secret" not in repr(cfg)


# ---------------------------------------------------------------------------- the router


class _Recorder:
    """An engine that records every request head and answers like vLLM with a key: 401 on /v1
    without ``Authorization: Bearer KEY``."""

    def __init__(self, key: str | None) -> None:
        self.key = key
        self.heads: list[bytes] = []
        self.server: asyncio.AbstractServer | None = None

    async def start(self) -> int:
        async def on(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                while True:
                    head = await reader.readuntil(b"\r\n\r\n")
                    self.heads.append(head)
                    lines = head.split(b"\r\n")
                    hdrs = {}
                    for line in lines[1:]:
                        k, _, v = line.partition(b":")
                        hdrs[k.strip().lower()] = v.strip()
                    await reader.readexactly(int(hdrs.get(b"content-length", b"0")))
                    path = lines[0].split(b" ")[1]
                    if (
                        self.key
                        and path.startswith(b"/v1")
                        and hdrs.get(b"authorization") != b"Bearer " + self.key.encode()
                    ):
                        body = b'{"error":"Unauthorized"}'
                        status = b"401 Unauthorized"
                    elif path == b"/metrics":
                        body, status = b"vllm:num_requests_running 1\nvllm:num_requests_waiting 0\n", b"200 OK"
                    elif path == b"/health":
                        body, status = b"", b"200 OK"
                    else:
                        body = json.dumps({"id": "x", "object": "chat.completion", "choices": []}).encode()
                        status = b"200 OK"
                    writer.write(b"HTTP/1.1 %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                                 % (status, len(body), body))  # fmt: skip
                    await writer.drain()
            except (asyncio.IncompleteReadError, ConnectionError):
                writer.close()

        self.server = await asyncio.start_server(on, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    def paths(self) -> list[tuple[bytes, bytes | None]]:
        """(path, Authorization value) of each request seen."""
        out = []
        for h in list(self.heads):
            lines = h.split(b"\r\n")
            auth = [ln.partition(b":")[2].strip() for ln in lines[1:] if ln.lower().startswith(b"authorization:")]
            assert len(auth) <= 1, h  # one Authorization, never the client's as well
            out.append((lines[0].split(b" ")[1], auth[0] if auth else None))
        return out


@contextlib.contextmanager
def _routed(engine_key: str | None, configured_key: str | None, **router_kw: object):
    f = Fleet(0)
    eng = _Recorder(engine_key)
    port = f.lt.run(eng.start())
    ep: dict = {"url": f"http://127.0.0.1:{port}", "engine": "vllm", "replica": "m/0"}
    if configured_key:
        ep["api_key"] = configured_key
    cfg = {"models": {"m": {"endpoints": [ep]}},
           "router": {"scrape_interval_s": 0.05, "health_interval_s": 0.1, "retry": {"max_attempts": 1}}}  # fmt: skip
    f.start(cfg=cfg, **router_kw)
    try:
        yield f, eng
    finally:
        if eng.server is not None:
            f.lt.call(eng.server.close)
        f.close()


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_the_router_sends_the_engines_key_and_never_the_clients() -> None:
    key = "ck-" + "7" * 64
    log = io.StringIO()
    with _routed(key, key, api_keys=ApiKeys({digest("sk-client")}), access_log=AccessLog(log)) as (f, eng):
        r = httpx.post(f.base + "/chat/completions", json=CHAT, headers={"Authorization": "Bearer sk-client"})
        assert r.status_code == 200, r.text
        f.lt.wait_for(
            lambda: {p for p, _ in eng.paths()} >= {b"/health", b"/metrics"}, what="a health check and a scrape"
        )
        seen = eng.paths()
        assert {a for _, a in seen} == {b"Bearer " + key.encode()}  # every request: chat, health, metrics
        assert not any(b"sk-client" in h for h in eng.heads)
        f.lt.wait_for(lambda: f.router.table.endpoints[next(iter(f.router.table.endpoints))].scraped.running == 1.0,
                      what="the scrape to be read")  # fmt: skip
        # The key shows nowhere the router speaks.
        health = httpx.get(f.url + "/health", headers={"Authorization": "Bearer sk-client"}).text
        metrics = httpx.get(f.url + "/metrics").text
        f.lt.call(f.router.access.flush)
        for text in (health, metrics, log.getvalue(), r.text):
            assert key not in text and "7777777777" not in text
        assert '"url"' in health  # (the detail, for a client with a key)


def test_a_wrong_key_in_the_config_reads_as_the_engines_refusal_and_never_shows(caplog) -> None:
    key = "ck-" + "5" * 64
    log = io.StringIO()
    with _routed(key, "ck-" + "6" * 64, access_log=AccessLog(log)) as (f, eng):
        r = httpx.post(f.base + "/chat/completions", json=CHAT)
        assert r.status_code == 401  # the engine's own answer, relayed
        f.lt.wait_for(lambda: any(p == b"/metrics" for p, _ in eng.paths()), what="a scrape")
        health = httpx.get(f.url + "/health").text
        f.lt.call(f.router.access.flush)
        for text in (health, httpx.get(f.url + "/metrics").text, log.getvalue(), caplog.text, r.text):
            assert "5555555555" not in text and "6666666666" not in text


def test_without_a_key_in_the_config_nothing_is_sent_upstream() -> None:
    with _routed(None, None, api_keys=ApiKeys({digest("sk-client")})) as (f, eng):
        r = httpx.post(f.base + "/chat/completions", json=CHAT, headers={"Authorization": "Bearer sk-client"})
        assert r.status_code == 200
        f.lt.wait_for(lambda: len(eng.heads) >= 2, what="a health check")
        assert {a for _, a in eng.paths()} == {None}


def test_a_reload_gives_the_endpoint_its_new_generations_key(tmp_path: Path) -> None:
    """A replica replaced at the same URL (a new generation, a new key): the router's next
    requests carry the new key, on the connections it already holds too."""
    old, new = "ck-" + "1" * 64, "ck-" + "2" * 64
    with _routed(old, old) as (f, eng):
        assert httpx.post(f.base + "/chat/completions", json=CHAT).status_code == 200
        cfg = f.router.cfg.model_dump()
        cfg["models"]["m"]["endpoints"][0]["api_key"] = new
        eng.key = new
        f.lt.call(lambda: f.router.reload(RouterConfig.model_validate(cfg)))
        assert httpx.post(f.base + "/chat/completions", json=CHAT).status_code == 200
        chats = [a for p, a in eng.paths() if p == b"/v1/chat/completions"]
        assert chats == [b"Bearer " + old.encode(), b"Bearer " + new.encode()]


def test_an_ssh_tunnelled_get_can_carry_the_key() -> None:
    """``http.fetch`` (what node-side checks use) sends the key when given one, and nothing else."""
    from cluster_cli.router.http import fetch

    key = "ck-" + "3" * 64
    f = Fleet(0)
    eng = _Recorder(key)
    try:
        port = f.lt.run(eng.start())
        assert f.lt.run(fetch("127.0.0.1", port, "/v1/models", 5.0))[0] == 401
        assert f.lt.run(fetch("127.0.0.1", port, "/v1/models", 5.0, api_key=key))[0] == 200
        assert [a for _, a in eng.paths()] == [None, b"Bearer " + key.encode()]
        with pytest.raises(ValueError, match="visible ASCII") as e:
            f.lt.run(fetch("127.0.0.1", port, "/health", 5.0, api_key="ck-x\r\nX-Evil: 1"))
        assert "Evil" not in str(e.value)
    finally:
        if eng.server is not None:
            f.lt.call(eng.server.close)
        f.close()


# ---------------------------------------------------------------------------- a real llama-server


@pytest.mark.llama
def test_llama_server_with_its_key_is_served_only_through_the_router(tmp_path: Path) -> None:
    """The adapter's own command line and environment, on the real binary: a client going
    around the router is refused (chat, /metrics), what llama-server leaves open stays open
    (/health, /v1/models: readiness checks need no key), and the router, given the key, serves
    chat and reads the load from /metrics."""
    binary = find_llama_server()
    if binary is None:
        pytest.skip("llama-server binary not found: set $LLAMA_SERVER or run scripts/install-llama-server.sh")
    model = make_tiny_gguf(tmp_path / "tiny.gguf")
    key = keys.replica_key(SECRET, "tiny", 0, 1)
    port = free_port()
    eng = get_engine("llamacpp")
    spec = LaunchSpec(model=str(model), served_name="tiny", host="127.0.0.1", port=port, cpus=1,
                      extra_args=("-c", "256", "--no-warmup"), api_key=key)  # fmt: skip
    argv = eng.command(spec, binary=binary)
    assert not any(key in a for a in argv)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_")}
    env.update(eng.env(spec))
    log = tmp_path / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, log.read_text(errors="replace")[-2000:]
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            assert time.monotonic() < deadline, "llama-server not healthy"
            time.sleep(0.1)
        bearer = {"Authorization": f"Bearer {key}"}
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert httpx.post(base + "/v1/chat/completions", json=chat, timeout=30).status_code == 401
        assert httpx.get(base + "/metrics", timeout=5).status_code == 401
        assert httpx.get(base + "/metrics", headers={"Authorization": f"bearer {key}"}, timeout=5).status_code == 401
        assert httpx.get(base + "/metrics", headers=bearer, timeout=5).status_code == 200
        assert httpx.get(base + "/health", timeout=5).status_code == 200  # open: readiness needs no key
        assert httpx.get(base + "/v1/models", timeout=5).status_code == 200  # open, as /models and /v1/health

        f = Fleet(0)
        ep = {"url": base, "engine": "llamacpp", "replica": "tiny/0", "api_key": key}
        f.start(
            cfg={
                "models": {"tiny": {"endpoints": [ep]}},
                "router": {"scrape_interval_s": 0.1, "health_interval_s": 0.2},
            }
        )
        try:
            r = httpx.post(
                f.base + "/chat/completions", json=chat, headers={"Authorization": "Bearer sk-x"}, timeout=60
            )
            assert r.status_code == 200, r.text
            (w,) = f.router.table.endpoints.values()
            f.lt.wait_for(
                lambda: w.scraped.running is not None and w.scraped.error is None, what="a scrape of /metrics"
            )
            assert w.health_ok is True
        finally:
            f.close()
        assert key not in log.read_text(errors="replace")  # llama-server does not print it
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
