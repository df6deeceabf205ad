"""The SSH runner against hostile or changed peers: in-process asyncssh servers on loopback."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import asyncssh
import pytest

from cluster_cli.config.inventory import ACCEPT_NEW, SSHTarget
from cluster_cli.errors import SSHError
from cluster_cli.ssh import channels
from cluster_cli.ssh.connect import AsyncsshConnector
from cluster_cli.ssh.route import Resolver

Handler = Callable[[asyncssh.SSHServerProcess], Awaitable[None]]


class _Server(asyncssh.SSHServer):
    def begin_auth(self, username: str) -> bool:
        return True  # public key auth, against authorized_client_keys


async def _hello(proc: asyncssh.SSHServerProcess) -> None:
    proc.stdout.write(b"hi\n")
    proc.exit(0)


@asynccontextmanager
async def _serve(
    tmp: Path, host_key: asyncssh.SSHKey, handler: Handler = _hello, host: str = "127.0.0.1"
) -> AsyncIterator[int]:
    """An SSH server on ``host`` presenting ``host_key``; yields its port."""
    srv = await asyncssh.create_server(
        _Server, host, 0, server_host_keys=[host_key], authorized_client_keys=str(tmp / "id.pub"),
        process_factory=handler, encoding=None,
    )  # fmt: skip
    try:
        yield srv.sockets[0].getsockname()[1]
    finally:
        srv.close()
        await srv.wait_closed()


def _client(tmp: Path) -> None:
    key = asyncssh.generate_private_key("ssh-ed25519")
    key.write_private_key(str(tmp / "id"))
    key.write_public_key(str(tmp / "id.pub"))
    (tmp / "ssh_config").write_text("")  # never the user's own ~/.ssh/config


def _target(tmp: Path, name: str, host: str, port: int, known_hosts: str, **kw: float) -> SSHTarget:
    return SSHTarget(name=name, host=host, port=port, user="u", identity_file=str(tmp / "id"),
                     known_hosts=known_hosts, ssh_config=str(tmp / "ssh_config"), **kw)  # fmt: skip


def _public(key: asyncssh.SSHKey) -> str:
    return key.export_public_key("openssh").decode().strip()


async def _hi(c: AsyncsshConnector, t: SSHTarget) -> str:
    async with c.session(t) as s:
        return (await s.run("x", timeout=5)).stdout.strip()


def test_a_node_named_like_an_address_lends_its_pin_to_no_other_node(tmp_path: Path) -> None:
    # Node "127.0.0.1" (somewhere else) is pinned with key A; node gpu-b, which lives at
    # 127.0.0.1, is pinned with key B. gpu-b presenting A is a changed key: asyncssh's own
    # matching would also take the pin of the node *named* like gpu-b's address.
    _client(tmp_path)
    a, b = (asyncssh.generate_private_key("ssh-ed25519") for _ in range(2))
    pins = tmp_path / "state.known_hosts"
    pins.write_text(f"127.0.0.1 {_public(a)}\ngpu-b {_public(b)}\n")

    async def main() -> None:
        async with _serve(tmp_path, b) as port:  # the genuine key: accepted
            assert await _hi(AsyncsshConnector(pins), _target(tmp_path, "gpu-b", "127.0.0.1", port, ACCEPT_NEW)) == "hi"
        async with _serve(tmp_path, a) as port:
            with pytest.raises(SSHError, match="gpu-b: host key not verifiable: changed since it was pinned"):
                await _hi(AsyncsshConnector(pins), _target(tmp_path, "gpu-b", "127.0.0.1", port, ACCEPT_NEW))

    asyncio.run(main())
    assert pins.read_text().count("\n") == 2  # nothing pinned again


def test_a_user_known_hosts_still_matches_the_address_as_openssh_does(tmp_path: Path) -> None:
    _client(tmp_path)
    key = asyncssh.generate_private_key("ssh-ed25519")

    async def main() -> str:
        async with _serve(tmp_path, key) as port:
            (tmp_path / "kh").write_text(f"[127.0.0.1]:{port} {_public(key)}\n")  # by address only
            return await _hi(AsyncsshConnector(), _target(tmp_path, "n1", "localhost", port, str(tmp_path / "kh")))

    assert asyncio.run(main()) == "hi"


def test_a_changed_pinned_key_says_where_the_pin_is_and_what_to_do(tmp_path: Path) -> None:
    _client(tmp_path)
    key, old = (asyncssh.generate_private_key("ssh-ed25519") for _ in range(2))
    pins = tmp_path / "state.known_hosts"
    pins.write_text(f"n1 {_public(old)}\n")

    async def main() -> None:
        async with _serve(tmp_path, key) as port:
            with pytest.raises(SSHError) as e:
                await _hi(AsyncsshConnector(pins), _target(tmp_path, "n1", "127.0.0.1", port, ACCEPT_NEW))
            assert e.value.message == (
                f"n1: host key not verifiable: changed since it was pinned in {pins} (127.0.0.1:{port}); "
                "if the node was reinstalled, delete its line there (n1 ...) and run again"
            )

    asyncio.run(main())


@pytest.mark.parametrize("known", ["none", "other"])
def test_a_key_refused_by_a_known_hosts_file_says_unknown_or_changed(tmp_path: Path, known: str) -> None:
    _client(tmp_path)
    key = asyncssh.generate_private_key("ssh-ed25519")
    kh = tmp_path / "kh"

    async def main() -> None:
        async with _serve(tmp_path, key) as port:
            other = _public(asyncssh.generate_private_key("ssh-ed25519"))
            kh.write_text(f"[127.0.0.1]:{port} {other}\n" if known == "other" else "")
            with pytest.raises(SSHError) as e:
                await _hi(AsyncsshConnector(), _target(tmp_path, "n1", "127.0.0.1", port, str(kh)))
            name = f"[127.0.0.1]:{port}"
            if known == "none":
                assert e.value.message == (
                    f"n1: host key not verifiable in {kh}: no key for {name} there; "
                    f"add it (ssh-keyscan -p {port} 127.0.0.1 >> {kh}) or use known_hosts: accept-new"
                )
            else:
                assert e.value.message == (
                    f"n1: host key not verifiable in {kh}: it does not match the key there for {name}; "
                    f"if the node was reinstalled, remove that key (ssh-keygen -R '{name}' -f {kh}) and run again"
                )

    asyncio.run(main())


def _flooding(stream: str, stopped: asyncio.Event, written: list[int]) -> Handler:
    async def flood(proc: asyncssh.SSHServerProcess) -> None:
        out = proc.stdout if stream == "stdout" else proc.stderr
        blob = b"A" * (1 << 20)
        try:
            while True:
                out.write(blob)
                await out.drain()
                written[0] += len(blob)
        except Exception:
            pass  # the client closed the channel
        finally:
            stopped.set()

    return flood


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_a_flooding_command_is_cut_at_the_cap_not_buffered_until_the_timeout(tmp_path: Path, stream: str) -> None:
    _client(tmp_path)
    key = asyncssh.generate_private_key("ssh-ed25519")
    written = [0]

    async def main() -> None:
        stopped = asyncio.Event()
        async with _serve(tmp_path, key, _flooding(stream, stopped, written)) as port:
            (tmp_path / "kh").write_text(f"[127.0.0.1]:{port} {_public(key)}\n")
            t = _target(tmp_path, "n1", "127.0.0.1", port, str(tmp_path / "kh"))
            async with AsyncsshConnector().session(t) as s:
                with pytest.raises(SSHError) as e:
                    await s.run_raw("sh -s", timeout=20, input=b"exit\n")
                # The cap's error, not the timeout's ("command timed out after 20s").
                assert e.value.message == f"n1: command output over 8 MiB on {stream}, cut"
                await asyncio.wait_for(stopped.wait(), 5)  # the remote side was stopped too

    asyncio.run(main())
    # Cut at the cap: the sender got about 8 MiB (+ what the SSH window let through) out,
    # not the gigabytes that 20 s of flooding over loopback would be.
    assert 8 << 20 <= written[0] <= 32 << 20, written[0]


def test_output_up_to_the_cap_comes_back_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _client(tmp_path)
    key = asyncssh.generate_private_key("ssh-ed25519")
    monkeypatch.setattr(channels, "MAX_OUTPUT_BYTES", 1000)

    async def exact(proc: asyncssh.SSHServerProcess) -> None:
        proc.stdout.write(b"o" * 1000)
        proc.stderr.write(b"e" * 1000)
        proc.exit(3)

    async def main() -> tuple[int | None, bytes, bytes]:
        async with _serve(tmp_path, key, exact) as port:
            (tmp_path / "kh").write_text(f"[127.0.0.1]:{port} {_public(key)}\n")
            async with AsyncsshConnector().session(
                _target(tmp_path, "n1", "127.0.0.1", port, str(tmp_path / "kh"))
            ) as s:
                return await s.run_raw("x", timeout=5)

    assert asyncio.run(main()) == (3, b"o" * 1000, b"e" * 1000)


def test_a_revoked_host_key_is_named_as_revoked_not_as_changed(tmp_path: Path) -> None:
    """A key listed and also marked @revoked is refused; the advice must not be to re-trust it."""
    _client(tmp_path)
    key = asyncssh.generate_private_key("ssh-ed25519")
    kh = tmp_path / "kh"

    async def main() -> None:
        async with _serve(tmp_path, key) as port:
            kh.write_text(f"[127.0.0.1]:{port} {_public(key)}\n@revoked * {_public(key)}\n")
            with pytest.raises(SSHError) as e:
                await _hi(AsyncsshConnector(), _target(tmp_path, "n1", "127.0.0.1", port, str(kh)))
            msg = e.value.message
            assert msg.startswith(f"n1: host key not verifiable in {kh}: the node offered a key marked @revoked")
            assert "ssh-keygen -R" not in msg and "remove that key" not in msg

    asyncio.run(main())


def test_a_pin_file_without_a_final_newline_gets_the_new_pin_on_its_own_line(tmp_path: Path) -> None:
    _client(tmp_path)
    key, other = (asyncssh.generate_private_key("ssh-ed25519") for _ in range(2))
    pins = tmp_path / "state.known_hosts"
    pins.write_text(f"n0 {_public(other)}")  # edited by hand: no newline at the end

    async def main() -> None:
        async with _serve(tmp_path, key) as port:
            for _ in range(2):  # first contact pins it; the second connection verifies the pin
                assert (
                    await _hi(AsyncsshConnector(pins), _target(tmp_path, "n1", "127.0.0.1", port, ACCEPT_NEW)) == "hi"
                )

    asyncio.run(main())
    assert pins.read_text() == f"n0 {_public(other)}\nn1 {_public(key)}\n"


def test_an_ssh_config_identity_file_that_does_not_exist_is_skipped_as_openssh_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _client(tmp_path)
    home = tmp_path / "home"  # no default keys, no agent: only what ssh_config lists
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    key = asyncssh.generate_private_key("ssh-ed25519")
    kh = tmp_path / "kh"
    gone = tmp_path / "no-such-key"

    async def main() -> None:
        async with _serve(tmp_path, key) as port:
            kh.write_text(f"[127.0.0.1]:{port} {_public(key)}\n")
            t = _target(tmp_path, "n1", "127.0.0.1", port, str(kh)).model_copy(update={"identity_file": None})
            (tmp_path / "ssh_config").write_text(f"Host *\n  IdentityFile {gone}\n  IdentityFile {tmp_path / 'id'}\n")
            assert await _hi(AsyncsshConnector(), t) == "hi"
            (tmp_path / "ssh_config").write_text(f"Host *\n  IdentityFile {gone}\n")
            with pytest.raises(SSHError) as e:  # none left: the failure names the missing file
                await _hi(AsyncsshConnector(), t)
            assert e.value.message.startswith("n1: authentication failed")
            assert e.value.message.endswith(f"(ssh_config IdentityFile not found: {gone})")

    asyncio.run(main())


def test_a_hung_match_exec_never_holds_up_the_exit(tmp_path: Path) -> None:
    """ssh_config's `Match exec` runs a command while ``ssh -G`` resolves a host: one that
    hangs is ended (ssh and the command) when the node's deadline gives up on the lookup."""
    import os
    import time

    pid_file = tmp_path / "pid"
    cfg = tmp_path / "ssh_config"
    cfg.write_text(f'Match exec "echo $$ > {pid_file}; exec sleep 60"\n  Port 2222\n')
    t = SSHTarget(name="n1", host="h", port=None, user=None, identity_file=None, known_hosts="kh", ssh_config=str(cfg))

    async def main() -> None:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(Resolver().route(t), 1.0)

    started = time.monotonic()
    asyncio.run(main())
    assert time.monotonic() - started < 5
    pid = int(pid_file.read_text())
    for _ in range(50):  # the command is gone: killed with ssh's process group
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the Match exec command (pid {pid}) still runs")


@pytest.mark.parametrize("kind", ["symlink", "dangling-symlink", "world-writable", "another-users"])
def test_a_pin_file_someone_else_could_have_written_is_not_trusted_nor_written(tmp_path: Path, kind: str) -> None:
    """The pin file lives beside the state, which may be in a shared folder: a planted link
    would make the pin go into any file of ours (or read keys from one), and a file another
    user can write could hold their key for a node, accepted without a question."""
    import os

    _client(tmp_path)
    key = asyncssh.generate_private_key("ssh-ed25519")
    pins = tmp_path / "state.known_hosts"
    victim = tmp_path / "victim.txt"
    if kind == "symlink":
        victim.write_text("mine\n")
        pins.symlink_to(victim)
    elif kind == "dangling-symlink":
        pins.symlink_to(victim)
    else:
        pins.write_text(f"n1 {_public(key)}\n")  # a pin made by someone else: the right key, even
        if kind == "world-writable":
            pins.chmod(0o666)
        elif os.geteuid() == 0:
            os.chown(pins, 65534, 65534)
        else:
            pytest.skip("needs root to give the file to another user")

    async def main() -> str:
        async with _serve(tmp_path, key) as port:
            return await _hi(AsyncsshConnector(pins), _target(tmp_path, "n1", "127.0.0.1", port, ACCEPT_NEW))

    with pytest.raises(SSHError) as e:
        asyncio.run(main())
    expected = {
        "symlink": "is a symbolic link",
        "dangling-symlink": "is a symbolic link",
        "world-writable": "is writable by every user",
        "another-users": "belongs to another user",
    }[kind]
    assert expected in str(e.value) and str(pins) in str(e.value)
    if kind == "symlink":
        assert victim.read_text() == "mine\n"
    if kind == "dangling-symlink":
        assert not victim.exists()
