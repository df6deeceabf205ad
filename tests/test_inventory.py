"""Inventory loading: valid files, and every kind of bad input as a one-line located error."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster_cli.config.inventory import ACCEPT_NEW, load_inventory
from cluster_cli.errors import ConfigError

GOOD = """
defaults: {user: root, port: 22, identity_file: keys/id, known_hosts: ~/.ssh/known_hosts}
ssh_config: ssh_config
gpu_classes: {H100: ["NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe"]}
fabrics: {ib-a: {}, ib-b: {}}
nodes:
  - {name: gpu-01, host: 10.0.0.11, port: 2222, user: ops, identity_file: /abs/id, fabric: ib-a, labels: {rack: r1}}
  - {name: gpu-02, host: 10.0.0.12, fabric: ib-b, hca_fabrics: {mlx5_3: ib-a}, known_hosts: accept-new}
"""


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "inventory.yaml"
    p.write_text(text)
    return p


def test_good_inventory_resolves_paths_and_defaults(tmp_path: Path) -> None:
    inv = load_inventory(write(tmp_path, GOOD))
    a, b = (inv.ssh_target(n) for n in inv.nodes)
    assert (a.port, a.user, a.identity_file) == (2222, "ops", "/abs/id")
    assert b.port == 22 and b.user == "root"
    assert b.identity_file == str(tmp_path / "keys/id")
    assert b.known_hosts == ACCEPT_NEW
    assert a.known_hosts.endswith("/.ssh/known_hosts") and not a.known_hosts.startswith("~")
    assert a.ssh_config == str(tmp_path / "ssh_config")
    assert inv.gpu_class("NVIDIA H100 PCIe") == "H100"
    assert inv.gpu_class("NVIDIA A100 80GB PCIe") == "A100 80GB PCIe"
    assert inv.fabric_for(inv.nodes[1], "mlx5_3") == "ib-a"
    assert inv.fabric_for(inv.nodes[1], "mlx5_0") == "ib-b"


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("nodes: [{name: a, host: h}\n", "invalid YAML"),
        ("nodes:\n  - {name: a, host: h, colour: red}\n", "line 2 (a): nodes.0.colour: unknown key"),
        ("nodez: []\n", "line 1: nodez: unknown key"),
        ("base_dir: /elsewhere\nnodes: []\n", "line 1: base_dir: unknown key"),  # internal, not a key
        (
            "nodes:\n  - {name: a, host: h}\n  - {name: a, host: g}\n",
            "line 3 (a): nodes.1.name: duplicate node name 'a'",
        ),
        ("nodes:\n  - name: a\n    host: h\n\n    colour: red\n", "line 5 (a): nodes.0.colour: unknown key"),
        ("nodes:\n  - {name: a}\n", "line 2 (a): nodes.0.host: Field required"),
        ("nodes:\n  - {name: a, host: h, port: 70000}\n", "nodes.0.port"),
        # Not coerced: `true` would be port 1, "22" and 22.0 are typos of a number.
        ("nodes:\n  - {name: a, host: h, port: true}\n", "line 2 (a): nodes.0.port: Input should be a valid integer"),
        ("nodes:\n  - {name: a, host: h, port: '22'}\n", "nodes.0.port: Input should be a valid integer"),
        ("defaults: {port: 22.0}\nnodes: []\n", "line 1: defaults.port: Input should be a valid integer"),
        (
            "defaults: {connect_timeout_s: yes}\nnodes: []\n",
            "defaults.connect_timeout_s: Input should be a valid number",
        ),
        # A merge key may be overridden, but a key written twice is still a duplicate.
        (
            "nodes:\n  - &b {name: a, host: h}\n  - <<: *b\n    name: b\n    name: c\n",
            "line 5: duplicate key 'name'",
        ),
        ("fabrics: {ib-a: {}}\nnodes:\n  - {name: a, host: h, fabric: ib-z}\n", "unknown fabric 'ib-z'"),
        ("nodes:\n  - {name: 'bad name', host: h}\n", "invalid node name"),
        ("- just\n- a list\n", "expected a mapping"),
        ("defaults: {user: a}\ndefaults: {user: b}\n", "duplicate key 'defaults'"),
        ("gpu_classes: {A: [X], B: [X]}\n", "listed under both"),
        # "unknown" is what a lost GPU's class reads: no real class may take that name.
        ("gpu_classes: {unknown: [X]}\nnodes:\n  - {name: a, host: h}\n", "gpu_classes.unknown: the class name"),
        ("gpu_classes: {' ': [X]}\nnodes:\n  - {name: a, host: h}\n", "is empty"),
        ("defaults: {connect_timeout_s: .inf}\nnodes:\n  - {name: a, host: h}\n", "defaults.connect_timeout_s"),
        ("defaults: {command_timeout_s: .nan}\nnodes:\n  - {name: a, host: h}\n", "defaults.command_timeout_s"),
        ("nodes:\n  - {name: a, host: 2024-13-01}\n", "invalid YAML: month must be in 1..12"),
        ("{[1]: x}\n", "invalid YAML: a mapping key must be a plain value"),
        (
            "fabrics: {ib-a: {subnet_prefix: nope}}\nnodes:\n  - {name: a, host: h}\n",
            "line 1: fabrics.ib-a.subnet_prefix",
        ),
    ],
)
def test_bad_inventory_is_one_located_line(tmp_path: Path, text: str, needle: str) -> None:
    p = write(tmp_path, text)
    with pytest.raises(ConfigError) as ei:
        load_inventory(p)
    msg = str(ei.value)
    assert needle in msg
    assert msg.startswith(str(p))
    assert "\n" not in msg


def test_yaml_merge_keys_share_settings_and_the_written_keys_win(tmp_path: Path) -> None:
    p = write(
        tmp_path,
        "nodes:\n  - &base {name: a, host: h1, port: 2222, labels: {rack: r1}}\n  - <<: *base\n    name: b\n    host: h2\n",
    )
    a, b = load_inventory(p).nodes
    assert (a.name, a.host, a.port, a.labels) == ("a", "h1", 2222, {"rack": "r1"})
    assert (b.name, b.host, b.port, b.labels) == ("b", "h2", 2222, {"rack": "r1"})


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="file not found"):
        load_inventory(tmp_path / "nope.yaml")


_scalars = st.one_of(st.none(), st.booleans(), st.integers(-5, 70000), st.text(max_size=6))
_keys = st.sampled_from(["name", "host", "port", "user", "fabric", "labels", "colour", "nodes", "defaults", "x"])
_docs = st.recursive(
    _scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(_keys, inner, max_size=4)),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(
    nodes=st.lists(st.dictionaries(_keys, _docs, max_size=5), max_size=3), top=st.dictionaries(_keys, _docs, max_size=2)
)
def test_any_inventory_loads_or_is_one_located_line(tmp_path_factory: pytest.TempPathFactory, nodes, top) -> None:
    p = tmp_path_factory.mktemp("inv") / "inventory.yaml"
    p.write_text(yaml.safe_dump({**top, "nodes": nodes}, default_flow_style=False))
    try:
        load_inventory(p)
    except ConfigError as e:
        msg = str(e)
        assert msg.startswith(f"{p}: ") and "\n" not in msg
        line = re.match(rf"{re.escape(str(p))}: line ([0-9]+)", msg)
        if line:  # a line it names is in the file
            assert 1 <= int(line.group(1)) <= len(p.read_text().splitlines())


def test_subnet_prefixes_in_every_spelling_and_fabrics_without_settings(tmp_path: Path) -> None:
    text = (
        "fabrics:\n  ib-a: {subnet_prefix: 0xfec0000000000001}\n  ib-b: {subnet_prefix: 1000:0:0:1}\n"
        "  ib-c: {subnet_prefix: 'fec0:0000:0000:0003'}\n  ib-d:\n  ib-e: {}\nnodes:\n  - {name: a, host: h}\n"
    )
    inv = load_inventory(write(tmp_path, text))  # unquoted hex is a YAML int; 1000:0:0:1 is not base 60 here
    assert inv.declared_prefixes() == {
        "ib-a": 0xFEC0_0000_0000_0001,
        "ib-b": 0x1000_0000_0000_0001,
        "ib-c": 0xFEC0_0000_0000_0003,
    }
    assert inv.fabrics["ib-b"].subnet_prefix == "1000:0000:0000:0001"
    with pytest.raises(ConfigError, match="subnet_prefix"):
        load_inventory(
            write(tmp_path, "fabrics: {ib-a: {subnet_prefix: 0x1fec0000000000001}}\nnodes: [{name: a, host: h}]\n")
        )


@pytest.mark.parametrize(
    ("nodes", "found"),
    [
        ("  - {name: h1, host: 198.18.0.10}\n  - {name: h2, host: 198.18.0.10}\n",
         (1, "198.18.0.10:22 is also node h1's")),
        ("  - {name: h1, host: Gpu-01.Lab, port: 2222}\n  - {name: h2, host: gpu-01.lab, port: 2222}\n",
         (1, "gpu-01.lab:2222 is also node h1's")),
        ("  - {name: h1, host: 'fd00::1'}\n  - {name: h2, host: 'fd00::2'}\n  - {name: h3, host: 'fd00::1', port: 22}\n",
         (2, "[fd00::1]:22 is also node h1's")),
    ],
)  # fmt: skip
def test_one_machine_under_two_names_is_found(tmp_path: Path, nodes: str, found: tuple[int, str]) -> None:
    p = write(tmp_path, "defaults: {user: root}\nnodes:\n" + nodes)
    # A warning (discover prints it), not an error: inventories for place --facts may use
    # placeholder hosts, and placement takes a GPU UUID seen on two nodes once.
    assert load_inventory(p).shared_addresses() == [found]


def test_same_host_on_other_ports_or_behind_ssh_config_is_not_a_duplicate(tmp_path: Path) -> None:
    two_ports = "nodes:\n  - {name: h1, host: 198.18.0.10}\n  - {name: h2, host: 198.18.0.10, port: 2222}\n"
    assert load_inventory(write(tmp_path, two_ports)).shared_addresses() == []
    # ssh_config may set the port of a node that leaves it unset: compared as written, unset != 22.
    cfg = "ssh_config: cfg\nnodes:\n  - {name: h1, host: box}\n  - {name: h2, host: box, port: 22}\n"
    assert load_inventory(write(tmp_path, cfg)).shared_addresses() == []
    assert load_inventory(write(tmp_path, cfg.replace("box, port: 22", "box"))).shared_addresses() == [
        (1, "box is also node h1's")
    ]


@pytest.mark.parametrize(
    ("host", "ok"),
    [
        ("10.0.0.1:22", False),
        ("gpu-01:2222", False),
        ("[2001:db8::5", False),
        ("[2001:db8::5]:22", False),
        ("fe80::1", True),
        ("2001:db8::5", True),
        ("[2001:db8::5]", True),
    ],
)
def test_a_port_written_into_host_is_refused(tmp_path: Path, host: str, ok: bool) -> None:
    p = write(tmp_path, f"nodes:\n  - {{name: a, host: '{host}'}}\n")
    if ok:
        # Brackets are how URLs and known_hosts write an IPv6 address: the host is the address
        # (given as "[::1]" it was handed to the resolver as is, and never connected).
        assert load_inventory(p).nodes[0].host == host.strip("[]")
        return
    with pytest.raises(ConfigError, match=r"invalid host .*: give the port as port:, not in host:"):
        load_inventory(p)


def test_one_ipv6_address_bracketed_or_not_is_one_machine(tmp_path: Path) -> None:
    p = write(tmp_path, "nodes:\n  - {name: a, host: '::1'}\n  - {name: b, host: '[::1]'}\n")
    assert load_inventory(p).shared_addresses() != []


def test_a_node_name_over_63_characters_says_so(tmp_path: Path) -> None:
    p = write(tmp_path, f"nodes:\n  - {{name: {'n' * 64}, host: h}}\n")
    with pytest.raises(ConfigError, match="64 characters, at most 63"):
        load_inventory(p)


def test_a_node_name_with_a_newline_is_named_on_one_line(tmp_path: Path) -> None:
    """The error names the list item by its name: a name that holds a newline is shown
    escaped, so the error stays one line."""
    p = tmp_path / "inventory.yaml"
    p.write_text(yaml.safe_dump({"nodes": [{"name": "\n"}]}, default_flow_style=False))
    with pytest.raises(ConfigError) as e:
        load_inventory(p)
    assert "\n" not in str(e.value) and "('\\n')" in str(e.value), str(e.value)


def test_log_max_mib_defaults_to_64_and_a_node_may_set_its_own(tmp_path: Path) -> None:
    inv = load_inventory(write(tmp_path, "nodes:\n  - {name: a, host: h}\n  - {name: b, host: g, log_max_mib: 0.5}\n"))
    a, b = inv.nodes
    assert (inv.log_max_mib(a), inv.log_max_bytes(a)) == (64, 64 << 20)
    assert (inv.log_max_mib(b), inv.log_max_bytes(b)) == (0.5, 512 << 10)
    inv = load_inventory(write(tmp_path, "defaults: {log_max_mib: 8}\nnodes:\n  - {name: a, host: h}\n"))
    assert inv.log_max_bytes(inv.nodes[0]) == 8 << 20


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("defaults: {log_max_mib: 0}\nnodes:\n  - {name: a, host: h}\n", "line 1: defaults.log_max_mib: Input should be greater than 0"),
        ("nodes:\n  - {name: a, host: h, log_max_mib: -1}\n", "line 2 (a): nodes.0.log_max_mib: Input should be greater than 0"),
        ("nodes:\n  - {name: a, host: h, log_max_mib: '64'}\n", "nodes.0.log_max_mib: Input should be a valid number"),
        ("nodes:\n  - {name: a, host: h, log_max_mib: true}\n", "nodes.0.log_max_mib: Input should be a valid number"),
        ("defaults: {log_max_mib: .inf}\nnodes:\n  - {name: a, host: h}\n", "defaults.log_max_mib: Input should be a finite number"),
    ],
)  # fmt: skip
def test_a_bad_log_max_mib_is_one_located_line(tmp_path: Path, text: str, needle: str) -> None:
    p = write(tmp_path, text)
    with pytest.raises(ConfigError) as ei:
        load_inventory(p)
    assert str(ei.value).startswith(f"{p}: ") and needle in str(ei.value), str(ei.value)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ('nodes:\n  - {name: "gpu-01\\n", host: h}\n', "nodes.0.name: invalid node name 'gpu-01\\n'"),
        (
            'defaults: {run_dir: "/r\\r"}\nnodes:\n  - {name: a, host: h}\n',
            "defaults.run_dir: run_dir: give a folder path (no newline, NUL or other",
        ),
        ('nodes:\n  - {name: a, host: h, run_dir: "/r\\e[2J"}\n', "nodes.0.run_dir: run_dir: give a folder path"),
    ],
)
def test_a_control_character_in_a_node_name_or_run_dir_is_refused(tmp_path: Path, text: str, needle: str) -> None:
    p = write(tmp_path, text)
    with pytest.raises(ConfigError) as ei:
        load_inventory(p)
    assert needle in str(ei.value) and str(ei.value).isprintable(), str(ei.value)


def test_max_channels_reaches_each_nodes_ssh_target(tmp_path: Path) -> None:
    p = tmp_path / "inventory.yaml"
    p.write_text(
        "defaults: {max_channels: 6}\nnodes:\n  - {name: a, host: h1}\n  - {name: b, host: h2, max_channels: 3}\n"
    )
    inv = load_inventory(p)
    assert [inv.ssh_target(n).max_channels for n in inv.nodes] == [6, 3]
    p.write_text("nodes:\n  - {name: a, host: h1, max_channels: 0}\n")
    with pytest.raises(ConfigError, match="max_channels"):
        load_inventory(p)
