"""``clusterctl discover`` against real sshd nodes of the testbed."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import asyncssh
import pytest
import yaml
from typer.testing import CliRunner

from cluster_cli.cli.main import app
from cluster_cli.state.store import Store

runner = CliRunner()


def discover(state: Path, inventory: Path, *extra: str) -> tuple[int, dict[str, Any], str]:
    r = runner.invoke(app, ["--state", str(state), "discover", "-i", str(inventory), "-o", "json", *extra])
    out = r.stdout
    doc = json.loads(out) if out.strip().startswith("{") else {}
    return r.exit_code, doc, r.stderr


def discover_bounded(
    state: Path, inventory: Path, *extra: str, timeout: float = 120
) -> tuple[int, dict[str, Any], str]:
    """``discover`` in a child process: a run that hangs is killed and fails the test
    (TimeoutExpired) instead of stalling the suite."""
    r = subprocess.run(
        [sys.executable, "-m", "cluster_cli", "--state", str(state), "discover", "-i", str(inventory), "-o", "json",
         *extra],
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    doc = json.loads(r.stdout) if r.stdout.strip().startswith("{") else {}
    return r.returncode, doc, r.stderr


def by_name(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {n["name"]: n for n in doc["nodes"]}


def derived_inventory(src: Path, name: str, **defaults: Any) -> Path:
    """A copy of a testbed inventory, in the same folder, with some defaults changed."""
    data = yaml.safe_load(src.read_text())
    data["defaults"].update(defaults)
    p = src.parent / name
    p.write_text(yaml.safe_dump(data))
    return p


def test_discover_healthy_cluster(testbed, tmp_path: Path) -> None:
    code, doc, err = discover(tmp_path / "s.db", testbed.inventory_path)
    assert code == 0, err
    nodes = by_name(doc)
    assert set(nodes) == {"gpu-01", "gpu-02", "gpu-03", "gpu-04", "cpu-01"}
    g1 = nodes["gpu-01"]
    for key in ("name", "reachable", "error", "cordoned", "cordon_reason", "cpus", "memory_mib", "gpus",
                "nvlink_domains", "hcas"):  # fmt: skip
        assert key in g1
    assert g1["reachable"] and g1["error"] is None
    assert len(g1["gpus"]) == 8 and {g["class"] for g in g1["gpus"]} == {"H200"}
    assert all(g["free"] and g["healthy"] and g["problems"] == [] for g in g1["gpus"])
    assert g1["gpus"][0]["product"] == "NVIDIA H200" and g1["gpus"][0]["memory_total_mib"] == 143771
    assert g1["nvlink_domains"] == [[0, 1, 2, 3, 4, 5, 6, 7]]
    ib = [h for h in g1["hcas"] if h["link_layer"] == "InfiniBand"]
    assert len(ib) == 8 and all(h["state"] == "Active" and h["fabric"] == "ib-a" and h["rate_gbps"] == 400 for h in ib)
    g3 = nodes["gpu-03"]
    assert {g["class"] for g in g3["gpus"]} == {"H100"}  # alias from gpu_classes
    eth = [h for h in g3["hcas"] if h["link_layer"] == "Ethernet"]
    assert eth and all(h["fabric"] is None for h in eth)  # RoCE ports attach to no IB fabric
    assert nodes["gpu-04"]["nvlink_domains"] == [[0, 1], [2, 3]]
    cpu = nodes["cpu-01"]
    assert cpu["gpus"] == [] and cpu["nvlink_domains"] == [] and cpu["cpus"] and cpu["memory_mib"]
    assert doc["fabric_conflicts"] == []


def test_cordon_survives_rediscovery(testbed, tmp_path: Path) -> None:
    state = tmp_path / "s.db"
    inv = str(testbed.inventory_path)
    # Cordoned before the first discover: the state is created, and discover keeps the cordon.
    assert runner.invoke(app, ["--state", str(state), "cordon", "gpu-02", "-i", inv, "--reason", "PSU"]).exit_code == 0
    for _ in range(2):
        code, doc, _ = discover(state, testbed.inventory_path)
        assert code == 0
        n = by_name(doc)["gpu-02"]
        assert n["cordoned"] is True and n["cordon_reason"] == "PSU"


def test_cordon_without_inventory_uses_the_one_discover_recorded(testbed, tmp_path: Path) -> None:
    state = tmp_path / "s.db"
    code, _, err = discover(state, testbed.inventory_path)
    assert code == 0, err
    with Store(state, readonly=True) as s:
        assert s.inventory() == testbed.inventory_path.resolve()
    r = runner.invoke(app, ["--state", str(state), "cordon", "gpu-02", "--reason", "PSU"])  # the form
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["--state", str(state), "cordon", "gpu-99", "--reason", "x"])
    assert r.exit_code == 2 and "no node named 'gpu-99'" in r.output
    assert str(testbed.inventory_path.resolve()) in r.output  # names the inventory it checked
    code, doc, _ = discover(state, testbed.inventory_path)
    assert code == 0 and by_name(doc)["gpu-02"]["cordoned"] is True
    assert runner.invoke(app, ["--state", str(state), "uncordon", "gpu-02"]).exit_code == 0
    with Store(state, readonly=True) as s:
        assert s.cordons() == {}


def test_fabric_conflicts_follow_the_inventory_of_this_run(testbed_factory, tmp_path: Path) -> None:
    c = testbed_factory("a=hgx-h200x8:fabric=ib-a,b=hgx-h200x8:fabric=ib-a,x=hgx-h200x8:fabric=ib-b")
    doc_inv = yaml.safe_load(c.inventory_path.read_text())
    for n in doc_inv["nodes"]:
        if n["name"] == "x":
            n["fabric"] = "ib-a"  # wrong: x is cabled to ib-b, whose SM it sees
    wrong = c.inventory_path.with_name("wrong.yaml")
    wrong.write_text(yaml.safe_dump(doc_inv))
    state = tmp_path / "s.db"
    code, doc, _ = discover(state, wrong)
    assert code == 0
    assert doc["fabric_conflicts"] and all("x" in line for line in doc["fabric_conflicts"])
    x = by_name(doc)["x"]
    assert any(p.startswith("fabric-conflict") for p in x["problems"])  # on the node, not only in the summary
    assert all(h["fabric"] is None for h in x["hcas"]), x["hcas"]  # off the fabric its SM contradicts
    assert all(h["fabric"] == "ib-a" for h in by_name(doc)["a"]["hcas"] if h["state"] == "Active")
    # The inventory is fixed; only `a` is probed again. x's stored facts were probed under
    # the wrong declaration, but the cross-check uses what the inventory says now.
    code, doc, _ = discover(state, c.inventory_path, "--node", "a")
    assert code == 0 and doc["fabric_conflicts"] == []


def test_subnet_prefixes_are_read_and_checked_against_the_declared_ones(testbed_factory, tmp_path: Path) -> None:
    c = testbed_factory("p=hgx-h200x8:fabric=ib-a:prefix=fec0000000000001,q=hgx-h200x8:fabric=ib-a")
    if c.mode != "netns":
        pytest.skip("the nodes' own /sys/class needs netns mode (root)")
    doc_inv = yaml.safe_load(c.inventory_path.read_text())
    doc_inv["fabrics"]["ib-a"]["subnet_prefix"] = "0xfec0000000000001"
    declared = c.inventory_path.with_name("declared.yaml")
    declared.write_text(yaml.safe_dump(doc_inv))
    code, doc, _ = discover(tmp_path / "s.db", declared)
    assert code == 0
    n = by_name(doc)
    active = {name: [h for h in n[name]["hcas"] if h["state"] == "Active"] for name in ("p", "q")}
    assert {h["subnet_prefix"] for h in active["p"]} == {"fec0:0000:0000:0001"}
    assert {h["subnet_prefix"] for h in active["q"]} == {"fe80:0000:0000:0000"}  # left at the default
    # q's ports are on another subnet than ib-a declares: reported, and q is off ib-a
    assert any("q mlx5_0 has subnet prefix fe80:0000:0000:0000" in x for x in doc["fabric_conflicts"])
    assert all(h["fabric"] is None for h in active["q"]) and all(h["fabric"] == "ib-a" for h in active["p"])
    (conflict,) = [x for x in n["q"]["problems"] if x.startswith("fabric-conflict:")]  # one line, not one per port
    assert conflict.startswith("fabric-conflict: 8 ports (mlx5_0/1, ") and " each has subnet prefix fe80" in conflict


def test_faulty_gpus_are_not_free(testbed_factory, tmp_path: Path) -> None:
    c = testbed_factory(
        "f1=hgx-h200x8:fabric=ib-a:ecc=1:foreign=2:4411:python3 train.py:remap=3:retire=4,"
        "f2=a100-pcie-4x:lost=1,"
        "f3=hgx-h200x8:smi_error=no-driver,"
        "f4=hgx-h200x8:smi_error=driver-mismatch,"
        "f5=hgx-h200x8:garbage"
    )
    code, doc, err = discover(tmp_path / "s.db", c.inventory_path)
    assert code == 0, err  # every node answered, even if their GPUs are sick
    n = by_name(doc)
    gpus = {g["index"]: g for g in n["f1"]["gpus"]}
    assert [i for i, g in gpus.items() if not g["free"]] == [1, 2, 3, 4]
    assert gpus[1]["problems"][0].startswith("ecc") and not gpus[1]["healthy"]
    assert "pid 4411" in gpus[2]["problems"][0] and gpus[2]["healthy"]
    assert gpus[3]["problems"][0].startswith("remap") and gpus[4]["problems"][0].startswith("retired-pages")
    lost = [g for g in n["f2"]["gpus"] if g["lost"]]
    assert len(lost) == 1 and not lost[0]["healthy"] and lost[0]["uuid"] is None  # nvidia-smi gave none
    assert lost[0]["product"] is None and lost[0]["class"] is None  # nor what it is: null, never a made-up class
    assert sum(g["free"] for g in n["f2"]["gpus"]) == 3  # the survivors stay usable
    for name, word in (("f3", "driver"), ("f4", "mismatch"), ("f5", "unreadable")):
        assert n[name]["gpus"] == [] and n[name]["nvlink_domains"] is None
        assert any(p.startswith("nvidia-smi") and word in p.lower() for p in n[name]["problems"]), n[name]["problems"]
        # -o json keeps stdout for scripts; each node problem is also one line on stderr, naming the node
        assert any(line.startswith(f"warning: {name}: nvidia-smi") for line in err.splitlines()), err


def test_an_older_driver_that_refuses_a_field_still_lists_its_gpus(testbed_factory, tmp_path: Path) -> None:
    """nvidia-smi before R450 knows no mig.mode.* or remapped_rows.* and refuses the whole
    query for one of them: discover asks again without them, so the node's GPUs, their ECC
    faults and processes are still known, and MIG and row remapping are unknown (null)."""
    c = testbed_factory("o1=a100-pcie-4x:driver=418.67:ecc=1:foreign=2:4411:python3:remap=3,o2=a100-pcie-4x:remap=3")
    code, doc, err = discover(tmp_path / "s.db", c.inventory_path)
    assert code == 0, err
    n = by_name(doc)
    old = {g["index"]: g for g in n["o1"]["gpus"]}
    assert sorted(old) == [0, 1, 2, 3] and n["o1"]["problems"] == [] and n["o1"]["nvlink_domains"] == [[0, 1], [2, 3]]
    assert [i for i, g in old.items() if g["free"]] == [0, 3]  # its driver cannot say that 3 has a remap pending
    assert old[1]["problems"][0].startswith("ecc") and "pid 4411" in old[2]["problems"][0]
    assert all(g["mig_mode"] is None and g["remapped_rows_pending"] is None for g in old.values())
    assert old[0]["ecc_uncorrected"] == 0 and old[1]["ecc_uncorrected"] > 0  # a field it does know
    new = {g["index"]: g for g in n["o2"]["gpus"]}
    assert not new[3]["free"] and new[3]["remapped_rows_pending"] is True and new[0]["mig_mode"] is False


def test_dead_frozen_partitioned_nodes_never_stall_the_run(testbed_factory, tmp_path: Path) -> None:
    c = testbed_factory("ok=hgx-h200x8:fabric=ib-a,dead=cpu-only,frozen=cpu-only,cut=cpu-only")
    inv = derived_inventory(c.inventory_path, "inv-fast.yaml", connect_timeout_s=2, command_timeout_s=3)
    c.kill("dead")
    c.freeze("frozen")
    c.partition("cut")
    code, doc, err = discover_bounded(tmp_path / "s.db", inv, "--timeout", "4")
    assert code == 1
    n = by_name(doc)
    assert n["ok"]["reachable"] and len(n["ok"]["gpus"]) == 8
    for name in ("dead", "frozen", "cut"):
        assert n[name]["reachable"] is False and n[name]["error"], name
    assert "refused" in n["dead"]["error"]
    # What ended the silent nodes is one of the configured bounds (the 2 s connect timeout,
    # or else the 4 s per-node deadline), never a longer one: it is named in the error.
    bounded = ("connect timed out after 2s", "no answer within 4s")
    assert n["frozen"]["error"] in bounded and n["cut"]["error"] in bounded, (n["frozen"], n["cut"])
    for name in ("dead", "frozen", "cut"):
        assert name in err  # each failing node is named on stderr


def test_unreachable_node_keeps_its_last_facts(testbed_factory, tmp_path: Path) -> None:
    c = testbed_factory("a=a100-pcie-4x,b=cpu-only")
    state = tmp_path / "s.db"
    code, doc, _ = discover(state, c.inventory_path)
    assert code == 0
    seen = by_name(doc)["a"]["probed_at"]
    c.kill("a")
    code, doc, _ = discover(state, c.inventory_path)
    assert code == 1
    a = by_name(doc)["a"]
    assert a["reachable"] is False and len(a["gpus"]) == 4  # last known hardware kept, marked unreachable
    assert not any(g["free"] for g in a["gpus"]) and a["last_seen_at"] == seen  # none free while it is away
    r = runner.invoke(app, ["--state", str(state), "discover", "-i", str(c.inventory_path)], env={"COLUMNS": "200"})
    row = next(line for line in r.stdout.splitlines() if line.split()[:1] == ["a"])
    assert "0/4 A100" in row  # the table agrees


def test_wrong_key_and_unknown_host_key(testbed_factory, tmp_path: Path) -> None:
    c = testbed_factory("n1=cpu-only")
    other = asyncssh.generate_private_key("ssh-ed25519")
    keyfile = c.inventory_path.parent / "other_key"
    other.write_private_key(str(keyfile))
    keyfile.chmod(0o600)
    wrong = derived_inventory(c.inventory_path, "inv-wrongkey.yaml", identity_file="other_key")
    code, doc, _ = discover(tmp_path / "a.db", wrong)
    assert code == 1 and "authentication failed" in by_name(doc)["n1"]["error"]

    empty = c.inventory_path.parent / "empty_known_hosts"
    empty.write_text("")
    unknown = derived_inventory(c.inventory_path, "inv-unknownhost.yaml", known_hosts="empty_known_hosts")
    code, doc, _ = discover(tmp_path / "b.db", unknown)
    error = by_name(doc)["n1"]["error"]
    # Unknown, not "unknown or changed": where it looked, and the two ways out.
    assert code == 1 and error.startswith(f"host key not verifiable in {empty}: no key for "), error
    assert error.endswith(f" >> {empty}) or use known_hosts: accept-new"), error


def test_accept_new_pins_then_refuses_a_changed_key(testbed_factory, tmp_path: Path) -> None:
    c = testbed_factory("n1=cpu-only")
    inv = derived_inventory(c.inventory_path, "inv-tofu.yaml", known_hosts="accept-new")
    state = tmp_path / "st" / "s.db"
    state.parent.mkdir()  # discover creates only the default state folder
    assert discover(state, inv)[0] == 0
    pinned = state.with_suffix(".known_hosts")  # beside the state, named after it
    line = pinned.read_text().strip()
    assert line.startswith("n1 ssh-")  # pinned per node name, whatever ssh_config resolves
    assert discover(state, inv)[0] == 0
    assert pinned.read_text().strip() == line  # pinned once, not appended again
    # The node's key "changes": the pin must win.
    fake = asyncssh.generate_private_key("ssh-ed25519").export_public_key("openssh").decode().strip()
    pinned.write_text(line.split(" ", 1)[0] + " " + fake + "\n")
    code, doc, _ = discover(state, inv)
    n = c.nodes["n1"]
    assert code == 1
    assert by_name(doc)["n1"]["error"] == (  # changed, not "unknown or changed"; where the pin is, and the remedy
        f"host key not verifiable: changed since it was pinned in {pinned} ({n.host}:{n.port}); "
        "if the node was reinstalled, delete its line there (n1 ...) and run again"
    )


def test_a_node_whose_host_key_type_changed_is_refused_by_name(testbed_factory, tmp_path: Path) -> None:
    """A node reinstalled with another type of host key (an RSA key trusted, ed25519 now) has
    none of the types trusted for it: it is refused as a changed key, with the remedy, in a
    known_hosts file, in the pin file, and with only a CA trusted (it has no certificate).
    Before, each was "connection lost": nothing pointed at the key."""
    c = testbed_factory("n1=cpu-only,n2=cpu-only")
    n2 = c.nodes["n2"]
    rsa = asyncssh.generate_private_key("ssh-rsa", key_size=2048).export_public_key("openssh").decode().strip()
    kh = c.inventory_path.parent / "kh_rsa"
    lines = c.known_hosts_path.read_text().splitlines(True)
    kh.write_text("".join(f"{n2.host} {rsa}\n" if ln.startswith(f"{n2.host} ") else ln for ln in lines))
    assert kh.read_text() != c.known_hosts_path.read_text()
    code, doc, _ = discover(
        tmp_path / "a.db", derived_inventory(c.inventory_path, "inv-rsa.yaml", known_hosts="kh_rsa")
    )
    n = by_name(doc)
    assert code == 1 and n["n1"]["reachable"]
    assert n["n2"]["error"] == (
        f"host key not verifiable in {kh}: it does not match the key there for {n2.host}; if the node was "
        f"reinstalled, remove that key (ssh-keygen -R '{n2.host}' -f {kh}) and run again"
    )

    inv = derived_inventory(c.inventory_path, "inv-tofu.yaml", known_hosts="accept-new")
    state = tmp_path / "st" / "s.db"
    state.parent.mkdir()
    assert discover(state, inv)[0] == 0
    pinned = state.with_suffix(".known_hosts")
    pinned.write_text(
        "".join(ln if not ln.startswith("n2 ") else f"n2 {rsa}\n" for ln in pinned.read_text().splitlines(True))
    )
    code, doc, _ = discover(state, inv)
    assert code == 1 and by_name(doc)["n2"]["error"].startswith(
        f"host key not verifiable: changed since it was pinned in {pinned} ({n2.host}:{n2.port})"
    )

    ca = asyncssh.generate_private_key("ssh-ed25519").export_public_key("openssh").decode().strip()
    kh_ca = c.inventory_path.parent / "kh_ca"
    kh_ca.write_text(f"@cert-authority * {ca}\n")
    code, doc, _ = discover(tmp_path / "c.db", derived_inventory(c.inventory_path, "inv-ca.yaml", known_hosts="kh_ca"))
    assert code == 1
    assert all(by_name(doc)[x]["error"].startswith(f"host key not verifiable in {kh_ca}: ") for x in ("n1", "n2"))


def test_the_changed_key_retry_keeps_ssh_config_s_host_key_algorithms(testbed_factory, tmp_path: Path) -> None:
    """The second handshake (for a node whose key type changed) never widens a
    HostKeyAlgorithms that ssh_config sets: an RSA-only policy against an ed25519-only node
    stays refused, as OpenSSH refuses it (the retry offered every type, and logged in)."""
    c = testbed_factory("n1=cpu-only")
    d = c.inventory_path.parent
    (d / "cfg-rsa").write_text("Host *\n  HostKeyAlgorithms rsa-sha2-512,rsa-sha2-256\n")
    data = yaml.safe_load(c.inventory_path.read_text())
    data["ssh_config"] = "cfg-rsa"
    inv = d / "inv-rsa-only.yaml"
    inv.write_text(yaml.safe_dump(data))
    code, doc, _ = discover(tmp_path / "a.db", inv)
    assert code == 1 and not by_name(doc)["n1"]["reachable"]


def test_the_retry_offers_the_trusted_host_key_types_first() -> None:
    """After a dropped handshake the retry asks for the trusted types first (then the rest):
    a node that still has one uses it. asyncssh's own order puts RSA first, and a node with
    both keys, ed25519 the trusted one, was told its key had changed."""
    from cluster_cli.ssh.trust import trusted_first as _trusted_first

    ed = asyncssh.generate_private_key("ssh-ed25519").convert_to_public()
    algs = _trusted_first(([ed], [], []))
    assert algs[0] == "ssh-ed25519" and "rsa-sha2-256" in algs and len(algs) == len(set(algs))
    ca = _trusted_first(([], [ed], []))
    assert ca[0].endswith("-cert-v01@openssh.com") and "ssh-ed25519" in ca


def test_a_passphrase_protected_key_or_its_public_half_logs_in_through_ssh_agent(
    testbed_factory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """identity_file may name a passphrase-protected key (its .pub beside it) or a public key:
    the key then comes from ssh-agent, only that one, as with ``ssh -i``. Before, both were
    refused (exit 2) and the advice, to unset identity_file, could not be followed for a node
    when defaults set one. Without an agent it is still exit 2, saying so."""
    c = testbed_factory("n1=cpu-only")
    d = c.inventory_path.parent
    key = asyncssh.read_private_key(str(c.identity_file))
    key.write_private_key(str(d / "enc"), format_name="pkcs8-pem", passphrase="secret")
    (d / "enc.pub").write_bytes(key.export_public_key())
    (d / "only.pub").write_bytes(key.export_public_key())
    enc_inv = derived_inventory(c.inventory_path, "inv-enc.yaml", identity_file="enc")
    pub_inv = derived_inventory(c.inventory_path, "inv-pub.yaml", identity_file="only.pub")

    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    code, _, err = discover(tmp_path / "a.db", enc_inv)
    assert code == 2 and "SSH_AUTH_SOCK is unset" in err, err

    sock = tmp_path / "agent.sock"
    started = subprocess.run(["ssh-agent", "-a", str(sock)], capture_output=True, text=True, check=True)
    pid = int(started.stdout.split("SSH_AGENT_PID=")[1].split(";")[0])
    try:
        monkeypatch.setenv("SSH_AUTH_SOCK", str(sock))
        code, doc, err = discover(tmp_path / "b.db", enc_inv)
        assert code == 1 and by_name(doc)["n1"]["error"] == (
            f"ssh-agent ({sock}) does not hold the key of identity file {d / 'enc'}: ssh-add it"
        )
        add = {"SSH_AUTH_SOCK": str(sock)}
        subprocess.run(["ssh-add", "-q", str(c.identity_file)], check=True, env=add)
        for inv in (enc_inv, pub_inv):
            code, doc, err = discover(tmp_path / f"c-{inv.stem}.db", inv)
            assert code == 0 and by_name(doc)["n1"]["reachable"], (inv, err)
        # That key alone: not the agent's others, nor ~/.ssh's default keys (here the node's own).
        home = tmp_path / "home"
        (home / ".ssh").mkdir(parents=True)
        (home / ".ssh" / "id_ed25519").write_bytes(c.identity_file.read_bytes())
        (home / ".ssh" / "id_ed25519").chmod(0o600)
        monkeypatch.setenv("HOME", str(home))
        other = asyncssh.generate_private_key("ssh-ed25519")
        other.write_private_key(str(d / "other"))
        (d / "other").chmod(0o600)
        (d / "other.pub").write_bytes(other.export_public_key())
        subprocess.run(["ssh-add", "-q", str(d / "other")], check=True, env=add)
        other_inv = derived_inventory(c.inventory_path, "inv-other.yaml", identity_file="other.pub")
        code, doc, _ = discover(tmp_path / "e.db", other_inv)
        assert code == 1 and "authentication failed" in by_name(doc)["n1"]["error"]
    finally:
        os.kill(pid, signal.SIGTERM)


def test_unset_known_hosts_trusts_the_system_file_too(
    testbed_factory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Left unset, known_hosts is ~/.ssh/known_hosts and the system's file, as OpenSSH reads
    them: a fleet whose host keys are distributed in /etc/ssh/ssh_known_hosts needs no copy
    (it was "known_hosts file not found", or a key "not there"). Set, it is that file alone."""
    import cluster_cli.config.inventory as inventory

    c = testbed_factory("n1=cpu-only,n2=cpu-only")
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    system = tmp_path / "ssh_known_hosts"
    system.write_text(c.known_hosts_path.read_text())
    monkeypatch.setattr(inventory, "SYSTEM_KNOWN_HOSTS", str(system))
    data = yaml.safe_load(c.inventory_path.read_text())
    data["defaults"].pop("known_hosts")
    unset = c.inventory_path.parent / "inv-unset.yaml"
    unset.write_text(yaml.safe_dump(data))
    code, doc, err = discover(tmp_path / "a.db", unset)
    assert code == 0, err  # no ~/.ssh/known_hosts at all: the system's file has both keys

    n1 = c.nodes["n1"]
    wrong = asyncssh.generate_private_key("ssh-ed25519").export_public_key("openssh").decode().strip()
    user = home / ".ssh" / "known_hosts"
    user.write_text(f"{n1.host} {wrong}\n")
    assert discover(tmp_path / "b.db", unset)[0] == 0  # one file with its key is enough (as OpenSSH)
    system.write_text(
        "".join(ln for ln in c.known_hosts_path.read_text().splitlines(True) if not ln.startswith(f"{n1.host} "))
    )
    code, doc, _ = discover(tmp_path / "c.db", unset)
    assert code == 1 and by_name(doc)["n2"]["reachable"]
    assert by_name(doc)["n1"]["error"] == (  # the file that holds the stale key, and how to clear it
        f"host key not verifiable in {user}: it does not match the key there for {n1.host}; if the node was "
        f"reinstalled, remove that key (ssh-keygen -R '{n1.host}' -f {user}) and run again"
    )
    # A system file clusterctl cannot use is passed over with a warning (as OpenSSH passes
    # over it), never the end of every run: it is not the user's to fix.
    good = system.read_text()
    system.write_text("this-line-is-bad\n")
    user.write_text(c.known_hosts_path.read_text())
    code, _, err = discover(tmp_path / "bad.db", unset)
    assert code == 0 and f"known_hosts {system}: " in err and "verifying host keys without it" in err, err
    system.write_text(good)
    user.write_text(f"{n1.host} {wrong}\n")
    data["defaults"]["known_hosts"] = "~/.ssh/known_hosts"  # set: that file alone
    (c.inventory_path.parent / "inv-set.yaml").write_text(yaml.safe_dump(data))
    code, doc, _ = discover(tmp_path / "d.db", c.inventory_path.parent / "inv-set.yaml")
    assert code == 1 and "no key for" in by_name(doc)["n2"]["error"]


def test_node_dying_mid_probe_is_reported_not_fatal(testbed_factory, tmp_path: Path) -> None:
    c = testbed_factory("slow=hgx-h200x8:slow=3,fine=cpu-only")
    killer = threading.Timer(1.0, c.kill, args=("slow",))
    killer.start()
    try:
        code, doc, _ = discover(tmp_path / "s.db", c.inventory_path)
    finally:
        killer.join()
    n = by_name(doc)
    assert code == 1
    assert n["fine"]["reachable"] is True
    err = n["slow"]["error"]
    # Which the client sees first is a race: the connection dropping, or sshd reporting the
    # probe shell's death by the kill that took the whole node down.
    seen = ("lost", "refused", "closed", "killed by SIGKILL")
    assert n["slow"]["reachable"] is False and any(w in err for w in seen), err


def test_console_script_end_to_end(testbed, tmp_path: Path) -> None:
    """The installed entry point, as a user runs it: table output and exit code."""
    r = subprocess.run(
        [sys.executable, "-m", "cluster_cli", "--state", str(tmp_path / "s.db"), "discover",
         "-i", str(testbed.inventory_path)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "gpu-01" in r.stdout and "8/8 H200" in r.stdout and "{0-7}" in r.stdout


@pytest.mark.parametrize("parallel", ["1", "3"])
def test_parallel_bound_gives_same_facts(testbed, tmp_path: Path, parallel: str) -> None:
    code, doc, _ = discover(tmp_path / "s.db", testbed.inventory_path, "--parallel", parallel)
    assert code == 0
    assert [n["name"] for n in doc["nodes"]] == ["gpu-01", "gpu-02", "gpu-03", "gpu-04", "cpu-01"]


def test_ssh_config_host_alias(testbed_factory, tmp_path: Path) -> None:
    """An inventory host may be an ssh_config alias (HostName, User); the host key is still checked."""
    c = testbed_factory("n1=cpu-only")
    d = c.inventory_path.parent
    (d / "ssh_config").write_text(f"Host box-one\n  HostName {c.nodes['n1'].host}\n  Port {c.nodes['n1'].port}\n")
    data = yaml.safe_load(c.inventory_path.read_text())
    data["ssh_config"] = "ssh_config"
    data["nodes"][0]["host"] = "box-one"
    inv = d / "inv-alias.yaml"
    inv.write_text(yaml.safe_dump(data))
    code, doc, err = discover(tmp_path / "s.db", inv)
    assert code == 0, err
    assert by_name(doc)["n1"]["reachable"] is True
    (d / "ssh_config").write_text("Host box-one\n  HostName 198.18.0.254\n  ConnectTimeout 1\n")  # nobody there
    code, doc, _ = discover(tmp_path / "s.db", inv, "--timeout", "3")
    assert code == 1 and by_name(doc)["n1"]["reachable"] is False


def test_ssh_config_supplies_user_key_and_accept_new_pins_by_name(testbed_factory, tmp_path: Path) -> None:
    """User and IdentityFile come from ssh_config when the inventory leaves them out, and
    accept-new pins work through the alias."""
    c = testbed_factory("n1=cpu-only")
    d = c.inventory_path.parent
    n = c.nodes["n1"]
    (d / "ssh_config").write_text(
        f"Host box-two\n  HostName {n.host}\n  Port {n.port}\n  User {c.user}\n"
        f"  IdentityFile {d / 'id_ed25519'}\n  IdentitiesOnly yes\n"
    )
    data = yaml.safe_load(c.inventory_path.read_text())
    data["defaults"] = {"known_hosts": "accept-new"}
    data["ssh_config"] = "ssh_config"
    data["nodes"][0]["host"] = "box-two"
    inv = d / "inv-cfg.yaml"
    inv.write_text(yaml.safe_dump(data))
    state = tmp_path / "st" / "s.db"
    state.parent.mkdir()  # discover creates only the default state folder
    for _ in range(2):  # first contact pins, the second run verifies against the pin
        code, doc, err = discover(state, inv)
        assert code == 0, err
        assert by_name(doc)["n1"]["reachable"] is True
    assert state.with_suffix(".known_hosts").read_text().count("\n") == 1
    assert not (state.parent / "known_hosts").exists()  # never an OpenSSH-named file


def test_an_ssh_config_key_that_cannot_be_used_is_named(
    testbed_factory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A passphrase-protected IdentityFile with no agent is never offered: the failure says
    so, not only "permission denied". One that is not a key at all is named."""
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    c = testbed_factory("n1=cpu-only")
    d = c.inventory_path.parent
    asyncssh.read_private_key(str(c.identity_file)).write_private_key(
        str(d / "enc"), format_name="pkcs8-pem", passphrase="secret"
    )
    (d / "bogus").write_text("not a key\n")
    for ident, needle in (
        ("enc", f"(ssh_config IdentityFile {d / 'enc'}: passphrase-protected, used only from ssh-agent)"),
        ("bogus", f"cannot load identity file {d / 'bogus'}: "),
    ):
        (d / f"cfg-{ident}").write_text(f"Host *\n  IdentityFile {d / ident}\n")
        data = yaml.safe_load(c.inventory_path.read_text())
        data["defaults"].pop("identity_file", None)
        data["ssh_config"] = f"cfg-{ident}"
        inv = d / f"inv-{ident}.yaml"
        inv.write_text(yaml.safe_dump(data))
        code, doc, err = discover(tmp_path / f"{ident}.db", inv)
        assert code in (1, 2) and needle in (by_name(doc)["n1"]["error"] if doc else err), (doc, err)


def test_a_node_flooding_its_output_is_cut_and_the_others_are_unaffected(testbed_factory, tmp_path: Path) -> None:
    import shutil

    c = testbed_factory("flood=cpu-only,fine=cpu-only")
    nproc = c.nodes["flood"].bin_dir / "nproc"  # the probe `nproc --all` prints 12 MB
    nproc.write_text(f"#!/bin/sh\nexec {shutil.which('head')} -c 12000000 /dev/zero\n")
    code, doc, err = discover_bounded(tmp_path / "s.db", c.inventory_path)
    n = by_name(doc)
    assert code == 1 and n["fine"]["reachable"] is True and n["fine"]["cpus"]
    assert n["flood"]["reachable"] is False
    assert n["flood"]["error"] == "command output over 8 MiB on stdout, cut", n["flood"]["error"]
    assert "flood: command output over 8 MiB on stdout, cut" in err


class _Reader:
    """Everything a stream gave so far, read by a thread (so no read can block the test)."""

    def __init__(self, stream: IO[str]) -> None:
        self.text = ""
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, args=(stream,), daemon=True)
        self._thread.start()

    def _run(self, stream: IO[str]) -> None:
        for line in stream:
            with self._cond:
                self.text += line
                self._cond.notify_all()

    def wait_for(self, *wanted: str, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: all(w in self.text for w in wanted), timeout)

    def join(self, timeout: float) -> str:
        self._thread.join(timeout)
        return self.text


def test_ctrl_c_saves_nothing_and_says_so(testbed_factory, tmp_path: Path) -> None:
    import signal

    c = testbed_factory("slow=cpu-only:slow=20,fine=cpu-only")
    state = tmp_path / "s.db"

    def interrupted(
        sig: int = signal.SIGINT, meanwhile: Callable[[], None] = lambda: None
    ) -> tuple[int | None, str, str]:
        p = subprocess.Popen(
            [sys.executable, "-m", "cluster_cli", "--state", str(state), "discover", "-i", str(c.inventory_path), "-v"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert p.stderr is not None and p.stdout is not None
        try:
            err_reader = _Reader(p.stderr)
            # fine is done and slow is probing (for 20 s): Ctrl-C now
            assert err_reader.wait_for("slow: connected", "fine: ok", timeout=30), err_reader.text
            meanwhile()
            p.send_signal(sig)
            p.wait(30)
            return p.returncode, err_reader.join(10), p.stdout.read()
        finally:
            p.kill()

    def on_slow() -> list[str]:
        """What still runs on node slow under its sshd (the probes sleep 20 s there)."""
        todo, found = [c.nodes["slow"].sshd_pid], []
        while todo:
            pid = todo.pop()
            for kids in Path(f"/proc/{pid}/task").glob("*/children"):
                with contextlib.suppress(OSError):
                    todo += [int(k) for k in kids.read_text().split()]
            if pid != c.nodes["slow"].sshd_pid:
                with contextlib.suppress(OSError):
                    found.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode())
        return [f for f in found if f.strip()]

    # A first discover: the state it made to write at its end is not left behind, empty.
    code, err, out = interrupted()
    assert code == 130, err
    assert err.splitlines()[-1:] == ["interrupted: nothing saved"], err
    assert out == ""
    assert not list(tmp_path.glob("s.db*"))  # nor its -wal and -shm
    # Nor its probes on the node: they end with the client, not at their deadline (24 s).
    deadline = time.monotonic() + 8
    while (left := on_slow()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert left == []
    # A state that was there keeps what it had, and gets nothing of this run.
    with Store(state) as s:
        s.cordon("slow", "PSU")
    code, err, out = interrupted()
    assert code == 130 and out == "", err
    with Store(state, readonly=True) as s:  # not even the node that had answered
        assert s.nodes() == [] and s.inventory() is None and set(s.cordons()) == {"slow"}
    # SIGTERM (a supervisor, timeout(1)) ends it the same way, as 143.
    code, err, out = interrupted(signal.SIGTERM)
    assert code == 143 and err.splitlines()[-1:] == ["interrupted: nothing saved"] and out == "", err
    # A state another command made while a first discover probed is theirs: it stays, with
    # what they wrote (it was deleted with the cordon in it).
    for f in tmp_path.glob("s.db*"):
        f.unlink()

    def cordon() -> None:
        with Store(state) as s:
            s.cordon("fine", "RMA 4411")

    code, err, _ = interrupted(meanwhile=cordon)
    assert code == 130, err
    with Store(state, readonly=True) as s:
        assert s.cordons()["fine"]["reason"] == "RMA 4411" and s.nodes() == []


def test_an_interrupt_just_after_the_save_says_the_facts_were_saved(
    testbed_factory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A signal during the COMMIT is handled only after it: the state holds the facts, and
    the message says so (it said "nothing saved")."""
    c = testbed_factory("n1=cpu-only")
    real = Store.save_discovery

    def save_then_interrupted(self: Store, *a: Any, **kw: Any) -> None:
        real(self, *a, **kw)
        raise KeyboardInterrupt

    monkeypatch.setattr(Store, "save_discovery", save_then_interrupted)
    code, _, err = discover(tmp_path / "s.db", c.inventory_path)
    assert code == 130 and err.splitlines()[-1] == "interrupted: the facts were saved", err
    with Store(tmp_path / "s.db", readonly=True) as s:
        assert [n.name for n in s.nodes()] == ["n1"]


def test_verbose_tells_each_node_s_steps_on_stderr_and_keeps_stdout_clean(testbed_factory, tmp_path: Path) -> None:
    from cluster_cli.cli.main import hoist_global_options

    c = testbed_factory("g=hgx-h200x8:fabric=ib-a,dead=cpu-only")
    c.kill("dead")
    args = ["--state", str(tmp_path / "s.db"), "discover", "-i", str(c.inventory_path), "-o", "json", "-v"]
    r = runner.invoke(app, hoist_global_options(args))
    assert r.exit_code == 1
    assert set(by_name(json.loads(r.stdout))) == {"g", "dead"}  # stdout is the JSON alone
    lines = r.stderr.splitlines()

    def line(prefix: str) -> str:
        return next((x for x in lines if x.startswith(prefix)), f"no line {prefix!r} in {lines}")

    assert line("g: connected to ").endswith("s"), lines
    ran = line("g: ran 'sh -s' in ")  # the probe batch: its time, and each probe it ran with its exit code
    for probe in (
        "gpus rc 0",
        "apps rc 0",
        "topo rc 0",
        "ibstat rc 0",
        "cpus rc 0",
        "meminfo rc 0",
        "sm:mlx5_0:1 rc 0",
    ):
        assert probe in ran, ran
    assert line("g: ok after ").endswith("; no problems"), lines
    assert "(connect " in line("g: ok after ") and ", probe " in line("g: ok after ")
    assert "connection refused" in line("dead: unreachable after "), lines
    plain = runner.invoke(app, args[:-1])
    assert not any(x.startswith(("g: connected", "g: ran", "g: ok")) for x in plain.stderr.splitlines())


def test_a_gpu_node_whose_nvidia_smi_vanished_is_flagged_not_made_cpu_only(testbed_factory, tmp_path: Path) -> None:
    """nvidia-smi not found reads as a CPU-only node; on a node that had GPUs at the last
    discover it is a problem (a driver removed, a PATH changed), said in the table and JSON."""
    import shutil

    c = testbed_factory("g=hgx-h200x8:fabric=ib-a,c=cpu-only")
    state = tmp_path / "s.db"
    code, doc, _ = discover(state, c.inventory_path)
    assert code == 0 and len(by_name(doc)["g"]["gpus"]) == 8
    tool = c.dir / "nodes" / "g" / "bin" / "nvidia-smi"
    shutil.copy(tool, tmp_path / "nvidia-smi")
    shutil.copy(c.dir / "nodes" / "c" / "bin" / "nvidia-smi", tool)  # the CPU node's: command not found
    code, doc, err = discover(state, c.inventory_path)
    g, cpu = by_name(doc)["g"], by_name(doc)["c"]
    assert g["gpus"] == [] and cpu["gpus"] == [] and cpu["problems"] == []
    (gone,) = [p for p in g["problems"] if p.startswith("gpus-gone:")]
    assert "the last discover" in gone and gone.endswith("saw 8 H200"), gone
    assert f"g: {gone}" in " ".join(err.split())
    code, doc, _ = discover(state, c.inventory_path)  # and on every discover after, until they are back
    assert gone in by_name(doc)["g"]["problems"]
    shutil.copy(tmp_path / "nvidia-smi", tool)  # the driver is back
    code, doc, _ = discover(state, c.inventory_path)
    assert code == 0 and len(by_name(doc)["g"]["gpus"]) == 8 and by_name(doc)["g"]["problems"] == []


def test_a_hung_probe_within_a_short_timeout_is_reported_on_a_reachable_node(testbed_factory, tmp_path: Path) -> None:
    """With --timeout shorter than the inventory's command timeout, the probes' own timeout is
    fitted inside it: a hung nvidia-smi (a sick GPU or driver) is killed and reported on a node
    that answered, not the whole node given up on as unreachable, its other facts thrown away."""
    c = testbed_factory("hung=hgx-h200x8:slow=60,fine=cpu-only")
    t0 = time.monotonic()
    code, doc, err = discover_bounded(tmp_path / "s.db", c.inventory_path, "--timeout", "8", timeout=60)
    took = time.monotonic() - t0
    n = by_name(doc)
    assert code == 0, err
    assert n["hung"]["reachable"] is True and n["hung"]["error"] is None
    assert any("did not answer within the probe timeout" in p for p in n["hung"]["problems"]), n["hung"]["problems"]
    assert n["fine"]["reachable"] is True
    assert took < 8 + 5  # the node's deadline, plus start-up


def test_a_gpu_cordon_survives_rediscovery_and_shows(testbed, tmp_path: Path) -> None:
    state = tmp_path / "s.db"
    inv = str(testbed.inventory_path)
    r = runner.invoke(app, ["--state", str(state), "cordon", "gpu-02", "-i", inv, "--gpu", "1", "--reason", "Xid 79"])
    assert r.exit_code == 0, r.output
    for _ in range(2):
        code, doc, _ = discover(state, testbed.inventory_path)
        assert code == 0
        n = by_name(doc)["gpu-02"]
        assert n["cordoned"] is False
        assert n["gpus"][1]["problems"] == ["cordoned: Xid 79"] and n["gpus"][1]["free"] is False
        assert n["gpus"][1]["healthy"] is True and n["gpus"][0]["free"] is True
    table = runner.invoke(app, ["--state", str(state), "discover", "-i", inv], terminal_width=200).output
    assert "gpu-02 gpu1 cordoned: Xid 79" in table and "gpu 1" in table
