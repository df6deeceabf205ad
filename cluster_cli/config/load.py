"""Load YAML files into pydantic models with one-line, located errors."""

from __future__ import annotations

import re
from pathlib import Path
from typing import TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from cluster_cli.errors import ConfigError

M = TypeVar("M", bound=BaseModel)


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate mapping keys instead of keeping the last."""


def _construct_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: set = set()
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue  # `<<: *base`: its keys may be overridden by the ones written here
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            mark = key_node.start_mark
            raise ConfigError(f"line {mark.line + 1}: duplicate key {key!r}")
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)

# YAML 1.1 reads colon-separated digits as base-60 numbers (``1000:0:0:1`` -> 216000001, a
# subnet prefix or a MAC turned into an int); YAML 1.2 dropped that. Resolve ints and floats
# without it, so such a value stays the string it was written as.
_INT = re.compile(r"^(?:[-+]?0b[0-1_]+|[-+]?0[0-7_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+)$")
_FLOAT = re.compile(
    r"^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+][0-9]+)?|\.[0-9][0-9_]*(?:[eE][-+][0-9]+)?"
    r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
)
_UniqueKeyLoader.yaml_implicit_resolvers = {
    first: [
        (tag, _INT if tag == "tag:yaml.org,2002:int" else _FLOAT if tag == "tag:yaml.org,2002:float" else rx)
        for tag, rx in resolvers
    ]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}


def read_text(path: Path | str, data: bytes | None = None) -> str:
    """The file's text (or ``data``, bytes already read from it); a problem is a ConfigError."""
    try:
        raw = Path(path).read_bytes() if data is None else data
        return raw.decode("utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start})") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, not a file") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror or e}") from None


def read_yaml(path: Path | str, data: bytes | None = None) -> object:
    """Parse a YAML file (or ``data``, its bytes already read); any problem becomes
    ConfigError naming the file and line."""
    return _parse_yaml(path, read_text(path, data))


def _parse_yaml(path: Path | str, text: str) -> object:
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e.message}") from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise ConfigError(f"{path}: {where}invalid YAML: {e.problem}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {e}") from None
    except TypeError as e:  # a list or mapping used as a key: unhashable
        raise ConfigError(f"{path}: invalid YAML: a mapping key must be a plain value ({e})") from None
    except RecursionError:
        raise ConfigError(f"{path}: invalid YAML: nested too deeply") from None
    except ValueError as e:  # a value PyYAML's resolver cannot build, e.g. the date 2024-13-01
        raise ConfigError(f"{path}: invalid YAML: {e}") from None


def _locate(root: yaml.Node | None, loc: tuple[object, ...], at_key: bool) -> tuple[int | None, str | None]:
    """The 1-based line of ``loc`` in a composed YAML tree (the key's line when ``at_key``, as
    for an unknown key; else the value's), and the ``name`` of the last list item passed
    through, if it has one. Stops at the deepest part of ``loc`` that the tree has."""
    node, line, name = root, None, None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            hit = next(
                (kv for kv in node.value if isinstance(kv[0], yaml.ScalarNode) and kv[0].value == str(part)), None
            )
            if hit is None:
                break
            line = (hit[0] if at_key else hit[1]).start_mark.line + 1
            node = hit[1]
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and 0 <= part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
            if isinstance(node, yaml.MappingNode):
                named = next((v for k, v in node.value if isinstance(k, yaml.ScalarNode) and k.value == "name"), None)
                name = named.value if isinstance(named, yaml.ScalarNode) else None
        else:
            break
    return line, name


def value_line(path: Path | str, loc: tuple[str | int, ...]) -> int | None:
    """The 1-based line where the YAML file at ``path`` gives the value at ``loc`` (e.g.
    ``("defaults", "identity_file")``), or None when it does not give it (or cannot be read)."""
    try:
        root = yaml.compose(Path(path).read_text(encoding="utf-8"), Loader=yaml.SafeLoader)
    except (OSError, UnicodeDecodeError, yaml.YAMLError, RecursionError, ValueError, TypeError):
        return None
    node = root
    for part in loc:  # only a path the file has all the way down has a line
        if isinstance(node, yaml.MappingNode):
            node = next((v for k, v in node.value if isinstance(k, yaml.ScalarNode) and k.value == str(part)), None)
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and 0 <= part < len(node.value):
            node = node.value[part]
        else:
            node = None
        if node is None:
            return None
    return None if node is None else node.start_mark.line + 1


def format_validation_error(path: Path | str, err: ValidationError, most: int = 3, text: str | None = None) -> str:
    """Pydantic errors as ``file: line N (item name): field.path: message`` on one line (up to
    ``most``, then a count). The line (and a list item's name) needs ``text``, the YAML read."""
    root = None
    if text is not None:
        try:
            root = yaml.compose(text, Loader=yaml.SafeLoader)
        except (yaml.YAMLError, RecursionError, ValueError, TypeError):
            root = None
    parts = []
    errors = err.errors()
    for e in errors[:most]:
        loc = ".".join(str(p) for p in e["loc"])
        msg = str(e["msg"]).removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        if not loc:  # a model-level check names its field in the message: "nodes.1.name: ..."
            loc, _, rest = msg.partition(": ") if ": " in msg else ("(top level)", "", msg)
            msg = rest
        path_parts = tuple(int(p) if p.isdigit() else p for p in loc.split("."))
        line, name = _locate(root, path_parts, at_key=e["type"] == "extra_forbidden")
        if name and not name.isprintable():  # a name with a newline in it: one line all the same
            name = repr(name)
        where = " ".join(x for x in (f"line {line}" if line is not None else "", f"({name})" if name else "") if x)
        parts.append(f"{where + ': ' if where else ''}{loc}: {msg}")
    more = len(errors) - most
    suffix = f" (and {more} more error{'s' if more > 1 else ''})" if more > 0 else ""
    return f"{path}: {'; '.join(parts)}{suffix}"


def load_model(path: Path | str, model: type[M], raw: bytes | None = None) -> M:
    """Read YAML at ``path`` (or ``raw``, its bytes already read) and validate it as ``model``."""
    path = Path(path)
    text = read_text(path, raw)
    data = _parse_yaml(path, text)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(path, e, text=text)) from None
    except ConfigError as e:
        raise ConfigError(f"{path}: {e.message}") from None
