"""Nodes behind a jump host (ssh_config ``ProxyJump``), on real sshd nodes of the testbed, and
the routes ssh_config gives (``ssh -G``: Include, Match, a hop's own ProxyJump, loops).

One connection to each jump host serves every node behind it (a bastion with OpenSSH's
default ``MaxStartups 10:30:100`` would drop most of 64 logins at once), and the jump
host's key is verified like a node's: against the inventory's known_hosts, or pinned.
"""

from __future__ import annotations

import asyncio
import getpass
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from cluster_cli.cli.main import app
from cluster_cli.config.inventory import SSHTarget
from cluster_cli.ssh.messages import host_port as _host_port
from cluster_cli.ssh.route import Resolver, RouteError
from cluster_cli.ssh.route import split_hop as _parse_hop

runner = CliRunner()


def discover(state: Path, inventory: Path, *extra: str) -> tuple[int, dict[str, Any], str]:
    r = runner.invoke(app, ["--state", str(state), "discover", "-i", str(inventory), "-o", "json", *extra])
    doc = json.loads(r.stdout) if r.stdout.strip().startswith("{") else {}
    return r.exit_code, doc, r.stderr


def logins(node: Any) -> list[str]:
    """The "Accepted publickey ... from ADDR" lines of a node's sshd log."""
    return [ln for ln in node.log_path.read_text().splitlines() if "Accepted publickey" in ln]


def behind_jump(c: Any, jumps: list[str], nodes: list[str], *, chain: str | None = None,
                known_hosts: str = "known_hosts", pattern: str = "node-*") -> Path:  # fmt: skip
    """An inventory of ``nodes`` reached as ``node-NAME`` through ssh_config's ProxyJump
    (``chain``, default the first jump host); jump hosts are not inventory nodes."""
    d = c.inventory_path.parent
    cfg = []
    for j in jumps:
        n = c.nodes[j]
        cfg.append(
            f"Host {j}\n  HostName {n.host}\n  Port {n.port}\n  User {c.user}\n  IdentityFile {d / 'id_ed25519'}\n"
        )
    cfg.append(f"Host {pattern}\n  ProxyJump {chain or jumps[0]}\n")
    for name in nodes:
        cfg.append(f"Host node-{name}\n  HostName {c.nodes[name].host}\n  Port {c.nodes[name].port}\n")
    (d / "ssh_config").write_text("".join(cfg))
    data = yaml.safe_load(c.inventory_path.read_text())
    data["ssh_config"] = "ssh_config"
    data["defaults"]["known_hosts"] = known_hosts
    data["defaults"].pop("port", None)  # the port comes from ssh_config
    data["nodes"] = [{"name": n, "host": f"node-{n}"} for n in nodes]
    inv = d / "inv-jump.yaml"
    inv.write_text(yaml.safe_dump(data))
    return inv


def test_nodes_behind_a_jump_host_share_one_connection_to_it(testbed_factory, tmp_path: Path) -> None:
    c = testbed_factory("jump=cpu-only,n1=cpu-only,n2=cpu-only,n3=l40s-2x")
    inv = behind_jump(c, ["jump"], ["n1", "n2", "n3"])
    before = {n: len(logins(c.nodes[n])) for n in c.nodes}
    code, doc, err = discover(tmp_path / "s.db", inv)
    assert code == 0, err
    assert [(n["name"], n["reachable"]) for n in doc["nodes"]] == [("n1", True), ("n2", True), ("n3", True)]
    assert len(doc["nodes"][2]["gpus"]) == 2
    assert len(logins(c.nodes["jump"])) - before["jump"] == 1  # one login serves all three nodes
    for n in ("n1", "n2", "n3"):
        new = logins(c.nodes[n])[before[n] :]
        assert len(new) == 1
        if c.mode == "netns":  # the node saw the login come from the jump host, not from here
            assert f"from {c.nodes['jump'].host} " in new[0]


def test_a_jump_host_with_an_unknown_key_fails_its_nodes_naming_it(testbed_factory, tmp_path: Path) -> None:
    c = testbed_factory("jump=cpu-only,n1=cpu-only,n2=cpu-only")
    d = c.inventory_path.parent
    jump = c.nodes["jump"]
    key = jump.host_key_path.with_suffix(".pub").read_text().split()[1]
    lines = (d / "known_hosts").read_text().splitlines()
    (d / "kh-no-jump").write_text("".join(ln + "\n" for ln in lines if key not in ln))
    assert len((d / "kh-no-jump").read_text().splitlines()) == len(lines) - 1
    inv = behind_jump(c, ["jump"], ["n1", "n2"], known_hosts="kh-no-jump")
    before = len(logins(jump))
    code, doc, _ = discover(tmp_path / "s.db", inv)
    assert code == 1
    for n in doc["nodes"]:
        assert n["reachable"] is False
        assert n["error"].startswith("jump host jump: host key not verifiable in ")
    assert len(logins(jump)) == before  # never logged in to a jump host it could not verify


def test_accept_new_pins_jump_hosts_and_nodes_then_verifies(testbed_factory, tmp_path: Path) -> None:
    c = testbed_factory("b1=cpu-only,b2=cpu-only,n1=cpu-only,n2=cpu-only")
    inv = behind_jump(c, ["b1", "b2"], ["n1", "n2"], chain="b1,b2", known_hosts="accept-new")
    state = tmp_path / "s.db"
    before = {n: len(logins(c.nodes[n])) for n in c.nodes}
    for _ in range(2):  # first contact pins, the second run verifies against the pins
        code, doc, err = discover(state, inv)
        assert code == 0, err
        assert all(n["reachable"] for n in doc["nodes"])
    pins = state.with_suffix(".known_hosts").read_text().splitlines()
    # A jump host is pinned by its name, with its port when that is not 22 (loopback testbeds).
    jump = {j: f"jump:{j}" if c.nodes[j].port == 22 else f"jump:[{j}]:{c.nodes[j].port}" for j in ("b1", "b2")}
    assert sorted(ln.split()[0] for ln in pins) == sorted([jump["b1"], jump["b2"], "n1", "n2"])
    # Each run: one login to each hop of the chain; b2 is reached through b1.
    assert len(logins(c.nodes["b1"])) - before["b1"] == 2
    assert len(logins(c.nodes["b2"])) - before["b2"] == 2
    if c.mode == "netns":
        assert f"from {c.nodes['b1'].host} " in logins(c.nodes["b2"])[-1]
        assert f"from {c.nodes['b2'].host} " in logins(c.nodes["n1"])[-1]
    # A jump host whose key changed is refused, for every node behind it.
    other = c.nodes["n1"].host_key_path.with_suffix(".pub").read_text().split()[:2]
    text = "\n".join(f"{jump['b2']} {' '.join(other)}" if ln.startswith(f"{jump['b2']} ") else ln for ln in pins) + "\n"
    state.with_suffix(".known_hosts").write_text(text)
    code, doc, _ = discover(state, inv)
    assert code == 1
    assert all(n["error"].startswith("jump host b2: host key not verifiable") for n in doc["nodes"])


def test_include_and_match_route_nodes_through_the_jump_host(testbed_factory, tmp_path: Path) -> None:
    """The route ssh_config gives through Include and Match (read by ``ssh -G``, as ssh reads
    it) is the one used: n1 matches `Match originalhost` and goes through the jump host, n2
    matches `Match host` on its HostName and goes straight; its definitions come from an
    included file."""
    c = testbed_factory("jump=cpu-only,n1=cpu-only,n2=cpu-only")
    d = c.inventory_path.parent
    inv = behind_jump(c, ["jump"], ["n1", "n2"], pattern="no-such-host")
    (d / "conf.d").mkdir()
    (d / "conf.d" / "nodes.conf").write_text((d / "ssh_config").read_text())
    n2 = c.nodes["n2"]
    (d / "ssh_config").write_text(
        f"Include {d / 'conf.d'}/*.conf\n"
        f"Match host {n2.host} originalhost node-n2\n  ProxyJump none\n"
        "Match originalhost node-*\n  ProxyJump jump\n"
    )
    before = {n: len(logins(c.nodes[n])) for n in c.nodes}
    code, doc, err = discover(tmp_path / "s.db", inv)
    assert code == 0, err
    assert all(n["reachable"] for n in doc["nodes"])
    assert len(logins(c.nodes["jump"])) - before["jump"] == 1  # n1 only
    if c.mode == "netns":
        assert f"from {c.nodes['jump'].host} " in logins(c.nodes["n1"])[-1]
        assert f"from {c.nodes['jump'].host} " not in logins(n2)[-1]


def test_a_proxy_jump_loop_is_an_error_not_a_hang(testbed_factory, tmp_path: Path) -> None:
    c = testbed_factory("jump=cpu-only,n1=cpu-only")
    inv = behind_jump(c, ["jump"], ["n1"], pattern="*")  # `Host *` sends the jump host through itself
    code, doc, err = discover(tmp_path / "s.db", inv, "--timeout", "20")
    # A loop is the local configuration's fault, found before any node is contacted: exit 2,
    # one line naming the node, and no state written.
    assert code == 2 and doc == {}
    (line,) = err.strip().splitlines()
    assert line.endswith(
        "ssh_config (node n1, host node-n1): ProxyJump loops through jump (ssh_config: ProxyJump jump)"
    )
    assert not (tmp_path / "s.db").exists()


def test_two_jump_hosts_that_go_through_each_other_are_a_loop_not_a_hang(testbed_factory, tmp_path: Path) -> None:
    # n1 goes through ja, n2 through jb; ja's own ProxyJump is jb and jb's is ja.
    c = testbed_factory("ja=cpu-only,jb=cpu-only,n1=cpu-only,n2=cpu-only")
    inv = behind_jump(c, ["ja", "jb"], ["n1", "n2"], pattern="node-n1")
    cfg = c.inventory_path.parent / "ssh_config"
    text = (
        cfg.read_text()
        .replace("Host jb\n", "Host jb\n  ProxyJump ja\n")
        .replace("Host ja\n", "Host ja\n  ProxyJump jb\n")
    )
    cfg.write_text(text + "Host node-n2\n  ProxyJump jb\n")
    code, doc, err = discover(tmp_path / "s.db", inv, "--timeout", "20")
    assert code == 2 and doc == {} and not (tmp_path / "s.db").exists()
    (line,) = err.strip().splitlines()
    assert line.endswith("(node n1, host node-n1): ProxyJump loops through ja (ssh_config: ProxyJump ja)")
    # Each node's own loop, once the first is fixed (the route as connect time reads it).
    for host, hop in (("node-n1", "ja"), ("node-n2", "jb")):
        t = SSHTarget(name="n", host=host, port=None, user="root", identity_file=None, known_hosts="kh",
                      ssh_config=str(cfg))  # fmt: skip
        with pytest.raises(RouteError, match=f"^ProxyJump loops through {hop} \\(ssh_config: ProxyJump {hop}\\)$"):
            asyncio.run(Resolver().route(t))


def test_a_broken_chain_names_the_hop_that_could_not_reach_the_next(testbed_factory, tmp_path: Path) -> None:
    c = testbed_factory("b1=cpu-only,b2=cpu-only,n1=cpu-only")
    inv = behind_jump(c, ["b1", "b2"], ["n1"], chain="b1,b2")
    c.kill("b2")
    code, doc, _ = discover(tmp_path / "s.db", inv, "--timeout", "20")
    assert code == 1
    b2 = c.nodes["b2"]
    assert doc["nodes"][0]["error"].startswith(f"jump host b2: jump host b1 cannot reach {b2.host}:{b2.port}: ")


@pytest.mark.parametrize("known_hosts", ["known_hosts", "accept-new"])
def test_a_node_the_jump_host_cannot_reach(testbed_factory, tmp_path: Path, known_hosts: str) -> None:
    c = testbed_factory("jump=cpu-only,n1=cpu-only,n2=cpu-only")
    inv = behind_jump(c, ["jump"], ["n1", "n2"], known_hosts=known_hosts)
    c.kill("n2")
    code, doc, _ = discover(tmp_path / "s.db", inv, "--timeout", "20")
    assert code == 1
    n1, n2 = doc["nodes"]
    assert n1["reachable"] is True
    assert n2["reachable"] is False
    assert n2["error"].startswith(f"jump host jump cannot reach {c.nodes['n2'].host}:{c.nodes['n2'].port}: ")


@pytest.mark.parametrize(
    ("hop", "parsed"),
    [
        ("b1", (None, "b1", None)),
        ("root@b1:2222", ("root", "b1", 2222)),
        ("root@[::1]:2223", ("root", "::1", 2223)),
        ("[fe80::5]", (None, "fe80::5", None)),
        ("admin@2001:db8::7", ("admin", "2001:db8::7", None)),  # a bare IPv6 address has no port
        (" u@h ", ("u", "h", None)),
    ],
)
def test_a_hop_is_read_as_openssh_reads_it(hop: str, parsed: tuple[str | None, str, int | None]) -> None:
    """Before, ``[::1]:2223`` was the host name "[::1]" (never resolved) and ``root@::1`` was
    host ":" on port 1."""
    assert _parse_hop(hop) == parsed


@pytest.mark.parametrize("hop", ["", "u@", "[::1", "[::1]x", "[::1]:", "h:0", "h:70000", "h:x"])
def test_a_hop_that_cannot_be_read_is_refused(hop: str) -> None:
    with pytest.raises(ValueError):
        _parse_hop(hop)


def test_an_ipv6_address_with_a_port_is_written_in_brackets() -> None:
    assert _host_port("::1", 2223) == "[::1]:2223" and _host_port("b1", 22) == "b1:22"


def test_a_jump_host_logs_in_with_an_agent_held_identity_file_too(
    testbed_factory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """identity_file naming a public key (its private half in ssh-agent) serves the jump host
    that has no IdentityFile of its own, as it serves the node (the jump host tried to load
    the .pub as a private key: "cannot load identity file")."""
    import os
    import signal
    import subprocess

    c = testbed_factory("jump=cpu-only,n1=cpu-only")
    d = c.inventory_path.parent
    inv = behind_jump(c, ["jump"], ["n1"])
    (d / "ssh_config").write_text((d / "ssh_config").read_text().replace(f"  IdentityFile {d / 'id_ed25519'}\n", ""))
    (d / "only.pub").write_bytes((d / "id_ed25519.pub").read_bytes())
    data = yaml.safe_load(inv.read_text())
    data["defaults"]["identity_file"] = "only.pub"
    inv.write_text(yaml.safe_dump(data))
    monkeypatch.setenv("HOME", str(tmp_path))  # no default keys to fall back on
    sock = tmp_path / "agent.sock"
    started = subprocess.run(["ssh-agent", "-a", str(sock)], capture_output=True, text=True, check=True)
    pid = int(started.stdout.split("SSH_AGENT_PID=")[1].split(";")[0])
    try:
        monkeypatch.setenv("SSH_AUTH_SOCK", str(sock))
        subprocess.run(["ssh-add", "-q", str(d / "id_ed25519")], check=True, env={"SSH_AUTH_SOCK": str(sock)})
        code, doc, err = discover(tmp_path / "s.db", inv)
        assert code == 0 and doc["nodes"][0]["reachable"], (doc, err)
    finally:
        os.kill(pid, signal.SIGTERM)


def _route(tmp_path: Path, config: str, host: str = "n1", user: str | None = None):
    """The route to ``host`` with ``config`` as the inventory's ssh_config, as the connector reads it."""
    import asyncio

    cfg = tmp_path / "ssh_config"
    cfg.write_text(config)
    t = SSHTarget(name="n1", host=host, port=None, user=user, identity_file=None, known_hosts="kh", ssh_config=str(cfg))
    return asyncio.run(Resolver().route(t))


def test_route_follows_a_proxy_jump_chain_and_a_first_hop_s_own_jump(tmp_path: Path) -> None:
    r = _route(
        tmp_path,
        "Host n1\n  HostName 10.0.0.1\n  Port 2201\n  ProxyJump a,u@b:2222\n  IdentityFile /keys/%h\n"
        "Host a\n  HostName 10.9.0.1\n  ProxyJump z\n"
        "Host z\n  HostName 10.9.0.9\n  IdentityFile /keys/z\n",
        user="root",
    )
    assert r.node.real == ("10.0.0.1", 2201) and r.node.keys == ("/keys/10.0.0.1",)
    assert [(d.alias, d.host, d.port, d.user, d.keys) for d in r.hops] == [
        ("jump:z", "10.9.0.9", 22, getpass.getuser(), ("/keys/z",)),
        ("jump:a", "10.9.0.1", 22, getpass.getuser(), ()),
        ("jump:[b]:2222", "b", 2222, "u", ()),  # pinned apart from b on port 22
    ]
    assert [d.label for d in r.hops] == ["jump host z: ", "jump host a: ", "jump host b:2222: "]
    assert all(d.jump for d in r.hops)


def test_route_without_proxy_jump_is_direct(tmp_path: Path) -> None:
    r = _route(tmp_path, "Host n1\n  HostName 10.0.0.1\n")
    assert (r.hops, r.node.real, r.node.keys, r.node.host_key_algs) == ((), ("10.0.0.1", 22), (), ())
    r = _route(tmp_path, "Host n1\n  ProxyJump none\nHost *\n  ProxyJump j\n")  # `none`: the first match wins
    assert (r.hops, r.node.real) == ((), ("n1", 22))
    assert _route(tmp_path, "Host n1\n  HostKeyAlgorithms ssh-ed25519\n").node.host_key_algs == ("ssh-ed25519",)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        # `Host *` sends the jump host through itself
        ("Host *\n  ProxyJump j\n", "ProxyJump loops through j (j's own ProxyJump is j)"),
        # two jump hosts that each go through the other
        ("Host n1\n  ProxyJump ja\nHost ja\n  ProxyJump jb\nHost jb\n  ProxyJump ja\n",
         "ProxyJump loops through ja (ssh_config: ProxyJump ja)"),
        # back through the node itself
        ("Host n1\n  ProxyJump j\nHost j\n  ProxyJump n1\n", "ProxyJump loops through n1 (ssh_config: ProxyJump n1)"),
        # ssh itself refuses a hop it cannot read, naming the line
        ("Host n1\n  ProxyJump j:port\n", 'line 2: Invalid ProxyJump "j:port"'),
        ("Host n1\n  Port notanumber\n", "line 2: Bad port 'notanumber'."),
    ],
)  # fmt: skip
def test_route_refuses_loops_and_unreadable_lines(tmp_path: Path, config: str, message: str) -> None:
    with pytest.raises(RouteError) as e:
        _route(tmp_path, config)
    assert str(e.value).endswith(message), str(e.value)


def test_an_include_loop_is_named(tmp_path: Path) -> None:
    with pytest.raises(RouteError, match="Include loop"):
        _route(tmp_path, f"Include {tmp_path / 'ssh_config'}\n")


def test_route_follows_only_a_first_hop_s_own_jump(tmp_path: Path) -> None:
    # OpenSSH reaches a later hop through the one before it, whatever ssh_config says of it.
    r = _route(tmp_path, "Host n1\n  ProxyJump a,b\nHost b\n  ProxyJump n1\n")
    assert [d.alias for d in r.hops] == ["jump:a", "jump:b"]


def test_route_reads_match_final_blocks_and_pins_by_the_resolved_port(tmp_path: Path) -> None:
    r = _route(tmp_path, "Host b\n  Port 2222\nMatch final originalhost n1\n  ProxyJump b\n")
    assert [(d.alias, d.real) for d in r.hops] == [("jump:[b]:2222", ("b", 2222))]


def test_route_reads_includes_and_match_as_openssh_does(tmp_path: Path) -> None:
    """Include (absolute, and a glob), `Match host` against the HostName already set,
    `Match originalhost` against the name given, `Match user` against the login."""
    (tmp_path / "conf.d").mkdir()
    (tmp_path / "conf.d" / "10-n1").write_text("Host n1\n  HostName 10.0.0.1\n")
    r = _route(
        tmp_path,
        f"Include {tmp_path / 'conf.d'}/*\n"
        "Match host 10.0.0.1 originalhost n1\n  Port 2201\n"
        "Match user deploy\n  ProxyJump bastion:2022\n"
        "Host *\n  User deploy\n",
    )
    assert r.node.real == ("10.0.0.1", 2201)
    assert r.node.user == "deploy"
    # `Match user` is evaluated against the User known when it is read: not yet set here, so
    # the local user name (as `ssh -G n1` says), and no jump host.
    assert r.hops == () or [d.alias for d in r.hops] == ["jump:[bastion]:2022"]
    expected = _ssh_g_says(tmp_path / "ssh_config", "n1")
    assert (r.node.host, str(r.node.port), r.node.user) == (expected["hostname"], expected["port"], expected["user"])
    assert bool(r.hops) == ("proxyjump" in expected)
    r = _route(tmp_path, (tmp_path / "ssh_config").read_text(), user="deploy")  # the inventory's user
    assert [(d.alias, d.real) for d in r.hops] == [("jump:[bastion]:2022", ("bastion", 2022))]


def test_a_hop_s_own_user_port_and_uri_form(tmp_path: Path) -> None:
    r = _route(tmp_path, "Host n1\n  ProxyJump ssh://ops@a:2223,u@b\nHost b\n  Port 2200\n  User x\n")
    assert [(d.alias, d.host, d.port, d.user, d.label) for d in r.hops] == [
        ("jump:[a]:2223", "a", 2223, "ops", "jump host a:2223: "),
        ("jump:[b]:2200", "b", 2200, "u", "jump host b: "),  # the hop's user@ wins over ssh_config's User
    ]


def _ssh_g_says(cfg: Path, host: str, *extra: str) -> dict[str, str]:
    import subprocess

    out = subprocess.run(["ssh", "-G", "-F", str(cfg), *extra, host], capture_output=True, text=True, check=True)
    return dict(line.split(" ", 1) for line in out.stdout.splitlines() if " " in line)
