"""The SSH connector's known_hosts handling (no network)."""

from __future__ import annotations

from pathlib import Path

import asyncssh
import pytest

from cluster_cli.config.inventory import SSHTarget
from cluster_cli.probe.runner import AsyncsshConnector


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
        await asyncio.gather(
            *(AsyncsshConnector(pinned)._known_hosts(target, "n1", target.host, None, None, "n1: ") for _ in range(2))
        )

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
