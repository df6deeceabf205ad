"""The SSH connector's known_hosts handling (no network)."""

from __future__ import annotations

from pathlib import Path

import asyncssh

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
