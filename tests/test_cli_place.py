"""``clusterctl place --dry-run``: inputs, the JSON contract, the table, exit codes; nothing written."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from helpers import ISSUE_EXAMPLE, a100_pcie, cpu_node, dgx, ib, write_inputs
from typer.testing import CliRunner

from cluster_cli.cli.main import app
from cluster_cli.facts import NodeFacts, Replica, Shard
from cluster_cli.state.records import ReplicaRecord
from cluster_cli.state.store import Store

runner = CliRunner()
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

CATALOG = ISSUE_EXAMPLE  # the catalog of issue 3, as test_catalog checks it


def place(tmp_path: Path, *args: str):
    return runner.invoke(app, ["--state", str(tmp_path / "state.db"), "place", *args])


def test_json_contract_all_placed(tmp_path: Path) -> None:
    inv, cat, facts = write_inputs(tmp_path, [dgx("gpu-01"), dgx("gpu-02")])
    r = place(tmp_path, "--dry-run", "-i", str(inv), "-c", str(cat), "--facts", str(facts), "-o", "json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["unplaced"] == []
    first = doc["replicas"][0]
    assert {k: first[k] for k in ("model", "replica", "profile", "engine", "action", "fabric")} == {
        "model": "llama-70b", "replica": 0, "profile": "h100-tp8", "engine": "vllm", "action": "start", "fabric": None,
    }  # fmt: skip
    hcas = [f"mlx5_{i}" for i in range(8)]  # a single-node shard lists its Active IB ports (fabric stays null)
    assert first["shards"] == [{"node": "gpu-01", "gpus": [0, 1, 2, 3, 4, 5, 6, 7], "hcas": hcas}]
    assert doc["replicas"][1]["shards"][0]["node"] == "gpu-02"
    assert doc["state_version"] is None
    assert not (tmp_path / "state.db").exists()  # never writes, never creates


def test_unplaced_exits_3_and_explains_each_profile(tmp_path: Path) -> None:
    nodes = [dgx("gpu-01", cpus=16), dgx("gpu-02", problems={0: "ecc", 1: "ecc", 2: "ecc", 3: "foreign"}, cpus=16),
             cpu_node("cpu-01", cpus=16)]  # fmt: skip
    inv, cat, facts = write_inputs(tmp_path, nodes)
    r = place(tmp_path, "--dry-run", "-i", str(inv), "-c", str(cat), "--facts", str(facts), "-o", "json")
    assert r.exit_code == 3, r.output
    doc = json.loads(r.stdout)
    assert [x["action"] for x in doc["replicas"]] == ["start"]
    (u,) = doc["unplaced"]
    assert (u["model"], u["replica"]) == ("llama-70b", 1)
    assert {x["profile"] for x in u["reasons"]} == {"h100-tp8", "a100-2x8", "cpu"}
    by = {(x["profile"], x["node"]): x for x in u["reasons"]}
    assert by[("h100-tp8", "gpu-02")]["constraint"] == "capacity"
    assert (
        by[("h100-tp8", "gpu-02")]["detail"] == "4 of 8 H100 free (3 ECC, 1 foreign process pid 4414), profile needs 8"
    )
    assert by[("h100-tp8", "gpu-01")]["detail"] == "0 of 8 H100 free (8 allocated), profile needs 8"
    assert by[("a100-2x8", "gpu-01")]["constraint"] == "gpu-class"
    assert by[("cpu", "cpu-01")]["detail"] == "16 of 16 CPUs unreserved, profile needs 32"
    assert all(set(x) >= {"profile", "node", "constraint", "detail"} for x in u["reasons"])


def test_table_is_a_diff_plus_a_dry_run_block(tmp_path: Path) -> None:
    nodes = [dgx("gpu-01", cpus=8), dgx("gpu-02", cordoned=True), cpu_node("cpu-01", cpus=8)]
    inv, cat, facts = write_inputs(tmp_path, nodes)
    r = place(tmp_path, "--dry-run", "-i", str(inv), "-c", str(cat), "--facts", str(facts))
    assert r.exit_code == 3
    out = r.stdout
    assert "+ model 'llama-70b' (1 start, 1 unplaced)" in out
    assert "  + replica 0: h100-tp8 (vllm) gpu-01 GPU 0-7" in out
    assert "Scheduler dry-run:" in out and "WARNING: Failed to place all replicas" in out
    assert "2 nodes filtered: cordoned 1, gpu-class 1" in out
    assert "gpu-02: cordoned (maintenance)" in out
    assert "cpu-01: 8 of 8 CPUs unreserved, profile needs 32" in out


def test_a_replica_that_fell_back_says_why_each_better_profile_did_not_fit(tmp_path: Path) -> None:
    nodes = [dgx("gpu-01", cpus=8), cpu_node("cpu-01", cpus=64)]
    inv, cat, facts = write_inputs(tmp_path, nodes)
    r = place(tmp_path, "--dry-run", "-i", str(inv), "-c", str(cat), "--facts", str(facts))
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    i = lines.index(
        "  llama-70b [1] on cpu: 2 nodes evaluated; capacity checked up to the first node that fits, in spread order"
    )
    assert lines[i + 1 : i + 3] == [
        "    not h100-tp8 (8x H100): 0/2 nodes are available: 1 insufficient gpus, 1 no H100 gpu.",
        "    not a100-2x8 (2 nodes x 8x A100): 0/2 nodes are available: 2 no A100 gpu.",
    ]
    j = lines.index("  llama-70b [0] on h100-tp8: 2 nodes evaluated; 1 node filtered: gpu-class 1")
    assert not lines[j + 1].startswith("    not ")  # its first choice: nothing to explain
    r = place(tmp_path, "--dry-run", "-i", str(inv), "-c", str(cat), "--facts", str(facts), "-o", "json")
    (fell,) = [x for x in json.loads(r.stdout)["replicas"] if x["replica"] == 1]
    assert [(a["profile"], a["placed"], a.get("summary")) for a in fell["attempts"]] == [
        ("h100-tp8", False, "0/2 nodes are available: 1 insufficient gpus, 1 no H100 gpu."),
        ("a100-2x8", False, "0/2 nodes are available: 2 no A100 gpu."),
        ("cpu", True, None),
    ]


def test_nodes_outside_the_inventory_are_ignored_and_missing_ones_explained(tmp_path: Path) -> None:
    nodes = [dgx("gpu-01", cpus=8), dgx("stranger")]
    inv, cat, facts = write_inputs(tmp_path, nodes, inventory_nodes=["gpu-01", "gpu-09"])
    r = place(tmp_path, "--dry-run", "-i", str(inv), "-c", str(cat), "--facts", str(facts), "-o", "json")
    doc = json.loads(r.stdout)
    nodes = {s["node"] for x in doc["replicas"] for s in x["shards"]} | {
        x["node"] for u in doc["unplaced"] for x in u["reasons"]
    }
    assert "stranger" not in nodes
    reasons = {x["node"]: x for x in doc["unplaced"][0]["reasons"] if x["profile"] == "h100-tp8"}
    assert reasons["gpu-09"]["constraint"] == "reachable" and "not discovered" in reasons["gpu-09"]["detail"]


def test_inventory_fabrics_fill_in_missing_hca_fabrics(tmp_path: Path) -> None:
    nodes = [a100_pcie("a-1", hcas=[ib("mlx5_0", None)]), a100_pcie("a-2", hcas=[ib("mlx5_0", None)])]
    inv, cat, facts = write_inputs(tmp_path, nodes)
    inv.write_text("nodes:\n  - {name: a-1, host: h1, fabric: ib-b}\n  - {name: a-2, host: h2, fabric: ib-b}\n")
    r = place(tmp_path, "--dry-run", "-i", str(inv), "-c", str(cat), "--facts", str(facts), "-o", "json")
    multi = [x for x in json.loads(r.stdout)["replicas"] if x["profile"] == "a100-2x8"]
    assert multi and multi[0]["fabric"] == "ib-b" and multi[0]["shards"][0]["hcas"] == ["mlx5_0"]


def test_state_store_facts_allocations_and_version(tmp_path: Path) -> None:
    inv, cat, _ = write_inputs(tmp_path, [dgx("gpu-01"), dgx("gpu-02"), dgx("gpu-03")])
    db = tmp_path / "state.db"
    with Store(db) as s:
        s.save_discovery([dgx("gpu-01"), dgx("gpu-02"), dgx("gpu-03")])
        s.cordon("gpu-01", "bad fan")
        s.reserve([
            ReplicaRecord(Replica("llama-70b", 0, "h100-tp8", "vllm", (Shard("gpu-01", tuple(range(8))),), gpu_class="H100")),
            ReplicaRecord(Replica("old", 0, "x", "vllm", (Shard("gpu-02", (0,)),), gpu_class="H100")),
        ])  # fmt: skip
        version = s.version()
    r = place(tmp_path, "--dry-run", "-i", str(inv), "-c", str(cat), "-o", "json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["state_version"] == version
    acts = {(x["model"], x["replica"]): (x["action"], x["shards"][0]["node"]) for x in doc["replicas"]}
    assert acts[("llama-70b", 0)] == ("keep", "gpu-01")  # kept on a cordoned node
    assert acts[("old", 0)][0] == "stop"
    assert acts[("llama-70b", 1)] == ("start", "gpu-02")  # old's GPU is released by the stop
    table = place(tmp_path, "--dry-run", "-i", str(inv), "-c", str(cat))
    assert f"state version {version}" in table.stdout and "- replica 0: x (vllm) gpu-02 GPU 0" in table.stdout
    with Store(db) as s:
        assert s.version() == version and len(s.replicas()) == 2  # nothing written


def test_without_i_the_inventory_discover_recorded_is_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CLUSTERCTL_INVENTORY", raising=False)
    inv, cat, _ = write_inputs(tmp_path, [dgx("gpu-01"), dgx("gpu-02")], inventory_nodes=["gpu-01"])
    r = place(tmp_path, "--dry-run", "-c", str(cat))
    assert r.exit_code == 2 and "no inventory given" in r.output
    with Store(tmp_path / "state.db") as s:
        s.save_discovery([dgx("gpu-01"), dgx("gpu-02")], inventory=inv.resolve())
    r = place(tmp_path, "--dry-run", "-c", str(cat), "-o", "json")
    assert r.exit_code in (0, 3), r.output
    nodes = {sh["node"] for x in json.loads(r.stdout)["replicas"] for sh in x["shards"]}
    assert nodes == {"gpu-01"}  # gpu-02 has facts but is not in the recorded inventory


def test_facts_from_the_state_follow_the_inventory_labels_and_fabrics_alone() -> None:
    from cluster_cli.config.inventory import Inventory
    from cluster_cli.state.view import for_inventory

    inv = Inventory.model_validate({"fabrics": {"ib-a": None}, "nodes": [{"name": "gpu-01", "host": "h"}]})
    stored = replace(dgx("gpu-01"), labels={"zone": "a"})  # probed when the inventory said zone: a, fabric ib-a
    (now,) = for_inventory(inv, [stored], from_state=True)
    assert now.labels == {} and not now.fabrics  # both since removed from the inventory
    (hand,) = for_inventory(inv, [stored])  # a hand-written facts file keeps its own
    assert hand.labels == {"zone": "a"}


def test_facts_file_gets_the_stores_cordons(tmp_path: Path) -> None:
    inv, cat, facts = write_inputs(tmp_path, [dgx("gpu-01"), dgx("gpu-02", cpus=8)])
    with Store(tmp_path / "state.db") as s:
        s.cordon("gpu-01", "RMA")
    r = place(tmp_path, "--dry-run", "-i", str(inv), "-c", str(cat), "--facts", str(facts), "-o", "yaml")
    assert r.exit_code == 3 and "detail: cordoned (RMA)" in r.stdout


GPU_ONLY = "models:\n  - {{name: m, replicas: {replicas}, profiles: [{{name: tp8, engine: vllm, gpu_class: H100, gpus: 8, model: /m}}]}}\n"


def test_with_a_store_cordons_come_from_the_store_only(tmp_path: Path) -> None:
    # A facts file saved while gpu-01 was cordoned; the operator has uncordoned it since.
    nodes = [replace(dgx("gpu-01"), cordoned=True, cordon_reason="old"), dgx("gpu-02")]
    inv, cat, facts = write_inputs(tmp_path, nodes, catalog=GPU_ONLY.format(replicas=2))
    r = place(tmp_path, "--dry-run", "-i", str(inv), "-c", str(cat), "--facts", str(facts), "-o", "json")
    assert r.exit_code == 3 and "cordoned (old)" in r.stdout  # no store: the file's word stands
    with Store(tmp_path / "state.db") as s:
        s.cordon("gpu-01", "old")
        s.uncordon("gpu-01")
    r = place(tmp_path, "--dry-run", "-i", str(inv), "-c", str(cat), "--facts", str(facts), "-o", "json")
    assert r.exit_code == 0, r.output


def test_hand_written_gpu_faults_count_without_a_problems_list(tmp_path: Path) -> None:
    doc = dgx("gpu-01").to_dict()
    for g in doc["gpus"]:
        g["problems"] = []
    faults = {0: ("lost", True), 1: ("ecc_uncorrected", 4), 2: ("mig_mode", True), 3: ("remapped_rows_pending", True),
              4: ("retired_pages_pending", True)}  # fmt: skip
    for i, (key, value) in faults.items():
        doc["gpus"][i][key] = value
    inv, cat, facts = write_inputs(tmp_path, [dgx("gpu-01")], catalog=GPU_ONLY.format(replicas=1))
    facts.write_text(json.dumps({"nodes": [doc]}))
    r = place(tmp_path, "--dry-run", "-i", str(inv), "-c", str(cat), "--facts", str(facts))
    assert r.exit_code == 3, r.output
    assert "3 of 8 H100 free (1 lost, 1 ECC, 1 retired pages pending, 1 row remap pending, 1 MIG)" in r.output


@pytest.mark.parametrize(
    ("setup", "needle"),
    [
        (lambda p: (p / "catalog.yaml").write_text("models:\n  - {name: m, profiles: [{name: a, engine: vllm}]}\n"),
         "catalog.yaml: line 2 (a): models.0.profiles.0.gpu_class: vllm needs a gpu_class"),
        (lambda p: (p / "facts.json").write_text("{not json"), "facts.json: line 1, column 2: invalid JSON"),
        (lambda p: (p / "facts.json").write_text('{"nodes": [{"host": "x"}]}'), "facts.json: nodes.0: missing key 'name'"),
        (lambda p: (p / "facts.json").write_text('{"nodes": 3}'), "facts.json: nodes: expected a list"),
        (lambda p: (p / "facts.json").unlink(), "facts.json: file not found"),
        (lambda p: (p / "inventory.yaml").write_text("nodes: [{name: a}]\n"), "inventory.yaml: line 1 (a): nodes.0.host"),
        (lambda p: (p / "facts.json").write_text("[]"),
         "facts.json: has facts for none of the inventory's 1 node (gpu-01); it has no nodes at all"),
        (lambda p: (p / "facts.json").write_text('{"nodes": [{"name": "zz"}]}'),
         "facts.json: has facts for none of the inventory's 1 node (gpu-01); it has zz"),
        (lambda p: (p / "facts.json").write_text(json.dumps([{"name": f"x{i}"} for i in range(7)])),
         "none of the inventory's 1 node (gpu-01); it has x0, x1, x2, x3, x4 and 2 more"),
        (lambda p: (p / "facts.json").write_text('{"nodes": [{"name": "gpu-01", "cpus": "many"}]}'),
         "facts.json: nodes.0 (gpu-01): invalid facts: cpus: expected a number, got 'many'"),
        (lambda p: (p / "facts.json").write_text('{"nodes": [{"name": "gpu-01"}, {"name": "gpu-01", "cpus": 1}]}'),
         "facts.json: nodes.1: duplicate node name 'gpu-01' (also nodes.0)"),
        (lambda p: (p / "facts.json").write_text('{"nodes": [{"name": "gpu-01", "reachable": "false"}]}'),
         "invalid facts: reachable: expected true or false, got 'false'"),
        (lambda p: (p / "facts.json").write_text('{"nodes": [{"name": "gpu-01", "cpus": NaN}]}'),
         "invalid facts: cpus: expected a finite number >= 0, got nan"),
        (lambda p: (p / "facts.json").write_text('{"nodes": [{"name": "gpu-01", "memory_mib": -1}]}'),
         "invalid facts: memory_mib: expected a finite number >= 0, got -1"),
        (lambda p: (p / "facts.json").write_text(
            '{"nodes": [{"name": "gpu-01", "gpus": [{"index": 0, "lost": "no"}]}]}'),
         "invalid facts: lost: expected true or false, got 'no'"),
    ],
)  # fmt: skip
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, setup, needle: str) -> None:
    inv, cat, facts = write_inputs(tmp_path, [dgx("gpu-01")])
    setup(tmp_path)
    r = place(tmp_path, "--dry-run", "-i", str(inv), "-c", str(cat), "--facts", str(facts))
    assert r.exit_code == 2
    lines = [x for x in r.output.splitlines() if x.strip()]
    assert len(lines) == 1 and needle in lines[0], r.output


def test_no_state_and_no_facts_is_exit_2(tmp_path: Path) -> None:
    inv, cat, _ = write_inputs(tmp_path, [dgx("gpu-01")])
    r = place(tmp_path, "--dry-run", "-i", str(inv), "-c", str(cat))
    assert r.exit_code == 2 and "discover" in r.output
    assert not (tmp_path / "state.db").exists()


def test_without_dry_run_points_at_up(tmp_path: Path) -> None:
    inv, cat, facts = write_inputs(tmp_path, [dgx("gpu-01")])
    r = place(tmp_path, "-i", str(inv), "-c", str(cat), "--facts", str(facts))
    assert r.exit_code == 2 and "clusterctl up" in r.output and "--dry-run" in r.output


def test_help_shows_an_example() -> None:
    r = runner.invoke(app, ["place", "--help"])
    assert r.exit_code == 0 and "clusterctl place --dry-run -i inventory.yaml -c catalog.yaml" in r.output


def test_example_files_work_together(tmp_path: Path) -> None:
    doc = json.loads((EXAMPLES / "facts-mixed.json").read_text())
    names = [n["name"] for n in doc["nodes"]]
    inv = tmp_path / "inventory.yaml"
    inv.write_text("nodes:\n" + "".join(f"  - {{name: {n}, host: {n}}}\n" for n in names))
    r = place(tmp_path, "--dry-run", "-i", str(inv), "-c", str(EXAMPLES / "catalog.yaml"),
              "--facts", str(EXAMPLES / "facts-mixed.json"), "-o", "json")  # fmt: skip
    assert r.exit_code == 3, r.output  # deepseek-r1 needs two H200 boxes on one fabric; there is one
    out = json.loads(r.stdout)
    assert [u["model"] for u in out["unplaced"]] == ["deepseek-r1"]
    placed = {(x["model"], x["replica"]): x for x in out["replicas"]}
    assert placed[("llama-70b", 1)]["fabric"] == "ib-b" and placed[("tiny", 0)]["shards"][0]["node"].startswith("cpu-")
    # Round trip: facts are exactly NodeFacts.to_dict().
    assert [NodeFacts.from_dict(n).to_dict() for n in doc["nodes"]] == doc["nodes"]


def test_facts_bare_list_and_reachability_round_trip(tmp_path: Path) -> None:
    inv, cat, facts = write_inputs(tmp_path, [replace(dgx("gpu-01"), reachable=False, error="timeout")])
    facts.write_text(json.dumps([dgx("gpu-01", cpus=8).to_dict()]))
    r = place(tmp_path, "--dry-run", "-i", str(inv), "-c", str(cat), "--facts", str(facts), "-o", "json")
    assert r.exit_code == 3 and json.loads(r.stdout)["replicas"][0]["shards"][0]["node"] == "gpu-01"


def test_place_reads_the_state_without_writing_it(tmp_path: Path) -> None:
    inv, cat, _ = write_inputs(tmp_path, [dgx("gpu-01")])
    with Store(tmp_path / "state.db") as st:
        st.save_discovery([dgx("gpu-01")])
        version = st.version()
    before = (tmp_path / "state.db").read_bytes()
    r = place(tmp_path, "--dry-run", "-i", str(inv), "-c", str(cat), "-o", "json")
    assert r.exit_code == 0 and json.loads(r.stdout)["state_version"] == version
    assert (tmp_path / "state.db").read_bytes() == before


def test_a_gpu_class_nothing_has_is_flagged_once(tmp_path: Path) -> None:
    typo = CATALOG.replace("gpu_class: H100", "gpu_class: H1OO", 1)
    assert typo != CATALOG
    n = dgx("gpu-01", problems={2: "lost"})
    gpus = list(n.gpus)  # a lost GPU's product and class cannot be read: the parser says "unknown"
    gpus[2] = replace(gpus[2], product="unknown", gpu_class="unknown")
    inv, cat, facts = write_inputs(tmp_path, [replace(n, gpus=tuple(gpus))], catalog=typo)
    r = place(tmp_path, "--dry-run", "-i", str(inv), "-c", str(cat), "--facts", str(facts), "-o", "json")
    warnings = [x for x in r.stderr.splitlines() if "H1OO" in x]
    assert len(warnings) == 1 and "gpu_class: no GPU of class 'H1OO'" in warnings[0]
    assert warnings[0].endswith("(known: H100)")  # not "unknown", the placeholder of a lost GPU
    json.loads(r.stdout)  # stdout stays clean JSON


MULTI_NODE_CATALOG = """
models:
  - name: big
    replicas: 1
    profiles:
      - {name: h100-2x8, engine: vllm, model: /m, gpu_class: H100, gpus: 8, nodes: 2}
"""


def test_inventory_fabric_overrides_the_fabric_recorded_with_the_facts(tmp_path: Path) -> None:
    # Both nodes were discovered on ib-a; the operator has since moved gpu-02 to ib-b.
    inv, cat, facts = write_inputs(tmp_path, [dgx("gpu-01"), dgx("gpu-02")], catalog=MULTI_NODE_CATALOG)
    both_a = (
        "nodes:\n  - {name: gpu-01, host: 10.0.0.1, fabric: ib-a}\n  - {name: gpu-02, host: 10.0.0.2, fabric: ib-a}\n"
    )
    inv.write_text(both_a)
    r = place(tmp_path, "--dry-run", "-i", str(inv), "-c", str(cat), "--facts", str(facts), "-o", "json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["replicas"][0]["fabric"] == "ib-a"
    inv.write_text(both_a.replace("10.0.0.2, fabric: ib-a", "10.0.0.2, fabric: ib-b"))
    r = place(tmp_path, "--dry-run", "-i", str(inv), "-c", str(cat), "--facts", str(facts), "-o", "json")
    assert r.exit_code == 3, r.output  # no fabric has two nodes now: never one replica across ib-a and ib-b
    doc = json.loads(r.stdout)
    assert doc["replicas"] == [] and doc["unplaced"][0]["model"] == "big"
    # A per-HCA override counts as a declaration too: all of gpu-02's rails on ib-a again.
    over = "{" + ", ".join(f"mlx5_{i}: ib-a" for i in range(8)) + "}"
    inv.write_text(both_a.replace("10.0.0.2, fabric: ib-a", f"10.0.0.2, fabric: ib-b, hca_fabrics: {over}"))
    r = place(tmp_path, "--dry-run", "-i", str(inv), "-c", str(cat), "--facts", str(facts), "-o", "json")
    assert r.exit_code == 0, r.output


def test_a_fabric_whose_ports_see_two_sms_hosts_no_multi_node_replica(tmp_path: Path) -> None:
    def on_sm(n: NodeFacts, sm: int) -> NodeFacts:
        return replace(n, hcas=tuple(replace(h, sm_guid=sm) for h in n.hcas))

    nodes = [on_sm(dgx("gpu-01"), 0xA1), on_sm(dgx("gpu-02"), 0xA1), on_sm(dgx("gpu-03"), 0xB2)]
    inv, cat, facts = write_inputs(tmp_path, nodes, catalog=MULTI_NODE_CATALOG.replace("replicas: 1", "replicas: 2"))
    inv.write_text("nodes:\n" + "".join(f"  - {{name: gpu-0{i}, host: 10.0.0.{i}, fabric: ib-a}}\n" for i in (1, 2, 3)))
    r = place(tmp_path, "--dry-run", "-i", str(inv), "-c", str(cat), "--facts", str(facts), "-o", "json")
    assert r.exit_code == 3, r.output
    assert "warning: fabric conflict: fabric ib-a: gpu-01 mlx5_0 sees SM 0x00000000000000a1 but gpu-03" in r.stderr
    doc = json.loads(r.stdout)
    (placed,) = doc["replicas"]
    assert {s["node"] for s in placed["shards"]} == {"gpu-01", "gpu-02"}  # the two that agree
    reasons = {x["node"]: x["detail"] for x in doc["unplaced"][0]["reasons"]}
    assert reasons["gpu-03"].startswith("8 Active InfiniBand ports in fabric conflict, so on no fabric: 8 ports (")
    assert "each sees SM 0x00000000000000b2 but fabric ib-a is declared" in reasons["gpu-03"]


def test_one_machine_under_two_names_in_the_facts_is_placed_once_and_explained(tmp_path: Path) -> None:
    h1 = dgx("h1")
    h2 = replace(dgx("h2"), gpus=h1.gpus)  # one box, discovered under two inventory names
    inv, cat, facts = write_inputs(tmp_path, [h1, h2], catalog=GPU_ONLY.format(replicas=2))
    inv.write_text("nodes:\n  - {name: h2, host: 10.0.0.2}\n  - {name: h1, host: 10.0.0.1}\n")
    r = place(tmp_path, "--dry-run", "-i", str(inv), "-c", str(cat), "--facts", str(facts))
    assert r.exit_code == 3, r.output
    assert "+ replica 0: tp8 (vllm) h2 GPU 0-7" in r.stdout  # h2 comes first in the inventory
    assert "h1: 8 GPUs (GPU-h1-0, GPU-h1-1, GPU-h1-2 and 5 more) are also node h2's" in r.stdout
    assert "1 node filtered: duplicate 1" in r.stdout


def test_a_wrong_subnet_prefix_in_the_inventory_is_one_warning(tmp_path: Path) -> None:
    nodes = [replace(n, hcas=tuple(replace(h, subnet_prefix=0xFEC0_0000_0000_0001) for h in n.hcas))
             for n in (dgx("gpu-01"), dgx("gpu-02"))]  # fmt: skip
    inv, cat, facts = write_inputs(tmp_path, nodes, catalog=MULTI_NODE_CATALOG)
    inv.write_text(
        "fabrics: {ib-a: {subnet_prefix: 'fec0:0000:0000:0002'}}\n"
        "nodes:\n  - {name: gpu-01, host: 10.0.0.1, fabric: ib-a}\n  - {name: gpu-02, host: 10.0.0.2, fabric: ib-a}\n"
    )
    r = place(tmp_path, "--dry-run", "-i", str(inv), "-c", str(cat), "--facts", str(facts), "-o", "json")
    (line,) = [x for x in r.stderr.splitlines() if "fabric conflict" in x]
    assert "fabric ib-a: 16 ports on 2 nodes (gpu-01, gpu-02) have subnet prefix fec0:0000:0000:0001" in line


def test_verbose_explains_every_candidate_on_stderr(tmp_path: Path) -> None:
    nodes = [dgx("gpu-01", cpus=8), dgx("gpu-02", cordoned=True), cpu_node("cpu-01", cpus=8)]
    inv, cat, facts = write_inputs(tmp_path, nodes)
    args = ["--dry-run", "-i", str(inv), "-c", str(cat), "--facts", str(facts)]
    quiet = place(tmp_path, *args)
    r = runner.invoke(app, ["-v", "--state", str(tmp_path / "state.db"), "place", *args])
    assert r.exit_code == quiet.exit_code == 3
    assert r.stdout == quiet.stdout  # the plan itself is unchanged
    err = [x for x in r.stderr.splitlines() if not x.startswith("warning:")]
    assert err[0] == "model 'llama-70b':"
    at = err.index("  replica 0, profile h100-tp8 (8x H100): placed on gpu-01 (1 of 3 nodes fit)")
    assert err[at + 1 : at + 4] == [
        "    cpu-01: rejected by gpu-class: no GPU, profile needs H100",
        "    gpu-01: chosen (8 H100 free); scores binpack 1, nvlink 1, final 1",
        "    gpu-02: rejected: cordoned (maintenance)",
    ]
    assert "  replica 1, profile h100-tp8 (8x H100): not placed (0 of 3 nodes fit on their own)" in err
    assert "    gpu-01: rejected by capacity: 0 of 8 H100 free (8 allocated), profile needs 8" in err
    assert "    cpu-01: rejected by capacity: 8 of 8 CPUs unreserved, profile needs 32" in err
    assert "model 'llama-70b':" not in quiet.stderr


def test_a_gpu_classes_alias_that_matches_nothing_is_flagged_once(tmp_path: Path) -> None:
    inv, cat, facts = write_inputs(tmp_path, [dgx("gpu-01"), dgx("gpu-02")], catalog=GPU_ONLY.format(replicas=1))
    product = dgx("gpu-01").gpus[0].product
    inv.write_text(
        f"gpu_classes:\n  H100: ['{product}']\n  B200: ['NVIDIA B200 HMB3']\n"
        "nodes:\n  - {name: gpu-01, host: 10.0.0.1}\n  - {name: gpu-02, host: 10.0.0.2}\n"
    )
    r = place(tmp_path, "--dry-run", "-i", str(inv), "-c", str(cat), "--facts", str(facts), "-o", "json")
    assert r.exit_code == 0, r.output
    (line,) = [x for x in r.stderr.splitlines() if "gpu_classes" in x]
    assert line == (
        f"warning: {inv}: line 3: gpu_classes.B200: no GPU in the facts is 'NVIDIA B200 HMB3' "
        f"(products seen: {product!r})"
    )
    json.loads(r.stdout)


def test_planning_with_another_inventory_than_discover_used_is_warned_of(tmp_path: Path) -> None:
    inv, cat, _ = write_inputs(tmp_path, [dgx("gpu-01"), dgx("gpu-02")])
    with Store(tmp_path / "state.db") as s:
        s.save_discovery([dgx("gpu-01"), dgx("gpu-02")], inventory=inv.resolve())
    other = tmp_path / "other.yaml"
    other.write_text(inv.read_text())
    r = place(tmp_path, "--dry-run", "-c", str(cat), "-i", str(inv), "-o", "json")
    assert "recorded inventory" not in r.stderr  # the same one: nothing to say
    r = place(tmp_path, "--dry-run", "-c", str(cat), "-i", str(other), "-o", "json")
    assert r.exit_code in (0, 3) and json.loads(r.stdout)["replicas"]
    assert f"{other}: the state's recorded inventory is {inv.resolve()}" in " ".join(r.stderr.split())


def test_a_facts_file_planned_with_another_clusters_state_says_whose_cordons_apply(tmp_path: Path) -> None:
    """An exported CLUSTERCTL_STATE of another cluster lends its cordons to this plan's
    namesakes: the warning says so, and which state (it was silent)."""
    inv, cat, facts = write_inputs(tmp_path, [dgx("gpu-01"), dgx("gpu-02")])
    other = tmp_path / "elsewhere" / "inventory.yaml"
    other.parent.mkdir()
    other.write_text(inv.read_text())
    with Store(tmp_path / "state.db") as s:
        s.save_discovery([dgx("gpu-01")], inventory=other.resolve())
        s.cordon("gpu-01", "their maintenance")
    r = place(tmp_path, "--dry-run", "-i", str(inv), "-c", str(cat), "--facts", str(facts), "-o", "json")
    said = " ".join(r.stderr.split())
    assert r.exit_code in (0, 3)
    assert (
        f"{inv}: cordons and replicas come from the state {tmp_path / 'state.db'}, whose recorded inventory is {other.resolve()}"
        in said
    )
    with Store(tmp_path / "state.db") as s:
        s.save_discovery([dgx("gpu-01")], inventory=inv.resolve())
    r = place(tmp_path, "--dry-run", "-i", str(inv), "-c", str(cat), "--facts", str(facts), "-o", "json")
    assert "cordons and replicas come from" not in r.stderr  # its own state: nothing to say


@pytest.mark.slow
@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
@pytest.mark.parametrize("fmt", ["json", "table"])
def test_output_that_cannot_be_written_is_one_error_line(tmp_path: Path, fmt: str) -> None:
    """stdout on a full disk (``> file``): one error line and exit 2, not a 100-line traceback."""
    import subprocess
    import sys

    inv, cat, facts = write_inputs(tmp_path, [dgx("gpu-01")])
    argv = ["--state", str(tmp_path / "s.db"), "place", "--dry-run", "-i", str(inv), "-c", str(cat),
            "--facts", str(facts), "-o", fmt]  # fmt: skip
    with open("/dev/full", "w") as full:
        r = subprocess.run([sys.executable, "-m", "cluster_cli", *argv], stdout=full, stderr=subprocess.PIPE, text=True)
    assert r.returncode == 2
    assert r.stderr.splitlines()[-1] == "error: cannot write the output: No space left on device"
    assert "Traceback" not in r.stderr


def test_a_class_missing_because_a_nodes_nvidia_smi_failed_says_so(tmp_path: Path) -> None:
    """With the only H100 node's nvidia-smi failing, the catalog's H100 class looked like a typo."""
    blind = replace(dgx("gpu-02"), gpus=(), problems=("nvidia-smi: failed (rc 9): NVIDIA driver is not loaded",))
    cpu = cpu_node("cpu-01")
    inv, cat, facts = write_inputs(tmp_path, [blind, cpu], catalog=GPU_ONLY.format(replicas=1))
    r = place(tmp_path, "--dry-run", "-i", str(inv), "-c", str(cat), "--facts", str(facts))
    warning = next(line for line in r.stderr.splitlines() if "gpu_class" in line)
    assert "no GPU of class 'H100'" in warning and "GPUs not known on gpu-02 (nvidia-smi failed" in warning


def test_cordoned_node_without_facts_is_explained_as_cordoned(tmp_path: Path) -> None:
    inv, cat, _ = write_inputs(
        tmp_path,
        [],
        inventory_nodes=["h1"],
        catalog="models:\n  - {name: m, profiles: [{name: p, engine: vllm, gpu_class: H100, model: /m}]}\n",
    )
    r = runner.invoke(
        app, ["--state", str(tmp_path / "state.db"), "cordon", "h1", "-i", str(inv), "--reason", "RMA 4411"]
    )
    assert r.exit_code == 0
    r = place(tmp_path, "--dry-run", "-i", str(inv), "-c", str(cat), "-o", "json")
    assert r.exit_code == 3, r.output
    (u,) = json.loads(r.stdout)["unplaced"]
    (reason,) = u["reasons"]
    assert (reason["constraint"], reason["detail"]) == (
        "cordoned",
        "cordoned (RMA 4411); also unreachable: no facts (not discovered yet)",
    )
    assert u["attempts"][0]["metrics"]["filtered_by"] == {"cordoned": 1}
    assert u["attempts"][0]["placed"] is False and u["attempts"][0]["summary"].startswith("0/")


def test_unplaced_replicas_list_their_attempts_like_placed_ones(tmp_path: Path) -> None:
    inv, cat, facts = write_inputs(tmp_path, [dgx("gpu-01", cordoned=True)])
    r = runner.invoke(app, ["--state", str(tmp_path / "s.db"), "place", "--dry-run", "-i", str(inv), "-c", str(cat),
                            "--facts", str(facts), "-o", "json"])  # fmt: skip
    assert r.exit_code == 3, r.output
    for u in json.loads(r.stdout)["unplaced"]:
        assert "profiles" not in u
        assert {a["profile"] for a in u["attempts"]} == {"h100-tp8", "a100-2x8", "cpu"}
        for a in u["attempts"]:
            assert set(a) == {"profile", "placed", "metrics", "summary"} and a["placed"] is False


# --------------------------------------------------------------------------- facts files


def _facts(tmp_path: Path, doc: object, cat: str) -> object:
    inv, catp, _ = write_inputs(tmp_path, [cpu_node("n1")], catalog=cat)
    f = tmp_path / "f.json"
    f.write_text(json.dumps(doc))
    return runner.invoke(
        app,
        ["--state", str(tmp_path / "s.db"), "place", "--dry-run", "-i", str(inv), "-c", str(catp), "--facts", str(f)],
    )


H100_CAT = """
engines: {vllm: {command: vllm}}
models:
  - name: m
    replicas: 1
    profiles:
      - {name: h, engine: vllm, gpu_class: H100 80GB HBM3, gpus: 8, model: /m}
"""


def test_facts_without_a_class_get_the_products_class(tmp_path: Path) -> None:
    gpus = [{"index": i, "uuid": f"GPU-{i}", "product": "NVIDIA H100 80GB HBM3"} for i in range(8)]
    r = _facts(tmp_path, {"nodes": [{"name": "n1", "cpus": 64, "memory_mib": 1 << 20, "gpus": gpus}]}, H100_CAT)
    assert r.exit_code == 0, r.output
    assert "n1 GPU 0-7" in r.stdout


@pytest.mark.parametrize(
    ("doc", "field"),
    [
        ({"name": "n1", "cpus": 16, "memory_mib": 65536, "problems": [5]}, "problems"),
        ({"name": "n1", "hcas": [{"name": "mlx5_0", "port": 1, "state": "Active", "link_layer": "InfiniBand", "fabric": 5}]}, "fabric"),
        ({"name": "n1", "labels": {"rack": 3}}, "labels"),
        ({"name": "n1", "gpus": [{"index": 0, "uuid": "G", "product": "P", "problems": [1]}]}, "problems"),
        ({"name": "n1", "hcas": [{"name": "mlx5_0", "port": 1, "sm_lid": "x"}]}, "sm_lid"),
        ({"name": "n1", "hcas": [{"name": "mlx5_0", "port": 1, "sm_guid": [1]}]}, "sm_guid"),
        ({"name": "n1", "hcas": [{"name": "mlx5_0", "port": 1, "sm_guid": 1.5}]}, "sm_guid"),
        ({"name": "n1", "hcas": [{"name": "mlx5_0", "port": 1, "port_guid": 1.5}]}, "port_guid"),
        ({"name": "n1", "hcas": [{"name": "mlx5_0", "port": 1, "port_guid": "0xzz"}]}, "port_guid"),
        ({"name": "n1", "nvlink_domains": "0123"}, "nvlink_domains"),
        ({"name": "n1", "cordoned": True, "cordon_reason": 5}, "cordon_reason"),
        ({"name": "n1", "reachable": False, "error": 5}, "error"),
        ({"name": "n1", "gpus": [{"index": 0, "uuid": "G", "product": "P", "class": 5}]}, "class"),
        ({"name": "n1", "gpus": [{"index": 0, "uuid": "G", "product": "P", "processes": [{"pid": "x"}]}]}, "processes"),
        ({"name": "n1", "hcas": [{"name": "mlx5_0", "port": 1, "rate_gbps": "x"}]}, "rate_gbps"),
        ({"name": "n1", "nvlink_domains": [[0, True]]}, "nvlink_domains"),
    ],
)  # fmt: skip
def test_facts_of_the_wrong_type_are_a_one_line_error(tmp_path: Path, doc: dict, field: str) -> None:
    r = _facts(tmp_path, {"nodes": [doc]}, H100_CAT)
    assert r.exit_code == 2, r.output
    (line,) = r.output.strip().splitlines()
    assert "f.json: nodes.0 (n1): invalid facts: " in line and f"{field}: expected" in line


def test_a_cordoned_gpu_takes_nothing_new_and_says_why(tmp_path: Path) -> None:
    inv, cat, facts = write_inputs(tmp_path, [dgx("gpu-01")], catalog=GPU_ONLY.format(replicas=1))
    r = runner.invoke(app, ["--state", str(tmp_path / "state.db"), "cordon", "gpu-01", "-i", str(inv),
                            "--gpu", "3", "--reason", "Xid 79"])  # fmt: skip
    assert r.exit_code == 0 and "gpu-01 GPU 3 cordoned: Xid 79" in r.output
    r = place(tmp_path, "--dry-run", "-i", str(inv), "-c", str(cat), "--facts", str(facts))
    assert r.exit_code == 3 and "7 of 8 H100 free (1 cordoned)" in r.output, r.output
    small = GPU_ONLY.format(replicas=1).replace("gpus: 8", "gpus: 4")
    cat.write_text(small)
    r = place(tmp_path, "--dry-run", "-i", str(inv), "-c", str(cat), "--facts", str(facts), "-o", "json")
    assert r.exit_code == 0, r.output
    (p,) = json.loads(r.stdout)["replicas"]
    assert 3 not in p["shards"][0]["gpus"]  # the rest of the node stays in service
    r = runner.invoke(app, ["--state", str(tmp_path / "state.db"), "uncordon", "gpu-01", "--gpu", "3"])
    assert r.exit_code == 0 and "gpu-01 GPU 3 uncordoned" in r.output
    cat.write_text(GPU_ONLY.format(replicas=1))
    assert place(tmp_path, "--dry-run", "-i", str(inv), "-c", str(cat), "--facts", str(facts)).exit_code == 0


def test_a_gpu_the_node_does_not_have_cannot_be_cordoned(tmp_path: Path) -> None:
    inv, _, _ = write_inputs(tmp_path, [dgx("gpu-01")])
    with Store(tmp_path / "state.db") as s:
        s.save_discovery([dgx("gpu-01")], inventory=inv)
    r = runner.invoke(app, ["--state", str(tmp_path / "state.db"), "cordon", "gpu-01", "--gpu", "9", "--reason", "x"])
    assert r.exit_code == 2 and "gpu-01 has no GPU 9 (its GPUs: 0, 1, 2, 3, 4, 5, 6, 7)" in r.output


def test_a_gpu_cordon_survives_a_new_discovery_and_stays_out_of_the_facts(tmp_path: Path) -> None:
    with Store(tmp_path / "state.db") as s:
        s.save_discovery([dgx("gpu-01")])
        s.cordon_gpu("gpu-01", 2, "flaky NVLink")
        (f,) = s.nodes()
        assert f.gpus[2].problems == ("cordoned: flaky NVLink",) and f.gpus[2].healthy and not f.gpus[2].free
        s.save_discovery([f])  # what was read back, written again: the cordon is not baked in
        s.uncordon_gpu("gpu-01", 2)
        (f,) = s.nodes()
        assert f.gpus[2].free
        s.cordon_gpu("gpu-01", 2, "again")
        s.save_discovery([dgx("gpu-01")])  # a fresh discovery keeps it
        (f,) = s.nodes()
        assert f.gpus[2].problems == ("cordoned: again",)
        kinds = [e.message for e in s.events() if e.kind in ("cordon", "uncordon")]
    assert kinds == ["GPU 2: flaky NVLink", "GPU 2: cordon lifted", "GPU 2: again"]
