"""Pure parsers for ``ibstat`` and ``sminfo`` output.

``key: value`` lines are read after stripping, so tab- and space-indented copies parse
alike. GUIDs become ints (0 means "none"); LIDs are decimal. Nothing here raises.
"""

from __future__ import annotations

import re

from cluster_cli.facts import HcaPort

__all__ = ["parse_gid_prefix", "parse_guid", "parse_ibstat", "parse_sminfo"]

_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?|\x1b[@-Z\\-_]")
_CA = re.compile(r"CA\s+'([^']*)'")
_PORT = re.compile(r"Port\s+([0-9]{1,6})\s*:")
_KEY_VALUE = re.compile(r"([A-Za-z][A-Za-z ]*):(.*)")
_HEX_GUID = re.compile(r"0[xX]([0-9A-Fa-f]{1,16})")
_COLON_GUID = re.compile(r"[0-9A-Fa-f]{1,4}(?::[0-9A-Fa-f]{1,4}){3}")
_RATE = re.compile(r"([0-9]{1,6}(?:\.[0-9]{1,6})?)(?:\s|\(|$)")  # "400", "2.5", "40 (FDR10)"
_LID = re.compile(r"(?:0[xX]([0-9A-Fa-f]{1,8})|([0-9]{1,8}))")
_SMINFO = re.compile(r"sm\s+lid\s+\S+\s+sm\s+guid\s+0[xX]([0-9A-Fa-f]{1,16})\b(?P<rest>.*)", re.IGNORECASE)
_GID = re.compile(r"[0-9A-Fa-f]{1,4}(?::[0-9A-Fa-f]{1,4}){7}")
_SM_STATE = re.compile(r"\bstate\s+[0-9]+\s+(SMINFO_[A-Z_]+)", re.IGNORECASE)


def parse_guid(value: str | None) -> int | None:
    """``0x58a2e103001b2576``, ``0x2c90200259201`` or ``c470:bd03:00cf:4964`` -> int; 0/junk -> None."""
    if not isinstance(value, str):
        return None
    v = value.strip()
    m = _HEX_GUID.fullmatch(v)
    if m:
        guid = int(m.group(1), 16)
    elif _COLON_GUID.fullmatch(v):
        guid = int("".join(part.rjust(4, "0") for part in v.split(":")), 16)
    else:
        return None
    return guid or None


def _rate(value: str) -> float | None:
    m = _RATE.match(value.strip())
    return float(m.group(1)) if m else None


def _link_up(port: dict[str, str]) -> bool:
    """The port has a link, so its rate is the negotiated one. On a port that is Down, or
    whose physical link is not up (Disabled, Polling, ...), ibstat prints a default rate."""
    phys = port.get("physical state", "").strip().lower()
    return port.get("state", "").strip().lower() != "down" and phys in ("linkup", "")


def _lid(value: str) -> int | None:
    m = _LID.fullmatch(value.strip())
    if not m:
        return None
    return int(m.group(1), 16) if m.group(1) is not None else int(m.group(2))


def _plain(text: str) -> str:
    """Without terminal escapes and carriage returns (both are rare: skip the work then)."""
    if "\x1b" in text:
        text = _ANSI.sub("", text)
    return text.replace("\r", "") if "\r" in text else text


def parse_ibstat(text: str) -> list[HcaPort]:
    """Every port of every CA in ``ibstat`` output, in output order (``fabric``/``sm_guid`` unset)."""
    if not isinstance(text, str):
        return []
    ports: list[HcaPort] = []
    ca: str | None = None
    ca_type: str | None = None
    port: dict[str, str] | None = None
    port_no = 0

    def flush() -> None:
        if ca is not None and port is not None:
            ports.append(
                HcaPort(
                    ca=ca,
                    port=port_no,
                    state=port.get("state", ""),
                    physical_state=port.get("physical state", ""),
                    link_layer=port.get("link layer", ""),
                    rate_gbps=_rate(port.get("rate", "")) if _link_up(port) else None,
                    port_guid=parse_guid(port.get("port guid")),
                    base_lid=_lid(port.get("base lid", "")),
                    sm_lid=_lid(port.get("sm lid", "")),
                    ca_type=ca_type,
                )
            )

    for raw in _plain(text).split("\n"):
        line = raw.strip()
        first = line[:1]
        m = _CA.fullmatch(line) if first == "C" else None
        if m:
            flush()
            ca, ca_type, port = m.group(1), None, None
            continue
        m = _PORT.fullmatch(line) if first == "P" else None
        if m:
            flush()
            port, port_no = ({} if ca is not None else None), int(m.group(1))
            continue
        if ca is None:
            continue
        m = _KEY_VALUE.fullmatch(line)
        if not m:
            continue
        key, value = m.group(1).strip().lower(), m.group(2).strip()
        if port is not None:
            port.setdefault(key, value)
        elif key == "ca type":
            ca_type = value or None
    flush()
    return ports


def parse_sminfo(text: str) -> int | None:
    """Master SM port GUID from ``sminfo`` (None if absent, zero, or the SM is not MASTER)."""
    if not isinstance(text, str):
        return None
    for line in _plain(text).split("\n"):
        m = _SMINFO.search(line)
        if not m:
            continue
        state = _SM_STATE.search(m.group("rest"))
        if state and state.group(1).upper() != "SMINFO_MASTER":
            return None
        return int(m.group(1), 16) or None
    return None


def parse_gid_prefix(text: str) -> int | None:
    """Subnet prefix (upper 64 bits) of a port's GID 0, as sysfs ``gids/0`` shows it
    (``fe80:0000:0000:0000:c470:bd03:00cf:4964``); None if absent, malformed or all zero."""
    if not isinstance(text, str):
        return None
    line = _plain(text).strip().split("\n", 1)[0].strip()
    if not _GID.fullmatch(line):
        return None
    groups = [int(g, 16) for g in line.split(":")]
    if not any(groups):
        return None  # a port that has no GID yet
    prefix = 0
    for g in groups[:4]:
        prefix = (prefix << 16) | g
    return prefix
