"""Load YAML files into pydantic models with one-line, located errors."""

from __future__ import annotations

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
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            mark = key_node.start_mark
            raise ConfigError(f"line {mark.line + 1}: duplicate key {key!r}")
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


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
    text = read_text(path, data)
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


def format_validation_error(path: Path | str, err: ValidationError, most: int = 3) -> str:
    """Pydantic errors as ``file: field.path: message`` on one line (up to ``most``, then a count)."""
    parts = []
    errors = err.errors()
    for e in errors[:most]:
        loc = ".".join(str(p) for p in e["loc"])
        msg = str(e["msg"]).removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        if not loc:
            loc, _, rest = msg.partition(": ") if ": " in msg else ("(top level)", "", msg)
            msg = rest
        parts.append(f"{loc}: {msg}")
    more = len(errors) - most
    suffix = f" (and {more} more error{'s' if more > 1 else ''})" if more > 0 else ""
    return f"{path}: {'; '.join(parts)}{suffix}"


def load_model(path: Path | str, model: type[M], raw: bytes | None = None) -> M:
    """Read YAML at ``path`` (or ``raw``, its bytes already read) and validate it as ``model``."""
    path = Path(path)
    data = read_yaml(path, raw)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(path, e)) from None
    except ConfigError as e:
        raise ConfigError(f"{path}: {e.message}") from None
