"""Tests for cluster_cli.probe.parsers.ibstat (ibstat, sminfo, GUID notations)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from fuzz import mutated
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster_cli.facts import HcaPort
from cluster_cli.probe.parsers.ibstat import parse_gid_prefix, parse_guid, parse_ibstat, parse_sminfo

FIXTURES = Path(__file__).parent / "fixtures" / "probes"
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def fx(name: str) -> str:
    return (FIXTURES / name).read_text()


def ndr(ca: str, guid: int, lid: int) -> HcaPort:
    return HcaPort(ca, 1, "Active", "LinkUp", "InfiniBand", 400.0, guid, lid, 1024, "MT4129")


def roce(ca: str, state: str, phys: str, rate: float | None) -> HcaPort:
    return HcaPort(ca, 1, state, phys, "Ethernet", rate, None, 0, 0, "MT4125")


HGX_12CA = [
    ndr("mlx5_0", 0x58A2E103001B2576, 287),
    roce("mlx5_1", "Down", "Disabled", None),  # ibstat prints "Rate: 40" for a port without a link
    ndr("mlx5_10", 0x58A2E103001A691E, 284),
    ndr("mlx5_11", 0x58A2E103001B2542, 254),
    roce("mlx5_2", "Down", "Disabled", None),
    ndr("mlx5_3", 0x58A2E103001A690A, 286),
    ndr("mlx5_4", 0x58A2E103001B25AE, 239),
    ndr("mlx5_5", 0x58A2E103001B2586, 238),
    ndr("mlx5_6", 0x58A2E103001B258A, 285),
    roce("mlx5_7", "Active", "LinkUp", 100.0),
    roce("mlx5_8", "Active", "LinkUp", 100.0),
    ndr("mlx5_9", 0x58A2E103001B25D6, 457),
]
CX4_INIT = [HcaPort("mlx5_0", 1, "Initializing", "LinkUp", "InfiniBand", 100.0, 0x248A07030049AEE0, 65535, 0, None)]
RXE0 = [HcaPort("rxe0", 1, "Active", "LinkUp", "Ethernet", 2.5, 0x4A51C5FFFEF6E159, 0, 0, None)]

IBSTAT_EXPECTED = {
    "ibstat.hgx-h100-12ca-ib-plus-roce.txt": HGX_12CA,
    "ibstat.cx4-initializing-no-sm.txt": CX4_INIT,
    "ibstat.rxe0-softroce-ethernet.txt": RXE0,
}


def test_every_ibstat_fixture_is_covered() -> None:
    assert sorted(p.name for p in FIXTURES.glob("ibstat.*")) == sorted(IBSTAT_EXPECTED)


@pytest.mark.parametrize(("fixture", "expected"), sorted(IBSTAT_EXPECTED.items()))
def test_ibstat_fixtures(fixture: str, expected: list[HcaPort]) -> None:
    ports = parse_ibstat(fx(fixture))
    assert ports == expected
    assert all(p.fabric is None and p.sm_guid is None for p in ports)


@pytest.mark.parametrize(("fixture", "expected"), sorted(IBSTAT_EXPECTED.items()))
def test_ibstat_tabs_spaces_crlf_alike(fixture: str, expected: list[HcaPort]) -> None:
    text = fx(fixture)
    as_tabs = re.sub(r"^ +", lambda m: "\t" * (len(m.group(0)) // 8 or 1), text, flags=re.MULTILINE)
    as_spaces = text.expandtabs(8)
    for variant in (as_tabs, as_spaces, text.replace("\n", "\r\n"), "\n".join(ln.strip() for ln in text.split("\n"))):
        assert parse_ibstat(variant) == expected


def test_ca_order_is_output_order() -> None:
    """ibstat sorts CAs lexicographically (mlx5_10 before mlx5_2); keep that order, drop nothing."""
    assert [p.ca for p in parse_ibstat(fx("ibstat.hgx-h100-12ca-ib-plus-roce.txt"))][:4] == [
        "mlx5_0",
        "mlx5_1",
        "mlx5_10",
        "mlx5_11",
    ]


def test_ib_attachments() -> None:
    ports = parse_ibstat(fx("ibstat.hgx-h100-12ca-ib-plus-roce.txt"))
    assert [p.ca for p in ports if p.is_ib_attachment] == [
        "mlx5_0",
        "mlx5_10",
        "mlx5_11",
        "mlx5_3",
        "mlx5_4",
        "mlx5_5",
        "mlx5_6",
        "mlx5_9",
    ]
    assert not parse_ibstat(fx("ibstat.cx4-initializing-no-sm.txt"))[0].is_ib_attachment
    assert not parse_ibstat(fx("ibstat.rxe0-softroce-ethernet.txt"))[0].is_ib_attachment


def test_ibstat_p_lists_the_nonzero_port_guids() -> None:
    """The derived `ibstat -p` (zero GUIDs skipped) agrees with the parsed ports; as ibstat input it is empty."""
    listed = [int(x, 16) for x in fx("ibstat-p.hgx-h100-12ca.DERIVED.txt").split()]
    parsed = [p.port_guid for p in parse_ibstat(fx("ibstat.hgx-h100-12ca-ib-plus-roce.txt")) if p.port_guid]
    assert listed == parsed
    assert parse_ibstat(fx("ibstat-p.hgx-h100-12ca.DERIVED.txt")) == []


@pytest.mark.parametrize(
    ("rate", "expected"),
    [("400", 400.0), ("2.5", 2.5), ("40 (FDR10)", 40.0), ("56", 56.0), ("", None), ("fast", None), ("1e3", None)],
)
def test_rate_forms(rate: str, expected: float | None) -> None:
    text = fx("ibstat.cx4-initializing-no-sm.txt").replace("Rate: 100", f"Rate: {rate}")
    assert parse_ibstat(text)[0].rate_gbps == expected


def test_missing_and_empty_ca_type() -> None:
    assert "CA type" not in fx("ibstat.cx4-initializing-no-sm.txt")
    assert "CA type:\n" in fx("ibstat.rxe0-softroce-ethernet.txt")
    assert parse_ibstat(fx("ibstat.cx4-initializing-no-sm.txt"))[0].ca_type is None
    assert parse_ibstat(fx("ibstat.rxe0-softroce-ethernet.txt"))[0].ca_type is None


def test_zero_port_guid_is_none() -> None:
    ports = {p.ca: p for p in parse_ibstat(fx("ibstat.hgx-h100-12ca-ib-plus-roce.txt"))}
    assert ports["mlx5_7"].port_guid is None and ports["mlx5_0"].port_guid == 0x58A2E103001B2576


def test_lids_are_decimal() -> None:
    (port,) = parse_ibstat(fx("ibstat.cx4-initializing-no-sm.txt"))
    assert port.base_lid == 65535 and port.sm_lid == 0
    assert parse_ibstat(fx("ibstat.hgx-h100-12ca-ib-plus-roce.txt"))[0].sm_lid == 1024


def test_multi_port_ca() -> None:
    text = (
        "CA 'mlx4_0'\n\tCA type: MT4099\n\tNumber of ports: 2\n"
        "\tPort 1:\n\t\tState: Active\n\t\tPhysical state: LinkUp\n\t\tRate: 40 (FDR10)\n\t\tBase lid: 3\n"
        "\t\tSM lid: 1\n\t\tPort GUID: 0x0002c90300a1b2c1\n\t\tLink layer: InfiniBand\n"
        "\tPort 2:\n\t\tState: Down\n\t\tPhysical state: Polling\n\t\tRate: 10\n\t\tBase lid: 0\n"
        "\t\tSM lid: 0\n\t\tPort GUID: 0x0002c90300a1b2c2\n\t\tLink layer: InfiniBand\n"
    )
    assert parse_ibstat(text) == [
        HcaPort("mlx4_0", 1, "Active", "LinkUp", "InfiniBand", 40.0, 0x0002C90300A1B2C1, 3, 1, "MT4099"),
        HcaPort("mlx4_0", 2, "Down", "Polling", "InfiniBand", None, 0x0002C90300A1B2C2, 0, 0, "MT4099"),
    ]


def test_port_without_fields_and_ca_without_ports() -> None:
    assert parse_ibstat("CA 'a'\n\tCA type: X\nCA 'b'\n\tPort 1:\n") == [HcaPort("b", 1, "")]


@pytest.mark.parametrize(
    "text",
    [
        "",
        "ibstat: command not found",
        "ibpanic: [12] main: stat of IB device 'mlx5_0' failed: No such file or directory",
        "\tPort 1:\n\t\tState: Active\n",  # port before any CA
    ],
)
def test_ibstat_no_cas(text: str) -> None:
    assert parse_ibstat(text) == []


def test_other_formats_are_not_misread() -> None:
    assert parse_ibstat(fx("ibstatus.cx7-hdr.txt")) == []
    assert parse_ibstat(fx("ibv_devinfo.cx7-vf-cloud-vm.txt")) == []
    assert parse_ibstat(fx("sysfs-infiniband.cx7-hdr.DERIVED.txt")) == []


# ----------------------------------------------------------------------------- sminfo / GUIDs


def test_sminfo_fixture() -> None:
    assert parse_sminfo(fx("sminfo.master.txt")) == 0x0002C90200259201


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "sminfo: sm lid 1 sm guid 0x2c90200259201, activity count 5 priority 0 state 3 SMINFO_MASTER",
            0x2C90200259201,
        ),
        (
            "sminfo: sm lid 1 sm guid 0x0002c90200259201, activity count 5 priority 0 state 3 SMINFO_MASTER\r\n",
            0x2C90200259201,
        ),
        ("sminfo: sm lid 1 sm guid 0x2c90200259201, activity count 5", 0x2C90200259201),
        ("sminfo: sm lid 1 sm guid 0x2c90200259201, activity count 5 priority 0 state 2 SMINFO_STANDBY", None),
        ("sminfo: sm lid 0 sm guid 0x0, activity count 0 priority 0 state 0 SMINFO_NOTACTIVE", None),
        (
            "ibwarn: [1234] mad_rpc_open_port: can't open UMAD port ((null):0)\nsminfo: iberror: failed: Failed to open",
            None,
        ),
        ("", None),
    ],
)
def test_sminfo_cases(text: str, expected: int | None) -> None:
    assert parse_sminfo(text) == expected


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("0x58a2e103001b2576", 0x58A2E103001B2576),
        ("0x2c90200259201", 0x0002C90200259201),
        ("0002:c902:0025:9201", 0x0002C90200259201),
        ("2:c902:25:9201", 0x0002C90200259201),
        ("0x0000000000000000", None),
        ("0x0", None),
        ("", None),
        ("N/A", None),
        ("0x12345678901234567", None),
        (None, None),
    ],
)
def test_guid_notations(value: str | None, expected: int | None) -> None:
    assert parse_guid(value) == expected


def test_guid_notations_from_fixtures_agree() -> None:
    """sysfs node_guid (colon form) and the gid's interface id denote the same integer."""
    sysfs = dict(line.split(": ", 1) for line in fx("sysfs-infiniband.cx7-hdr.DERIVED.txt").splitlines())
    node_guid = parse_guid(sysfs["/sys/class/infiniband/mlx5_0/node_guid"])
    gid = sysfs["/sys/class/infiniband/mlx5_0/ports/1/gids/0"]
    assert node_guid == 0xC470BD0300CF4964 == parse_guid(":".join(gid.split(":")[4:]))


# ----------------------------------------------------------------------------- properties

_states = st.sampled_from(["Active", "Down", "Initializing", "Armed"])
_phys = st.sampled_from(["LinkUp", "Disabled", "Polling"])


@st.composite
def hca_ports(draw: st.DrawFn) -> list[HcaPort]:
    out = []
    for c in range(draw(st.integers(0, 4))):
        ca = f"mlx5_{c}"
        ca_type = draw(st.one_of(st.none(), st.sampled_from(["MT4129", "MT4125", "MT4123"])))
        for port in range(1, draw(st.integers(1, 2)) + 1):
            state, phys = draw(_states), draw(_phys)
            rate = draw(st.sampled_from([2.5, 10.0, 40.0, 100.0, 200.0, 400.0, 800.0]))
            out.append(
                HcaPort(
                    ca=ca,
                    port=port,
                    state=state,
                    physical_state=phys,
                    link_layer=draw(st.sampled_from(["InfiniBand", "Ethernet"])),
                    # Without a link the rate printed is a default, not the port's: unknown.
                    rate_gbps=rate if state != "Down" and phys == "LinkUp" else None,
                    port_guid=draw(st.one_of(st.none(), st.integers(1, 2**64 - 1))),
                    base_lid=draw(st.integers(0, 65535)),
                    sm_lid=draw(st.integers(0, 65535)),
                    ca_type=ca_type,
                )
            )
    return out


def render_ibstat(ports: list[HcaPort], indent: str) -> str:
    lines: list[str] = []
    last_ca = None
    for p in ports:
        if p.ca != last_ca:
            last_ca = p.ca
            lines += [f"CA '{p.ca}'", f"{indent}CA type: {p.ca_type or ''}", f"{indent}Number of ports: 2"]
        rate = 40.0 if p.rate_gbps is None else p.rate_gbps  # what ibstat prints on a port without a link
        rate_s = str(int(rate)) if rate.is_integer() else str(rate)
        body = [
            f"State: {p.state}",
            f"Physical state: {p.physical_state}",
            f"Rate: {rate_s}",
            f"Base lid: {p.base_lid}",
            "LMC: 0",
            f"SM lid: {p.sm_lid}",
            "Capability mask: 0x2651e848",
            f"Port GUID: 0x{p.port_guid or 0:016x}",
            f"Link layer: {p.link_layer}",
        ]
        lines += [f"{indent}Port {p.port}:", *(indent * 2 + b for b in body)]
    return "\n".join(lines) + "\n"


@FUZZ
@given(hca_ports(), st.sampled_from(["\t", "        ", "  "]))
def test_render_parse_roundtrip(ports: list[HcaPort], indent: str) -> None:
    assert parse_ibstat(render_ibstat(ports, indent)) == ports


@FUZZ
@given(st.integers(1, 2**64 - 1))
def test_guid_roundtrip(guid: int) -> None:
    colon = ":".join(f"{guid:016x}"[i : i + 4] for i in range(0, 16, 4))
    assert parse_guid(f"0x{guid:016x}") == parse_guid(f"0x{guid:x}") == parse_guid(colon) == guid


_IB_TEXTS = [
    fx(f) for f in [*IBSTAT_EXPECTED, "sminfo.master.txt", "ibstatus.cx7-hdr.txt", "ibv_devinfo.cx7-vf-cloud-vm.txt"]
]


def _check(text: str) -> None:
    ports = parse_ibstat(text)
    assert all(isinstance(p, HcaPort) and p.port >= 0 for p in ports)
    assert all(p.port_guid is None or p.port_guid > 0 for p in ports)
    sm = parse_sminfo(text)
    assert sm is None or 0 < sm < 2**64
    parse_guid(text)


@FUZZ
@given(st.text())
def test_never_raises_on_text(text: str) -> None:
    _check(text)


@FUZZ
@given(mutated(_IB_TEXTS))
def test_never_raises_on_mutated_fixtures(text: str) -> None:
    _check(text)


@FUZZ
@given(st.binary(max_size=400))
def test_never_raises_on_binaryish(blob: bytes) -> None:
    _check(blob.decode("latin-1"))


def test_non_string_input() -> None:
    assert parse_ibstat(None) == [] and parse_sminfo(None) is None  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- GID 0 -> subnet prefix


def test_gid_prefix_from_the_sysfs_and_ibstatus_fixtures() -> None:
    sysfs = dict(line.split(": ", 1) for line in fx("sysfs-infiniband.cx7-hdr.DERIVED.txt").splitlines())
    assert parse_gid_prefix(sysfs["/sys/class/infiniband/mlx5_0/ports/1/gids/0"] + "\n") == 0xFE80_0000_0000_0000
    default_gid = next(x for x in fx("ibstatus.cx7-hdr.txt").splitlines() if "default gid" in x)
    assert parse_gid_prefix(default_gid.split("gid:", 1)[1]) == 0xFE80_0000_0000_0000  # gids/0, as ibstatus shows it


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("fec0:0000:0000:0001:58a2:e103:001b:2576\n", 0xFEC0_0000_0000_0001),
        ("FEC0:0:0:1:58a2:e103:1b:2576", 0xFEC0_0000_0000_0001),
        ("0000:0000:0000:0000:0000:0000:0000:0000\n", None),  # no GID yet
        ("fe80::1", None),  # sysfs never compresses: anything else is not a GID 0 line
        ("", None),
        ("cat: gids/0: No such file or directory", None),
    ],
)
def test_gid_prefix_cases(text: str, expected: int | None) -> None:
    assert parse_gid_prefix(text) == expected


_GID_TEXTS = [fx("sysfs-infiniband.cx7-hdr.DERIVED.txt"), fx("ibstatus.cx7-hdr.txt")]
_gids = st.integers(0, 2**128 - 1).map(lambda g: ":".join(f"{(g >> s) & 0xFFFF:x}" for s in range(112, -1, -16)))


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(max_size=80), _gids, mutated(_GID_TEXTS)))
def test_gid_prefix_never_raises(text: str) -> None:
    v = parse_gid_prefix(text)
    assert v is None or 0 <= v < 2**64


# Any GID's 8 groups, as sysfs writes them (4 digits each) or with leading zeros dropped, in
# either case, with or without the trailing newline: the prefix is the upper 64 bits of g,
# and only the all-zero GID (a port with none yet) has no prefix. A 0 prefix is still a prefix.
_gid_ints = st.one_of(st.integers(0, 2**128 - 1), st.integers(0, 2**64 - 1), st.sampled_from([0, 1, 2**64, 2**128 - 1]))


@settings(max_examples=300, deadline=None)
@given(_gid_ints, st.booleans(), st.booleans(), st.sampled_from(["", "\n", "\r\n"]))
def test_gid_prefix_is_the_upper_64_bits_of_the_gid(g: int, padded: bool, upper: bool, end: str) -> None:
    fmt = "{:04x}" if padded else "{:x}"
    text = ":".join(fmt.format((g >> s) & 0xFFFF) for s in range(112, -1, -16))
    text = (text.upper() if upper else text) + end
    assert parse_gid_prefix(text) == (None if g == 0 else g >> 64)


def test_hca_port_round_trips_its_subnet_prefix() -> None:
    h = HcaPort("mlx5_0", 1, "Active", link_layer="InfiniBand", subnet_prefix=0xFEC0_0000_0000_0001)
    d = h.to_dict()
    assert d["subnet_prefix"] == "fec0:0000:0000:0001" and HcaPort.from_dict(d) == h
    assert HcaPort.from_dict({**d, "subnet_prefix": None}).subnet_prefix is None
    with pytest.raises(ValueError, match="subnet_prefix"):
        HcaPort.from_dict({**d, "subnet_prefix": "fe80::"})


_IBSTAT = """CA 'mlx5_0'
\tCA type: MT4129
\tNumber of ports: 1
\tPort 1:
\t\tState: Active
\t\tPhysical state: LinkUp
\t\tRate: 400
\t\tBase lid: 0x1a
\t\tLMC: 0
\t\tSM lid: 0x10
\t\tCapability mask: 0xa751e84a
\t\tPort GUID: 0x58a2e103001b2576
\t\tLink layer: InfiniBand
"""


def test_ibstat_lids_printed_in_hex_are_read() -> None:
    (p,) = parse_ibstat(_IBSTAT)
    assert (p.base_lid, p.sm_lid) == (26, 16)
