"""The SSH connector's known_hosts handling, pin-file trust and identity files (no network)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import asyncssh
import pytest

from cluster_cli.config.inventory import SSHTarget
from cluster_cli.ssh.connect import AsyncsshConnector
from cluster_cli.ssh.identity import existing
from cluster_cli.ssh.route import Dest
from cluster_cli.ssh.trust import HostKeys, _untrusted


def _line(name: str) -> str:
    key = asyncssh.generate_private_key("ssh-ed25519")
    return f"{name} {key.export_public_key('openssh').decode().strip()}\n"


def test_known_hosts_is_parsed_once_and_again_when_it_changes(tmp_path: Path) -> None:
    kh = tmp_path / "known_hosts"
    kh.write_text(_line("n1") + _line("n2"))
    c = AsyncsshConnector()
    first = c.host_keys.parse(str(kh))
    assert isinstance(first, asyncssh.SSHKnownHosts)
    assert c.host_keys.parse(str(kh)) is first  # unchanged file: the parsed copy is reused
    with kh.open("a") as f:  # a new pin (accept-new appends) must be seen
        f.write(_line("n3"))
    second = c.host_keys.parse(str(kh))
    assert second is not first
    assert second.match("n3", "", None)[0], "the key pinned after the first parse is known"
    assert not first.match("n3", "", None)[0]


def test_a_missing_known_hosts_is_left_to_asyncssh_to_report(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope")
    assert AsyncsshConnector().host_keys.parse(missing) == missing


def test_two_first_contacts_at_once_pin_one_key(tmp_path: Path, monkeypatch) -> None:
    # Two clusterctl processes (two connectors) meet a new node at the same moment, and see
    # different keys (a race, or someone in the middle): only one key may be pinned for the name.
    import asyncio

    from cluster_cli.config.inventory import ACCEPT_NEW, SSHTarget

    keys = iter([asyncssh.generate_private_key("ssh-ed25519") for _ in range(2)])

    async def fake_host_key():
        await asyncio.sleep(0.01)
        return next(keys)

    pinned = tmp_path / "state.known_hosts"
    target = SSHTarget(name="n1", host="198.18.0.77", port=None, user=None, identity_file=None,
                       known_hosts=ACCEPT_NEW)  # fmt: skip

    async def both() -> None:
        dest = Dest("n1", "n1: ", target.host, 22, "root")
        await asyncio.gather(*(HostKeys(pinned).files(target, dest, fake_host_key) for _ in range(2)))

    asyncio.run(both())
    lines = pinned.read_text().splitlines()
    assert len(lines) == 1 and lines[0].startswith("n1 ssh-ed25519 ")


def test_an_unresolvable_host_name_says_so() -> None:
    import socket

    from cluster_cli.ssh.messages import ssh_error_message

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
    assert existing(("~/.ssh/x", "~/.ssh/missing")) == ["~/.ssh/x"]
