"""CLI bad input: one error line naming the file/field/node, the documented exit code, nothing written;
and cordon, uncordon and state paths as the README and ``--help`` describe them."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import asyncssh
import pytest
from helpers import dgx, write_inputs
from typer.testing import CliRunner

from cluster_cli.cli.main import app
from cluster_cli.state.store import Store

runner = CliRunner()


def write_key(path: Path, passphrase: str | None = None) -> Path:
    key = asyncssh.generate_private_key("ssh-ed25519")
    if passphrase:  # PKCS#8 encryption needs no bcrypt (OpenSSH's own format does)
        key.write_private_key(path, format_name="pkcs8-pem", passphrase=passphrase)
    else:
        key.write_private_key(path)
    path.chmod(0o600)  # as ssh-keygen leaves it (a key open to others is warned about)
    return path


def inv(tmp_path: Path, body: str) -> Path:
    p = tmp_path / "inventory.yaml"
    p.write_text(body)
    return p


def run(tmp_path: Path, *args: str):
    return runner.invoke(app, ["--state", str(tmp_path / "state.db"), *args])


def error_lines(result) -> list[str]:
    return [line for line in result.output.splitlines() if line.strip()]


def test_version_and_help_examples() -> None:
    r = runner.invoke(app, ["--version"])
    assert r.exit_code == 0 and r.output.startswith("clusterctl ")
    r = runner.invoke(app, ["--help"])
    assert r.exit_code == 0 and "clusterctl discover -i inventory.yaml" in r.output
    for cmd in ("discover", "cordon", "uncordon"):
        r = runner.invoke(app, [cmd, "--help"])
        assert r.exit_code == 0
        assert "clusterctl " + cmd in r.output  # every --help shows an example


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ("nodes: [{name: a, host: h\n", "invalid YAML"),
        ("nodes:\n  - {name: a, host: h, bogus: 1}\n", "nodes.0.bogus: unknown key"),
        ("nodes:\n  - {name: a, host: h}\n  - {name: a, host: h2}\n", "duplicate node name"),
    ],
)
def test_discover_bad_inventory_exits_2(tmp_path: Path, body: str, needle: str) -> None:
    r = run(tmp_path, "discover", "-i", str(inv(tmp_path, body)))
    assert r.exit_code == 2
    lines = error_lines(r)
    assert len(lines) == 1 and needle in lines[0] and "inventory.yaml" in lines[0]
    assert not (tmp_path / "state.db").exists()


def test_discover_missing_identity_file_names_node(tmp_path: Path) -> None:
    (tmp_path / "kh").write_text("")
    body = "defaults: {known_hosts: kh}\nnodes:\n  - {name: gpu-07, host: 198.18.0.77, identity_file: nokey}\n"
    r = run(tmp_path, "discover", "-i", str(inv(tmp_path, body)))
    assert r.exit_code == 2
    (line,) = error_lines(r)
    assert "inventory.yaml: line 3 (gpu-07): nodes.0.identity_file: identity file not found" in line
    assert line.endswith(str(tmp_path / "nokey"))


def test_a_mistake_under_defaults_names_the_defaults_line(tmp_path: Path) -> None:
    (tmp_path / "kh").write_text("")
    body = "fabrics: {}\ndefaults:\n  known_hosts: kh\n  identity_file: id_rsa\nnodes:\n  - {name: h1, host: 198.18.0.77}\n"
    r = run(tmp_path, "discover", "-i", str(inv(tmp_path, body)))
    assert r.exit_code == 2
    (line,) = error_lines(r)
    assert "inventory.yaml: line 4: defaults.identity_file: identity file not found" in line and "nodes.0" not in line
    write_key(tmp_path / "id_rsa")
    r = run(tmp_path, "discover", "-i", str(inv(tmp_path, body.replace("known_hosts: kh", "known_hosts: nofile"))))
    (line,) = error_lines(r)
    assert r.exit_code == 2 and "inventory.yaml: line 3: defaults.known_hosts: known_hosts file not found" in line
    assert not (tmp_path / "state.db").exists()


def test_discover_missing_known_hosts(tmp_path: Path) -> None:
    write_key(tmp_path / "id")
    body = "defaults: {identity_file: id, known_hosts: nofile}\nnodes:\n  - {name: gpu-07, host: 198.18.0.77}\n"
    r = run(tmp_path, "discover", "-i", str(inv(tmp_path, body)))
    assert r.exit_code == 2
    (line,) = error_lines(r)
    assert "known_hosts file not found" in line and "accept-new" in line


def test_discover_unknown_node_flag(tmp_path: Path) -> None:
    write_key(tmp_path / "id")
    (tmp_path / "kh").write_text("")
    body = "defaults: {identity_file: id, known_hosts: kh}\nnodes:\n  - {name: a, host: 198.18.0.77}\n"
    r = run(tmp_path, "discover", "-i", str(inv(tmp_path, body)), "--node", "zz")
    assert r.exit_code == 2 and "'zz'" in r.output


def test_cordon_roundtrip_and_unknown_node(tmp_path: Path) -> None:
    p = inv(tmp_path, "nodes:\n  - {name: gpu-01, host: h}\n")
    Store(tmp_path / "state.db").close()  # as the first discover leaves it
    r = run(tmp_path, "cordon", "nope", "-i", str(p), "--reason", "x")
    assert r.exit_code == 2 and "no node named 'nope'" in r.output
    r = run(tmp_path, "cordon", "gpu-01", "-i", str(p), "--reason", "fan failure")
    assert r.exit_code == 0, r.output
    with Store(tmp_path / "state.db") as s:
        assert s.cordons()["gpu-01"]["reason"] == "fan failure"
    r = run(tmp_path, "uncordon", "gpu-01", "-i", str(p))
    assert r.exit_code == 0
    with Store(tmp_path / "state.db") as s:
        assert s.cordons() == {}


def test_cordon_without_inventory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CLUSTERCTL_INVENTORY", raising=False)
    r = run(tmp_path, "cordon", "gpu-01", "--reason", "x")  # no -i, no state: nothing to check against
    (line,) = error_lines(r)
    assert r.exit_code == 2 and "no inventory given" in line and "discover" in line
    assert not (tmp_path / "state.db").exists()
    Store(tmp_path / "state.db").close()  # a state with no inventory recorded in it
    r = run(tmp_path, "cordon", "gpu-01", "--reason", "x")
    (line,) = error_lines(r)
    assert r.exit_code == 2 and "no inventory given" in line and "discover" in line
    p = inv(tmp_path, "nodes:\n  - {name: gpu-01, host: h}\n")
    monkeypatch.setenv("CLUSTERCTL_INVENTORY", str(p))
    assert run(tmp_path, "cordon", "gpu-01", "--reason", "x").exit_code == 0
    r = run(tmp_path, "cordon", "gpu-02", "--reason", "x")
    assert r.exit_code == 2 and "no node named 'gpu-02'" in r.output
    monkeypatch.delenv("CLUSTERCTL_INVENTORY")
    with Store(tmp_path / "state.db") as s:
        s.save_discovery([], inventory=tmp_path / "gone.yaml")
    for args in (["cordon", "gpu-01", "--reason", "y"], ["uncordon", "gpu-07"]):  # these need the inventory
        r = run(tmp_path, *args)
        (line,) = error_lines(r)
        assert r.exit_code == 2 and "gone.yaml" in line and "is gone" in line
    monkeypatch.setenv("CLUSTERCTL_INVENTORY", str(tmp_path / "gone-too.yaml"))
    r = run(tmp_path, "uncordon", "gpu-01")  # lifting a cordon never does, even with the inventory gone
    assert r.exit_code == 0, r.output
    monkeypatch.delenv("CLUSTERCTL_INVENTORY")
    with Store(tmp_path / "state.db") as s:
        assert s.cordons() == {}
        s.save_discovery([], inventory=p)
        assert s.inventory() == p
    assert run(tmp_path, "cordon", "gpu-01", "--reason", "z").exit_code == 0
    assert run(tmp_path, "uncordon", "gpu-01").exit_code == 0
    with Store(tmp_path / "state.db") as s:
        assert s.cordons() == {}


def test_cordon_needs_reason(tmp_path: Path) -> None:
    p = inv(tmp_path, "nodes:\n  - {name: gpu-01, host: h}\n")
    db = tmp_path / "state.db"
    r = run(tmp_path, "cordon", "gpu-01", "-i", str(p), "--reason", "  ")
    assert r.exit_code == 2
    (line,) = error_lines(r)
    assert "--reason" in line and "empty" in line, line
    assert not db.exists()  # refused before anything was written: not even a new state
    r = run(tmp_path, "cordon", "gpu-01", "-i", str(p))
    assert r.exit_code == 2 and "Missing option '--reason'" in r.output, r.output
    assert not db.exists()
    with Store(db) as s:  # with a state there, a refused cordon leaves it as it was
        s.save_discovery([], inventory=p)
        v, events = s.version(), s.events()
    for reason in (["--reason", "\t "], []):
        r = run(tmp_path, "cordon", "gpu-01", "-i", str(p), *reason)
        assert r.exit_code == 2, r.output
        with Store(db) as s:
            assert s.cordons() == {} and s.version() == v and s.events() == events


def test_corrupt_state_file(tmp_path: Path) -> None:
    p = inv(tmp_path, "nodes:\n  - {name: gpu-01, host: h}\n")
    (tmp_path / "state.db").write_bytes(b"this is not sqlite" * 100)
    r = run(tmp_path, "cordon", "gpu-01", "-i", str(p), "--reason", "x")
    assert r.exit_code == 2
    (line,) = error_lines(r)
    assert "state.db" in line and "not a usable state database" in line


@pytest.mark.parametrize(
    ("setup", "identity", "needle"),
    [
        (lambda d: (d / "keydir").mkdir(), "keydir", "identity file is not a file"),
        (lambda d: write_key(d / "enc", passphrase="secret"), "enc", "passphrase-protected"),
        (lambda d: (d / "junk").write_text("not a key"), "junk", "unusable"),
    ],
    ids=["directory", "encrypted", "junk"],
)
def test_local_ssh_mistakes_are_config_errors_and_save_nothing(tmp_path: Path, setup, identity, needle) -> None:
    # A local mistake is not "every node unreachable": exit 2, one line, the state untouched.
    setup(tmp_path)
    (tmp_path / "kh").write_text("")
    body = f"defaults: {{identity_file: {identity}, known_hosts: kh}}\nnodes:\n  - {{name: a, host: 198.18.0.77}}\n"
    r = run(tmp_path, "discover", "-i", str(inv(tmp_path, body)))
    assert r.exit_code == 2
    (line,) = error_lines(r)
    assert needle in line and "inventory.yaml: line 1: defaults.identity_file: " in line
    assert not (tmp_path / "state.db").exists()


def test_missing_ssh_config_is_a_config_error(tmp_path: Path) -> None:
    write_key(tmp_path / "id")
    (tmp_path / "kh").write_text("")
    body = "ssh_config: nosuch\ndefaults: {identity_file: id, known_hosts: kh}\nnodes:\n  - {name: a, host: h}\n"
    r = run(tmp_path, "discover", "-i", str(inv(tmp_path, body)))
    assert r.exit_code == 2 and "ssh_config: not a readable file" in r.output


def test_non_utf8_and_empty_inventories_are_one_line_errors(tmp_path: Path) -> None:
    p = tmp_path / "inventory.yaml"
    p.write_bytes(b"\xff\xfe nodes")
    r = run(tmp_path, "discover", "-i", str(p))
    assert r.exit_code == 2 and "not UTF-8" in r.output and "Traceback" not in r.output
    r = run(tmp_path, "discover", "-i", str(inv(tmp_path, "defaults: {user: root}\n")))
    assert r.exit_code == 2 and "lists no nodes" in r.output


def test_timeout_must_be_positive(tmp_path: Path) -> None:
    r = run(tmp_path, "discover", "-i", str(inv(tmp_path, "nodes:\n  - {name: a, host: h}\n")), "--timeout", "-1")
    assert r.exit_code == 2 and not (tmp_path / "state.db").exists()


def test_several_validation_errors_are_all_named(tmp_path: Path) -> None:
    body = "nodes:\n  - {name: a, host: h, prot: 22, usr: x}\n"
    r = run(tmp_path, "discover", "-i", str(inv(tmp_path, body)))
    assert r.exit_code == 2
    (line,) = error_lines(r)
    assert "nodes.0.prot: unknown key" in line and "nodes.0.usr: unknown key" in line


@pytest.mark.slow
def test_global_options_may_follow_the_command(tmp_path: Path) -> None:
    from cluster_cli.cli.main import hoist_global_options as hoist

    assert hoist(["discover", "-i", "inv.yaml", "--state", "s.db", "-v"]) == [
        "--state", "s.db", "-v", "discover", "-i", "inv.yaml",
    ]  # fmt: skip
    # An option's value is never taken for a global option; nothing after -- moves.
    assert hoist(["cordon", "n1", "--reason", "-v"]) == ["cordon", "n1", "--reason", "-v"]
    assert hoist(["place", "--state=x", "--", "--state", "y"]) == ["--state=x", "place", "--", "--state", "y"]
    # End to end through the console entry point: the state goes where --state says.
    p = inv(tmp_path, "nodes:\n  - {name: gpu-01, host: h}\n")
    state = tmp_path / "elsewhere.db"
    Store(state).close()
    r = subprocess.run(
        [sys.executable, "-m", "cluster_cli", "cordon", "gpu-01", "-i", str(p), "--reason", "rma", "--state", str(state)],
        capture_output=True, text=True, cwd=tmp_path, timeout=60,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    with Store(state) as s:
        assert s.cordons()["gpu-01"]["reason"] == "rma"
    assert not (tmp_path / ".clusterctl").exists()


def test_text_from_nodes_and_files_is_printed_literally(capsys) -> None:
    from cluster_cli.cli import ui
    from cluster_cli.cli.discover import render
    from cluster_cli.facts import Gpu, NodeFacts

    lost = Gpu(index=5, uuid="", product="unknown", gpu_class="unknown", lost=True,
               problems=("lost: Unable to determine the device handle for GPU 0000:AB:00.0: [bold]x[/]",))  # fmt: skip
    with ui.out.capture() as cap:
        render([NodeFacts(name="g2", gpus=(lost,), cordoned=True, cordon_reason="rack [red]B[/] :fire:")])
    text = cap.get()
    assert "GPU 0000:AB:00.0: [bold]x[/]" in text  # no emoji for ":AB:", no markup from the node
    assert "cordoned: rack [red]B[/] :fire:" in text
    with ui.err.capture() as cap:
        ui.warn("file [x].yaml: :ab:")
    assert "warning: file [x].yaml: :ab:" in cap.get()


def test_a_cordon_on_a_node_since_removed_from_the_inventory_can_be_lifted(tmp_path: Path) -> None:
    p = inv(tmp_path, "nodes:\n  - {name: gpu-01, host: h}\n  - {name: gpu-02, host: g}\n")
    Store(tmp_path / "state.db").close()
    assert run(tmp_path, "cordon", "gpu-02", "-i", str(p), "--reason", "RMA").exit_code == 0
    p = inv(tmp_path, "nodes:\n  - {name: gpu-01, host: h}\n")  # gpu-02 went back to the vendor
    r = run(tmp_path, "uncordon", "gpu-02", "-i", str(p))
    assert r.exit_code == 0, r.output
    with Store(tmp_path / "state.db") as s:
        assert s.cordons() == {}
    r = run(tmp_path, "uncordon", "gpu-02", "-i", str(p))  # neither listed nor cordoned now
    assert r.exit_code == 2 and "no node named 'gpu-02'" in r.output
    other = tmp_path / "fresh"
    other.mkdir()
    r = run(other, "uncordon", "zz", "-i", str(p))
    assert r.exit_code == 2 and not (other / "state.db").exists()  # nothing created on an error


@pytest.mark.parametrize(
    ("files", "kh", "needle"),
    [
        ({"kh": "just-one-word\n"}, "kh", "known_hosts"),
        ({"kh": "", "cfg": "Host 198.18.0.77\n  Port notanumber\n"}, "kh", "ssh_config (node a, host 198.18.0.77): "),
        ({"state.known_hosts/x": ""}, "accept-new", "pin file is not a regular file"),
        ({"state.known_hosts": "lonely\n"}, "accept-new", "pin file is unreadable"),
    ],
)
def test_local_ssh_file_mistakes_stop_before_any_node_is_contacted(
    tmp_path: Path, files: dict[str, str], kh: str, needle: str
) -> None:
    write_key(tmp_path / "id")
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    cfg = "ssh_config: cfg\n" if "cfg" in files else ""
    body = f"{cfg}defaults: {{identity_file: id, known_hosts: {kh}}}\nnodes:\n  - {{name: a, host: 198.18.0.77}}\n"
    r = run(tmp_path, "discover", "-i", str(inv(tmp_path, body)), "--timeout", "1")
    assert r.exit_code == 2, r.output
    (line,) = error_lines(r)
    assert needle in line
    assert not (tmp_path / "state.db").exists()  # nothing saved, no node marked unreachable


def test_a_state_named_like_a_pin_file_never_shares_it() -> None:
    from cluster_cli.ssh.preflight import pinned_hosts_path

    assert pinned_hosts_path(Path("x/state.db")) == Path("x/state.known_hosts")
    assert pinned_hosts_path(Path("x/st.known_hosts")) == Path("x/st.known_hosts.pins")


def test_ssh_config_checks_name_ssh_errors_and_skip_match_exec(tmp_path: Path) -> None:
    write_key(tmp_path / "id")
    (tmp_path / "kh").write_text("")
    body = "ssh_config: cfg\ndefaults: {identity_file: id, known_hosts: kh}\nnodes:\n  - {name: a, host: gpu1}\n"
    (tmp_path / "cfg").write_text("Host gpu*\n  HostName %u.example\n")
    r = run(tmp_path, "discover", "-i", str(inv(tmp_path, body)), "--timeout", "1")
    assert r.exit_code == 2 and "ssh_config (node a, host gpu1): " in r.output and "Traceback" not in r.output, r.output
    from cluster_cli.config.inventory import load_inventory
    from cluster_cli.ssh.preflight import check_ssh_files

    marker = tmp_path / "ran"
    (tmp_path / "cfg").write_text(f'Match exec "touch {marker}"\n  Port 2222\n')
    p = inv(tmp_path, body)
    check_ssh_files(load_inventory(p), p)
    assert not marker.exists()  # ssh -G runs it when a node connects; the up-front check must not
    (tmp_path / "cfg").write_text(f"Match host gpu1\n  Port 2222\nHost other\n  ProxyCommand touch {marker}\n")
    check_ssh_files(load_inventory(p), p)  # a valid config passes


def test_cordon_says_when_it_made_a_new_state_and_uncordon_makes_none(tmp_path: Path) -> None:
    """A typo in --state must show: cordon on a missing state makes one (a cordon may come
    before the first discover) and says so; uncordon has nothing to lift there, and says so."""
    p = inv(tmp_path, "nodes:\n  - {name: h1, host: h}\n")
    state = tmp_path / "nonexist" / "x" / "state.db"
    r = runner.invoke(app, ["--state", str(state), "uncordon", "h1", "-i", str(p)])
    assert r.exit_code == 0 and " ".join(r.output.split()) == f"h1 was not cordoned (no state at {state})", r.output
    r = runner.invoke(app, ["--state", str(state), "uncordon", "nope", "-i", str(p)])
    assert r.exit_code == 2 and "no node named 'nope'" in r.output
    assert not (tmp_path / "nonexist").exists()
    r = runner.invoke(app, ["--state", str(state), "cordon", "h1", "-r", "x", "-i", str(p)])
    assert r.exit_code == 0, r.output
    assert f"warning: {state}: no state there yet: created a new one" in " ".join(r.output.split())
    with Store(state) as s:
        assert s.cordons()["h1"]["reason"] == "x"
    r = runner.invoke(app, ["--state", str(state), "cordon", "h1", "-r", "y", "-i", str(p)])
    assert r.exit_code == 0 and "created a new one" not in r.output  # only the first time


@pytest.mark.slow
def test_discover_makes_the_state_folder_it_is_given(tmp_path: Path) -> None:
    write_key(tmp_path / "id")
    (tmp_path / "kh").write_text("")
    p = inv(tmp_path, "defaults: {identity_file: id, known_hosts: kh}\nnodes:\n  - {name: a, host: 198.18.0.77}\n")
    state = tmp_path / "runs" / "x" / "state.db"
    r = runner.invoke(app, ["--state", str(state), "discover", "-i", str(p), "--timeout", "1"])
    assert r.exit_code == 1, r.output  # the node does not answer; its facts are saved as unreachable
    with Store(state) as s:
        assert [n.name for n in s.nodes()] == ["a"]


def test_cordoning_a_cordoned_node_says_what_it_replaced(tmp_path: Path) -> None:
    p = inv(tmp_path, "nodes:\n  - {name: h1, host: h}\n")
    Store(tmp_path / "state.db").close()
    r = run(tmp_path, "cordon", "h1", "-i", str(p), "-r", "old reason")
    assert r.exit_code == 0 and r.output.strip() == "h1 cordoned: old reason"
    with Store(tmp_path / "state.db") as s:
        since = s.cordons()["h1"]["created_at"]
    r = run(tmp_path, "cordon", "h1", "-i", str(p), "-r", "new")
    assert r.exit_code == 0, r.output
    (line,) = error_lines(r)
    assert re.fullmatch(r'h1 was already cordoned \(since \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC: "old reason"\); '
                        r'reason now "new"', line), line  # fmt: skip
    with Store(tmp_path / "state.db") as s:
        assert s.cordons()["h1"] == {"reason": "new", "created_at": since}  # still cordoned, since then


def test_help_shows_no_value_for_flags_and_a_name_for_repeatable_options() -> None:
    for args in ([], ["discover"], ["place"], ["cordon"], ["uncordon"]):
        r = runner.invoke(app, [*args, "--help"], env={"COLUMNS": "200"})
        assert r.exit_code == 0 and "--help" in r.output
        assert "<bool>" not in r.output and "list[" not in r.output, r.output
    r = runner.invoke(app, ["discover", "--help"], env={"COLUMNS": "200"})
    assert re.search(r"--node\s+-n\s+NODE\s+Probe only this node", r.output), r.output
    r = runner.invoke(app, ["place", "--help"], env={"COLUMNS": "200"})
    assert re.search(r"--dry-run\s+Compute and print the plan", r.output), r.output


@pytest.mark.slow
def test_discover_warns_of_one_machine_under_two_names(tmp_path: Path) -> None:
    write_key(tmp_path / "id")
    (tmp_path / "kh").write_text("")
    body = (
        "defaults: {identity_file: id, known_hosts: kh}\n"
        "nodes:\n  - {name: a, host: 198.18.0.77}\n  - {name: b, host: 198.18.0.77}\n"
    )
    r = runner.invoke(
        app, ["--state", str(tmp_path / "s.db"), "discover", "-i", str(inv(tmp_path, body)), "--timeout", "1"]
    )
    assert r.exit_code == 1  # the nodes do not answer; the inventory itself is fine
    assert "inventory.yaml: line 4 (b): nodes.1.host: 198.18.0.77:22 is also node a's" in " ".join(r.output.split())


@pytest.mark.slow
def test_ssh_config_loops_and_the_implicit_user_config_are_configuration_errors(tmp_path: Path) -> None:
    """Exit 2 before any node is contacted, one line, no state: an Include loop, and a bad line in ~/.ssh/config, which SSH reads when
    the inventory names no ssh_config (it would otherwise fail every node, exit 1)."""
    write_key(tmp_path / "id")
    (tmp_path / "kh").write_text("")
    (tmp_path / "cfg").write_text(f"Include {tmp_path / 'cfg'}\nHost *\n  User root\n")
    body = "defaults: {identity_file: id, known_hosts: kh}\nnodes:\n  - {name: a, host: 198.18.0.250}\n"
    r = run(tmp_path, "discover", "-i", str(inv(tmp_path, "ssh_config: cfg\n" + body)), "--timeout", "1")
    assert r.exit_code == 2, r.output
    (line,) = error_lines(r)
    assert "ssh_config (node a, host 198.18.0.250): Include loop" in line and "Traceback" not in r.output
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "config").write_text("Host *\n  Port notanumber\n")
    r = runner.invoke(
        app, ["--state", str(tmp_path / "state.db"), "discover", "-i", str(inv(tmp_path, body)), "--timeout", "1"],
        env={"HOME": str(home)},
    )  # fmt: skip
    assert r.exit_code == 2, r.output
    (line,) = error_lines(r)
    assert line.startswith(f"error: {home}/.ssh/config (read since ") and "Bad port 'notanumber'" in line, line
    assert not (tmp_path / "state.db").exists()


def test_ssh_config_dev_null_means_none(tmp_path: Path) -> None:
    """`ssh -F /dev/null`: the usual way to read no ssh_config at all is accepted."""
    from cluster_cli.config.inventory import load_inventory
    from cluster_cli.ssh.preflight import check_ssh_files

    write_key(tmp_path / "id")
    (tmp_path / "kh").write_text("")
    p = inv(
        tmp_path,
        "ssh_config: /dev/null\ndefaults: {identity_file: id, known_hosts: kh}\nnodes:\n  - {name: a, host: h}\n",
    )
    check_ssh_files(load_inventory(p), p)
    (tmp_path / "d").mkdir()
    p = inv(tmp_path, p.read_text().replace("/dev/null", str(tmp_path / "d")))
    with pytest.raises(Exception, match="not a readable file"):
        check_ssh_files(load_inventory(p), p)


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(__import__("os"), "geteuid") or __import__("os").geteuid() != 0, reason="needs root")
def test_a_read_only_state_file_is_refused_before_anything_runs(tmp_path: Path) -> None:
    """Found when the state is opened (before discover probes the fleet), not when it saves."""
    import os
    import shutil
    import tempfile

    # The child imports clusterctl as root, then becomes uid/gid 65534 for good before it opens
    # the state: the checkout and its virtualenv may be in a folder only root can enter (a
    # private clone), which another user could not import from.
    code = (
        "import os, sys; from cluster_cli.errors import ClusterctlError; from cluster_cli.state.store import Store\n"
        "os.setgroups([]); os.setresgid(65534, 65534, 65534); os.setresuid(65534, 65534, 65534)\n"
        "assert os.getresuid() == (65534, 65534, 65534) and os.getgroups() == []\n"
        "try: Store(sys.argv[1])\nexcept ClusterctlError as e: sys.exit(f'error: {e}')"
    )

    def as_nobody(state: Path) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
        return subprocess.run(
            [sys.executable, "-c", code, str(state)], capture_output=True, text=True, env=env, cwd="/", timeout=60
        )

    d = Path(tempfile.mkdtemp())  # not under pytest's folder, which only root may enter
    try:
        d.chmod(0o777)
        state = d / "state.db"
        Store(state).close()
        state.chmod(0o444)
        r = as_nobody(state)
        assert (
            r.returncode == 1 and r.stderr == f"error: {state}: the state file is read-only (check its permissions)\n"
        ), r.stderr
        r = as_nobody(tmp_path / "state.db")  # a folder on the way it may not enter: one line too
        assert r.returncode == 1 and r.stderr.startswith(f"error: {tmp_path / 'state.db'}: cannot reach the state: ")
        assert len(r.stderr.splitlines()) == 1, r.stderr
    finally:
        shutil.rmtree(d)


def test_a_private_key_open_to_other_users_is_warned_about(tmp_path: Path) -> None:
    key = write_key(tmp_path / "id")
    (tmp_path / "kh").write_text("")
    body = "defaults: {identity_file: id, known_hosts: kh}\nnodes:\n  - {name: a, host: 127.0.0.1, port: 1}\n"
    warning = f"warning: identity file {key} is open to other users (mode 0644): chmod 600 it"
    key.chmod(0o600)
    r = run(tmp_path, "discover", "-i", str(inv(tmp_path, body)), "--timeout", "2")
    assert r.exit_code == 1 and warning not in r.output  # port 1 refuses: the node is unreachable
    key.chmod(0o644)
    r = run(tmp_path, "discover", "-i", str(inv(tmp_path, body)), "--timeout", "2")
    assert r.exit_code == 1 and warning in r.output, r.output


def test_a_match_exec_in_an_included_file_is_not_run_up_front(tmp_path: Path) -> None:
    """The up-front check of ssh_config never runs `Match exec` commands (ssh -G runs them
    when a node connects), not even from a file the config includes."""
    from cluster_cli.config.inventory import load_inventory
    from cluster_cli.ssh.preflight import check_ssh_files

    write_key(tmp_path / "id")
    (tmp_path / "kh").write_text("")
    marker = tmp_path / "ran"
    (tmp_path / "conf.d").mkdir()
    (tmp_path / "conf.d" / "50-exec").write_text(f'Match exec "touch {marker}"\n  Port 2222\n')
    (tmp_path / "cfg").write_text(f"Include {tmp_path / 'conf.d'}/*\nHost *\n  User root\n")
    nodes = "".join(f"  - {{name: n{i}, host: h{i}}}\n" for i in range(3))
    p = inv(tmp_path, f"ssh_config: cfg\ndefaults: {{identity_file: id, known_hosts: kh}}\nnodes:\n{nodes}")
    check_ssh_files(load_inventory(p), p)
    assert not marker.exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["discover", "--bogus"], "clusterctl discover: No such option: --bogus"),
        (["place", "-o", "xml"], "clusterctl place: Invalid value for '--output'"),
        (
            ["serve-router", "--config", "r.yaml", "--port", "abc"],
            "clusterctl serve-router: Invalid value for '--port'",
        ),
        (["cordon"], "clusterctl cordon: Missing argument"),
        (["no-such-command"], "No such command 'no-such-command'"),
    ],
)
def test_usage_errors_are_one_line(argv: list[str], needle: str) -> None:
    """An unknown option, a bad value or a missing argument reads like every other error:
    one line naming the command and what is wrong, exit 2 (not a usage block and a panel)."""
    r = subprocess.run(
        [sys.executable, "-m", "cluster_cli", *argv], capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"}
    )
    assert r.returncode == 2, r.stderr
    assert r.stdout == ""
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("error: ") and needle in lines[0], lines[0]
    assert "-h)" in lines[0]  # where to look next


def test_ctrl_c_while_the_cli_is_still_loading_exits_130_without_a_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    from cluster_cli.cli import entry

    real_import = builtins.__import__

    def interrupted(name: str, *args, **kwargs):  # type: ignore[no-untyped-def]
        if name == "cluster_cli.cli.main":
            raise KeyboardInterrupt  # Ctrl-C during the CLI's imports
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", interrupted)
    with pytest.raises(SystemExit) as e:
        entry.main()
    assert e.value.code == 130


def test_importing_the_package_loads_nothing_else() -> None:
    """The entry point imports ``cluster_cli`` first: a Ctrl-C can only be caught once that is
    done, so it must be quick (its names load on first use)."""
    code = "import sys, cluster_cli; print(sorted(m for m in sys.modules if m.startswith('cluster_cli')))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "['cluster_cli']"
    code = "import cluster_cli; print(cluster_cli.NodeFacts.__name__, cluster_cli.ExitCode.__name__)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout == "NodeFacts ExitCode\n"


def test_no_inventory_and_no_state_says_there_is_no_state(tmp_path: Path) -> None:
    r = runner.invoke(app, ["--state", str(tmp_path / "none.db"), "place", "--dry-run", "-c", str(tmp_path / "c.yaml")])
    assert r.exit_code == 2
    assert f"and no state at {tmp_path / 'none.db'} to take it from" in " ".join(r.stderr.split())


def test_a_new_state_that_cannot_be_made_is_found_before_probing(tmp_path: Path) -> None:
    """A first discover makes its state only to save the facts, but finds now, not after
    probing the fleet, that it could not: here its folder is on a read-only mount."""
    write_key(tmp_path / "id")
    (tmp_path / "kh").write_text("")
    ro = tmp_path / "ro"
    ro.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)], capture_output=True).returncode:
        pytest.skip("cannot mount a read-only tmpfs here")
    try:
        body = "defaults: {identity_file: id, known_hosts: kh}\nnodes:\n  - {name: a, host: 198.18.0.77}\n"
        state = ro / "sub" / "s.db"
        r = runner.invoke(app, ["--state", str(state), "discover", "-i", str(inv(tmp_path, body))])
        assert r.exit_code == 2
        (line,) = error_lines(r)
        assert f"{state}: cannot create the state: folder {ro} is not writable" in line
    finally:
        subprocess.run(["umount", str(ro)], check=False)


def test_a_port_that_is_not_an_ssh_server_is_named_as_such(tmp_path: Path) -> None:
    """A web server or proxy on the node's port answers and hangs up. It used to read
    "connection lost: Connection lost", which points nowhere."""
    import json
    import socket
    import threading

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    port = srv.getsockname()[1]

    def answer() -> None:
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            with c:
                c.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")

    threading.Thread(target=answer, daemon=True).start()
    try:
        write_key(tmp_path / "id")
        (tmp_path / "kh").write_text("")
        body = f"defaults: {{identity_file: id, known_hosts: kh}}\nnodes:\n  - {{name: web, host: 127.0.0.1, port: {port}}}\n"
        r = run(tmp_path, "discover", "-i", str(inv(tmp_path, body)), "-o", "json")
    finally:
        srv.close()
    assert r.exit_code == 1, r.output
    (node,) = json.loads(r.stdout)["nodes"]
    assert node["error"] == (
        f"the other end closed the connection during the SSH handshake (127.0.0.1:{port}): "
        "is an SSH server listening there, and does it accept connections from this machine?"
    )


# --------------------------------------------------------------------------- cordon reasons, cordons before the first discover, state paths


@pytest.mark.parametrize(
    "reason", ["bad\nfan", "bad\tfan", "bad \x1b[31mfan", "x" * 30_000], ids=["newline", "tab", "esc", "30000-chars"]
)
def test_cordon_refuses_control_characters_and_long_reasons(tmp_path: Path, reason: str) -> None:
    inv, _, _ = write_inputs(tmp_path, [dgx("h1")], catalog="models: []\n")
    r = run(tmp_path, "cordon", "h1", "-i", str(inv), "--reason", reason)
    assert r.exit_code == 2, r.output
    err = r.stderr.strip()
    assert "\n" not in err and "--reason" in err and "\x1b" not in err and len(err) < 300, err
    assert not (tmp_path / "state.db").exists()  # nothing written


def test_rich_markup_in_a_reason_is_printed_literally(tmp_path: Path) -> None:
    reason = "[red]PSU[/red] [bold]x"
    inv, cat, facts = write_inputs(
        tmp_path,
        [dgx("h1")],
        catalog="models:\n  - {name: m, profiles: [{name: p, engine: vllm, gpu_class: H100, model: /m}]}\n",
    )
    r = run(tmp_path, "cordon", "h1", "-i", str(inv), "--reason", reason)
    assert r.exit_code == 0 and f"h1 cordoned: {reason}" in r.stderr, r.output
    r = run(tmp_path, "cordon", "h1", "-i", str(inv), "--reason", reason + "!")
    assert r.exit_code == 0 and json.dumps(reason) in r.stderr, r.output
    r = run(tmp_path, "-v", "place", "--dry-run", "-i", str(inv), "-c", str(cat), "--facts", str(facts))
    assert r.exit_code == 3, r.output
    assert f"h1: cordoned ({reason}!)" in r.stdout
    assert f"h1: rejected: cordoned ({reason}!)" in r.stderr


def test_noop_uncordon_from_the_cli_writes_nothing(tmp_path: Path) -> None:
    inv, _, _ = write_inputs(tmp_path, [dgx("h1")], catalog="models: []\n")
    assert run(tmp_path, "cordon", "h1", "-i", str(inv), "--reason", "fan").exit_code == 0
    assert run(tmp_path, "uncordon", "h1", "-i", str(inv)).exit_code == 0
    with Store(tmp_path / "state.db", readonly=True) as s:
        v = s.version()
    for args in (["uncordon", "h1"], ["uncordon", "h1"]):
        r = run(tmp_path, *args, "-i", str(inv))
        assert r.exit_code == 0 and "was not cordoned" in r.stderr, r.output
    assert run(tmp_path, "cordon", "h1", "-i", str(inv), "--reason", "fan").exit_code == 0
    assert run(tmp_path, "cordon", "h1", "-i", str(inv), "--reason", "fan").exit_code == 0
    with Store(tmp_path / "state.db", readonly=True) as s:
        assert s.version() == v + 1


@pytest.fixture
def no_clusterctl_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CLUSTERCTL_INVENTORY", raising=False)
    monkeypatch.delenv("CLUSTERCTL_STATE", raising=False)


def two_node_inventory(tmp_path: Path) -> Path:
    p = tmp_path / "inv.yaml"
    p.write_text("nodes:\n  - {name: h1, host: 198.18.0.250}\n  - {name: h2, host: 198.18.0.251}\n")
    return p


@pytest.mark.usefixtures("no_clusterctl_env")
@pytest.mark.parametrize(
    "command", [["discover"], ["cordon", "h1", "-r", "x"], ["uncordon", "h1"], ["place", "--dry-run"]]
)
def test_a_state_path_that_is_a_folder_or_empty_is_one_line_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: list[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    inv = two_node_inventory(tmp_path)
    (tmp_path / "file.db").write_text("")
    extra = ["-i", str(inv)] + (["-c", str(inv)] if command[0] == "place" else [])
    cases = {
        ".": "error: .: is a folder, not a state database file",
        str(tmp_path): f"error: {tmp_path}: is a folder, not a state database file",
        "": "error: empty state path (--state / CLUSTERCTL_STATE)",
        "file.db/state.db": "error: file.db/state.db: file.db is a file, not a folder",
    }
    for given, want in cases.items():
        r = runner.invoke(app, ["--state", given, *command, *extra])
        lines = [ln for ln in r.output.splitlines() if ln.strip()]
        assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith(want), (given, r.output)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.db", "inv.yaml"]  # nothing written


@pytest.mark.usefixtures("no_clusterctl_env")
def test_uncordon_with_no_state_and_no_inventory_says_so_and_creates_nothing(tmp_path: Path) -> None:
    state = tmp_path / "none" / "state.db"
    r = runner.invoke(app, ["--state", str(state), "uncordon", "gpu-03"])
    assert r.exit_code == 0, r.output
    assert r.output.strip() == f"gpu-03 was not cordoned (no state at {state})"
    assert not state.parent.exists()


@pytest.mark.usefixtures("no_clusterctl_env")
def test_a_cordon_before_the_first_discover_records_its_inventory(tmp_path: Path) -> None:
    """cordon -i on a new state records the inventory, so later commands need no -i, and
    uncordoning twice is a no-op the second time (as the README says), not an error."""
    inv = two_node_inventory(tmp_path)
    state = tmp_path / "state.db"

    def cli(*args: str):
        return runner.invoke(app, ["--state", str(state), *args])

    assert cli("cordon", "h2", "-i", str(inv), "-r", "rack move").exit_code == 0
    with Store(state, readonly=True) as s:
        assert s.inventory() == inv.resolve()
    assert cli("cordon", "h1", "-r", "psu").exit_code == 0
    assert cli("uncordon", "h2").output.strip() == "h2 uncordoned"
    r = cli("uncordon", "h2")
    assert r.exit_code == 0 and r.output.strip() == "h2 was not cordoned"
    r = cli("uncordon", "h9")  # a typo is still caught, against the recorded inventory
    assert r.exit_code == 2 and "no node named 'h9'" in r.output
    # A later discover's inventory is not overridden by a cordon with another -i.
    other = tmp_path / "other.yaml"
    other.write_text(inv.read_text())
    assert cli("cordon", "h1", "-i", str(other), "-r", "psu").exit_code == 0
    with Store(state, readonly=True) as s:
        assert s.inventory() == inv.resolve()


@pytest.mark.usefixtures("no_clusterctl_env")
def test_a_missing_option_value_names_the_subcommand(tmp_path: Path) -> None:
    r = runner.invoke(app, ["--state", str(tmp_path / "s.db"), "place", "-c", "cat.yaml", "--dry-run", "--facts"])
    assert r.exit_code == 2
    assert r.output.strip() == (
        "error: clusterctl place: Option '--facts' requires an argument. (see: clusterctl place -h)"
    )
    r = runner.invoke(app, ["--state"])
    assert r.exit_code == 2 and "(see: clusterctl -h)" in r.output


@pytest.mark.usefixtures("no_clusterctl_env")
def test_uncordon_in_a_state_with_no_inventory_recorded_checks_nothing(tmp_path: Path) -> None:
    state = tmp_path / "state.db"
    Store(state).close()  # a state no discover or cordon -i has recorded an inventory in
    r = runner.invoke(app, ["--state", str(state), "uncordon", "h1"])
    assert r.exit_code == 0 and r.output.strip() == "h1 was not cordoned"


@pytest.mark.usefixtures("no_clusterctl_env")
def test_a_cordon_with_an_inventory_replaces_a_recorded_one_that_is_gone(tmp_path: Path) -> None:
    inv = two_node_inventory(tmp_path)
    moved = tmp_path / "moved.yaml"
    moved.write_text(inv.read_text())
    state = tmp_path / "state.db"

    def cli(*args: str):
        return runner.invoke(app, ["--state", str(state), *args])

    assert cli("cordon", "h1", "-r", "x", "-i", str(moved)).exit_code == 0
    moved.unlink()
    r = cli("cordon", "h2", "-r", "y")
    assert r.exit_code == 2 and "moved.yaml" in r.output and "is gone; pass -i" in r.output
    assert cli("cordon", "h2", "-r", "y", "-i", str(inv)).exit_code == 0
    with Store(state, readonly=True) as s:
        assert s.inventory() == inv.resolve()
    assert cli("uncordon", "h2").exit_code == 0 and cli("cordon", "h2", "-r", "z").exit_code == 0
