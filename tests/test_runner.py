"""The SSH connector's known_hosts handling, pin-file trust and identity files (no network)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import asyncssh
import pytest

from cluster_cli.config.inventory import SSHTarget
from cluster_cli.probe.runner import AsyncsshConnector, _existing, _untrusted


def _line(name: str) -> str:
    key = asyncssh.generate_private_key("ssh-ed25519")
    return f"{name} {key.export_public_key('openssh').decode().strip()}\n"


def test_known_hosts_is_parsed_once_and_again_when_it_changes(tmp_path: Path) -> None:
    kh = tmp_path / "known_hosts"
    kh.write_text(_line("n1") + _line("n2"))
    c = AsyncsshConnector()
    first = c._parse(str(kh))
    assert isinstance(first, asyncssh.SSHKnownHosts)
    assert c._parse(str(kh)) is first  # unchanged file: the parsed copy is reused
    with kh.open("a") as f:  # a new pin (accept-new appends) must be seen
        f.write(_line("n3"))
    second = c._parse(str(kh))
    assert second is not first
    assert second.match("n3", "", None)[0], "the key pinned after the first parse is known"
    assert not first.match("n3", "", None)[0]


def test_a_missing_known_hosts_is_left_to_asyncssh_to_report(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope")
    assert AsyncsshConnector()._parse(missing) == missing


def test_two_first_contacts_at_once_pin_one_key(tmp_path: Path, monkeypatch) -> None:
    # Two clusterctl processes (two connectors) meet a new node at the same moment, and see
    # different keys (a race, or someone in the middle): only one key may be pinned for the name.
    import asyncio

    from cluster_cli.config.inventory import ACCEPT_NEW, SSHTarget
    from cluster_cli.probe import runner

    keys = iter([asyncssh.generate_private_key("ssh-ed25519") for _ in range(2)])

    async def fake_host_key(*args, **kwargs):
        await asyncio.sleep(0.01)
        return next(keys)

    monkeypatch.setattr(runner.asyncssh, "get_server_host_key", fake_host_key)
    pinned = tmp_path / "state.known_hosts"
    target = SSHTarget(name="n1", host="198.18.0.77", port=None, user=None, identity_file=None,
                       known_hosts=ACCEPT_NEW)  # fmt: skip

    async def both() -> None:
        dest = runner._Dest("n1", "n1: ", target.host, None, None, (target.host, 22))
        await asyncio.gather(*(AsyncsshConnector(pinned)._known_hosts(target, dest, [], None, "") for _ in range(2)))

    asyncio.run(both())
    lines = pinned.read_text().splitlines()
    assert len(lines) == 1 and lines[0].startswith("n1 ssh-ed25519 ")


def test_an_unresolvable_host_name_says_so() -> None:
    import socket

    from cluster_cli.probe.runner import ssh_error_message

    t = SSHTarget(name="a", host="no-such-host.invalid", port=None, user=None, identity_file=None, known_hosts="kh")
    msg = ssh_error_message(socket.gaierror(-2, "Name or service not known"), t)
    assert msg == "cannot resolve the host name: Name or service not known (no-such-host.invalid:22)"


def test_a_probe_shell_killed_by_a_signal_is_named() -> None:
    import asyncio

    from cluster_cli.errors import SSHError
    from cluster_cli.probe.collect import run_batch

    class Killed:
        async def run_raw(self, command: str, *, timeout: float, input: bytes | None = None):
            return 137, b"", b""

    with pytest.raises(SSHError, match="probe script was killed by SIGKILL: no output"):
        asyncio.run(run_batch(Killed(), {"a": "true"}, 5.0))  # type: ignore[arg-type]


def _route(tmp_path: Path, config: str, host: str = "n1"):
    from cluster_cli.probe import runner

    cfg = tmp_path / "ssh_config"
    cfg.write_text(config)
    return runner._route([str(cfg)], host, None, None)


def test_route_follows_a_proxy_jump_chain_and_a_first_hop_s_own_jump(tmp_path: Path) -> None:
    route, real, keys, _ = _route(
        tmp_path,
        "Host n1\n  HostName 10.0.0.1\n  Port 2201\n  ProxyJump a,u@b:2222\n  IdentityFile /keys/%h\n"
        "Host a\n  HostName 10.9.0.1\n  ProxyJump z\n"
        "Host z\n  HostName 10.9.0.9\n  IdentityFile /keys/z\n",
    )
    assert real == ("10.0.0.1", 2201) and keys == ("/keys/10.0.0.1",)
    assert [(d.alias, d.host, d.port, d.user, d.real, d.keys) for d in route] == [
        ("jump:z", "z", None, None, ("10.9.0.9", 22), ("/keys/z",)),
        ("jump:a", "a", None, None, ("10.9.0.1", 22), ()),
        ("jump:[b]:2222", "b", 2222, "u", ("b", 2222), ()),  # pinned apart from b on port 22
    ]
    assert [d.label for d in route] == ["jump host z: ", "jump host a: ", "jump host b:2222: "]
    assert all(d.jump for d in route)


def test_route_without_proxy_jump_is_direct(tmp_path: Path) -> None:
    assert _route(tmp_path, "Host n1\n  HostName 10.0.0.1\n") == ((), ("10.0.0.1", 22), (), False)
    assert _route(tmp_path, "Host n1\n  ProxyJump none\n") == ((), ("n1", 22), (), False)
    assert _route(tmp_path, "Host n1\n  HostKeyAlgorithms ssh-ed25519\n")[3] is True


@pytest.mark.parametrize(
    ("config", "message"),
    [
        # `Host *` sends the jump host through itself
        ("Host *\n  ProxyJump j\n", "ProxyJump loops through j (ssh_config: ProxyJump j)"),
        # two jump hosts that each go through the other
        ("Host n1\n  ProxyJump ja\nHost ja\n  ProxyJump jb\nHost jb\n  ProxyJump ja\n",
         "ProxyJump loops through ja (ssh_config: ProxyJump ja)"),
        # back through the node itself
        ("Host n1\n  ProxyJump j\nHost j\n  ProxyJump n1\n", "ProxyJump loops through n1 (ssh_config: ProxyJump n1)"),
        ("Host n1\n  ProxyJump j:port\n", "ProxyJump: cannot read the hop 'j:port'"),
        ("Host n1\n  ProxyJump j:70000\n", "ProxyJump: cannot read the hop 'j:70000'"),
    ],
)  # fmt: skip
def test_route_refuses_loops_and_unreadable_hops(tmp_path: Path, config: str, message: str) -> None:
    from cluster_cli.probe import runner

    with pytest.raises(runner._RouteError) as e:
        _route(tmp_path, config)
    assert str(e.value) == message


def test_route_follows_only_a_first_hop_s_own_jump(tmp_path: Path) -> None:
    # OpenSSH reaches a later hop through the one before it, whatever ssh_config says of it.
    route, _, _, _ = _route(tmp_path, "Host n1\n  ProxyJump a,b\nHost b\n  ProxyJump n1\n")
    assert [d.host for d in route] == ["a", "b"]


def test_route_reads_match_final_blocks_and_pins_by_the_resolved_port(tmp_path: Path) -> None:
    route, _, _, _ = _route(tmp_path, "Host b\n  Port 2222\nMatch final originalhost n1\n  ProxyJump b\n")
    assert [(d.alias, d.real) for d in route] == [("jump:[b]:2222", ("b", 2222))]


def test_a_pin_file_anyone_can_write_is_not_trusted(tmp_path: Path) -> None:
    f = tmp_path / "pins"
    f.write_text("")
    f.chmod(0o646)
    assert _untrusted(os.stat(f)) == "is writable by every user"
    f.chmod(0o600)
    assert _untrusted(os.stat(f)) is None
    assert stat.S_IMODE(os.stat(f).st_mode) == 0o600


def test_an_identity_file_written_with_a_tilde_is_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".ssh").mkdir()
    (tmp_path / ".ssh" / "x").write_text("key")
    assert _existing(("~/.ssh/x", "~/.ssh/missing")) == ["~/.ssh/x"]
