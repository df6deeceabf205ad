"""The catalog: which models to serve, how many replicas, and the ways each can run.

```yaml
engines:
  vllm:     {command: vllm}
  llamacpp: {command: llama-server}
models:
  - name: llama-70b
    replicas: 2
    profiles:                      # alternatives; the highest priority that fits wins
      - {name: h100-tp8, engine: vllm, gpu_class: H100, gpus: 8, priority: 100, model: /models/llama-70b}
      - {name: a100-2x8, engine: vllm, gpu_class: A100, gpus: 8, nodes: 2, priority: 50, model: /models/llama-70b}
      - {name: cpu, engine: llamacpp, cpus: 32, memory_gib: 64, priority: 1, model: /models/llama-70b.Q4_K_M.gguf}
```

``model`` (required) is what the engine loads: a path on the nodes or a hub id
(``vllm serve MODEL``, ``llama-server -m FILE``). ``gpus`` is GPUs per node (default 1 when ``gpu_class`` is set); ``nodes`` (default 1)
is the number of nodes of one multi-node replica. A profile without ``gpu_class``
runs on the CPU; only engines that can serve without a card accept that, so a
vLLM profile that forgot its class is an error here rather than a replica on a
machine with no GPU. ``cpus``/``memory_gib`` are what a CPU replica reserves on its
node; a GPU profile may not set them (they would not be checked). Numbers are strict
(``replicas: true`` or ``'2'`` is an error), and ``gpu_class: unknown`` is refused: it is
the placeholder class of a lost GPU. Profiles of equal priority are tried in the order they are written.

What reaches a node's start script (names, ``model``, ``args``, ``env``, an engine's
``command`` and ``args``) may hold no control character (a newline, ``\r``, ESC, a tab:
anything not printable). ``args`` that look like secrets (``--api-key``, ``--hf-token``,
``--token``, ``--password``, ``...token=...``, ``...key=...``) are refused: a command line
is readable by every user of the node, where the profile's ``env`` reaches it only in a
0600 file.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from cluster_cli.config.load import load_model
from cluster_cli.engines import ENGINES, MetricMapping, get_engine
from cluster_cli.facts import UNREAD

# fullmatch, not match: "$" also matches before a trailing newline.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Options that carry a secret as their value (compared with '_' as '-', in lower case).
_SECRET_OPTIONS = ("--api-key", "--hf-token", "--token", "--password")


def _check_name(v: str) -> str:
    if (problem := _control(v)) is not None:
        raise ValueError(f"invalid name: {problem}")
    if not _NAME.fullmatch(v):
        raise ValueError(f"invalid name {v!r}: use letters, digits, '.', '_', '-' (at most 63)")
    return v


def _control(v: str) -> str | None:
    """What is wrong with ``v`` if it holds a control character (not its text: it may be a
    secret), else None."""
    if v.isprintable():
        return None
    at, c = next((i, c) for i, c in enumerate(v) if not c.isprintable())
    return f"holds a control character (U+{ord(c):04X} at character {at + 1}), which nothing sent to a node may hold"


def _secret_option(arg: str) -> str | None:
    """The option ``arg`` gives a secret with (``--api-key`` of ``--api-key=...``), else None."""
    low = arg.lower()
    name = low.split("=", 1)[0]
    if name.replace("_", "-") in _SECRET_OPTIONS or "token=" in low or "key=" in low:
        return name
    return None


def _check_text(where: str, v: str | None) -> None:
    if v is not None and (problem := _control(v)) is not None:
        raise ValueError(f"{where}: {problem}")


def _check_args(where: str, args: list[str]) -> None:
    for k, a in enumerate(args):
        _check_text(f"{where}.{k}", a)
        if (name := _secret_option(a)) is not None:
            raise ValueError(
                f"{where}.{k}: {name!r} looks like a secret, and a command line is readable by every user "
                "of the node: put it in the profile's env (e.g. HF_TOKEN, VLLM_API_KEY, LLAMA_API_KEY), "
                "which reaches the node only in a 0600 file"
            )


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class EngineConfig(_Strict):
    """How to start an engine on a node: the binary and extra arguments for every replica."""

    command: str = Field(min_length=1)
    args: list[str] = Field(default_factory=list)
    # The engine's metric names for the router (running, waiting, kv_cache_usage); unset: the adapter's.
    metrics: dict[str, str | None] | None = None
    # What the engine holds beyond weights and KV cache, per GPU (CUDA context, activations,
    # graphs); unset: placement.fit.ENGINE_OVERHEAD_GIB's measured default.
    overhead_gib: float | None = Field(default=None, ge=0, allow_inf_nan=False, strict=True)

    @field_validator("metrics")
    @classmethod
    def _metrics(cls, v: dict[str, str | None] | None) -> dict[str, str | None] | None:
        return MetricMapping.checked(v)


class Profile(_Strict):
    """One way to run a model: engine, hardware per node, nodes per replica, priority."""

    name: str
    engine: str
    gpu_class: str | None = None
    # Numbers are numbers: strict, so `true` is not read as 1 nor '2' as 2 (as in the inventory).
    gpus: int | None = Field(default=None, gt=0, strict=True)
    nodes: int = Field(default=1, gt=0, strict=True)
    cpus: int | None = Field(default=None, gt=0, strict=True)
    memory_gib: float | None = Field(default=None, gt=0, allow_inf_nan=False, strict=True)
    priority: int = Field(default=0, strict=True)
    model: str | None = None  # path or hub id the engine loads: required (the catalog checks it)
    args: list[str] = Field(default_factory=list)
    # The engine's environment (an HF_TOKEN): written to a 0600 file on the node, never put on
    # a command line nor shown by clusterctl.
    env: dict[str, str] = Field(default_factory=dict)
    port: int | None = Field(default=None, ge=1, le=65535, strict=True)  # fixed HTTP port; unset: from the node's range
    # The model's size where its files are not on the nodes yet (else they are read there):
    # weights in GiB, and the KV cache per 1,000 tokens of context at the engine's default dtype.
    weights_gib: float | None = Field(default=None, gt=0, allow_inf_nan=False, strict=True)
    kv_gib_per_1k_tokens: float | None = Field(default=None, ge=0, allow_inf_nan=False, strict=True)

    @field_validator("env")
    @classmethod
    def _env_names(cls, v: dict[str, str]) -> dict[str, str]:
        for k in v:
            if (problem := _control(k)) is not None:
                raise ValueError(f"env: invalid variable name {k!r}: {problem}")
            if not _ENV_NAME.fullmatch(k):
                raise ValueError(f"env: invalid variable name {k!r} (letters, digits and _, not starting with a digit)")
        return v

    @field_validator("name")
    @classmethod
    def _name_ok(cls, v: str) -> str:
        return _check_name(v)

    @field_validator("memory_gib")
    @classmethod
    def _at_least_a_mib(cls, v: float | None) -> float | None:
        if v is not None and round(v * 1024) < 1:
            raise ValueError("memory_gib must be at least 1 MiB (0.001)")
        return v

    @field_validator("gpu_class")
    @classmethod
    def _class_not_blank(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            raise ValueError("gpu_class must not be empty (omit it for a CPU profile)")
        if v == UNREAD:
            raise ValueError(
                f"{UNREAD!r} is reserved: it marks lost GPUs whose product could not be read, which are never placeable"
            )
        return v

    # ---- derived ----------------------------------------------------------
    @property
    def gpus_per_node(self) -> int:
        """GPUs each shard needs: ``gpus``, else 1 for a GPU profile and 0 on the CPU."""
        if self.gpus is not None:
            return self.gpus
        return 1 if self.gpu_class else 0

    @property
    def is_cpu(self) -> bool:
        return not self.gpu_class

    @property
    def memory_mib(self) -> int | None:
        return None if self.memory_gib is None else round(self.memory_gib * 1024)

    def describe(self) -> str:
        """Short human form: ``8x H100``, ``2 nodes x 8x A100``, ``cpu 32 cpus 64 GiB``."""
        if self.is_cpu:
            parts = ["cpu"]
            if self.cpus:
                parts.append(f"{self.cpus} cpus")
            if self.memory_gib:
                parts.append(f"{self.memory_gib:g} GiB")
            return " ".join(parts)
        per = f"{self.gpus_per_node}x {self.gpu_class}"
        return f"{self.nodes} nodes x {per}" if self.nodes > 1 else per


class Model(_Strict):
    name: str
    replicas: int = Field(default=1, gt=0, strict=True)
    profiles: list[Profile] = Field(min_length=1)

    @field_validator("name")
    @classmethod
    def _name_ok(cls, v: str) -> str:
        return _check_name(v)

    def ordered_profiles(self) -> list[Profile]:
        """Highest priority first; equal priorities keep the order they are written in."""
        return sorted(self.profiles, key=lambda p: -p.priority)  # sorted() is stable

    def profile(self, name: str) -> Profile | None:
        return next((p for p in self.profiles if p.name == name), None)


class Catalog(_Strict):
    engines: dict[str, EngineConfig] = Field(default_factory=dict)
    models: list[Model] = Field(default_factory=list)

    @model_validator(mode="after")
    def _check(self) -> Catalog:
        known = ", ".join(sorted(ENGINES))
        declared = "engines" in self.model_fields_set
        for name, cfg in self.engines.items():
            if get_engine(name) is None:
                raise ValueError(f"engines.{name}: unknown engine {name!r} (known: {known})")
            _check_text(f"engines.{name}.command", cfg.command)
            _check_args(f"engines.{name}.args", cfg.args)
        seen_models: dict[str, int] = {}
        for i, m in enumerate(self.models):
            if m.name in seen_models:
                raise ValueError(
                    f"models.{i}.name: duplicate model name {m.name!r} (also models.{seen_models[m.name]})"
                )
            seen_models[m.name] = i
            seen_profiles: dict[str, int] = {}
            for j, p in enumerate(m.profiles):
                where = f"models.{i}.profiles.{j}"
                # All of it goes into the node's start script (the names into its folder's).
                for key in ("engine", "gpu_class", "model"):
                    _check_text(f"{where}.{key}", getattr(p, key))
                _check_args(f"{where}.args", p.args)
                for k, v in p.env.items():
                    _check_text(f"{where}.env.{k}", v)
                if p.name in seen_profiles:
                    raise ValueError(
                        f"{where}.name: duplicate profile name {p.name!r} in model {m.name!r} "
                        f"(also profiles.{seen_profiles[p.name]})"
                    )
                seen_profiles[p.name] = j
                engine = get_engine(p.engine)
                if engine is None:
                    raise ValueError(f"{where}.engine: unknown engine {p.engine!r} (known: {known})")
                if declared and p.engine not in self.engines:
                    # A catalog that lists its engines lists every one it uses: a profile naming
                    # another is a slip (its command would be a guess), not a default.
                    raise ValueError(
                        f"{where}.engine: {p.engine!r} is not in this catalog's engines "
                        f"({', '.join(self.engines) or 'none'}); add it there, or leave engines out for the defaults"
                    )
                problem = engine.validate_profile(gpu_class=p.gpu_class, gpus=p.gpus_per_node, nodes=p.nodes)
                if problem:
                    raise ValueError(f"{where}{_field_of(problem, p)}: {problem}")
                if p.gpus is not None and not p.gpu_class:
                    raise ValueError(f"{where}.gpus: a profile that asks for GPUs must name its gpu_class")
                if p.gpu_class:
                    # Reserved only on the CPU: a GPU profile's host CPUs and memory are not
                    # checked nor reserved, so accepting them would promise what is not done.
                    for key in ("cpus", "memory_gib"):
                        if getattr(p, key) is not None:
                            raise ValueError(
                                f"{where}.{key}: only a CPU profile (no gpu_class) reserves {key}; "
                                f"a GPU profile ({p.gpu_class}) is placed by its GPUs alone: remove {key}"
                            )
                if not (p.model or "").strip():
                    # What the engine loads: vllm serve MODEL, llama-server -m FILE. A catalog name
                    # (no '/') is neither a GGUF file nor a hub id with its organisation.
                    example = "/models/llama-70b.Q4_K_M.gguf" if p.engine == "llamacpp" else "/models/llama-70b"
                    state = "missing" if p.model is None else "empty"
                    raise ValueError(
                        f"{where}.model: {state}: the path or hub id {p.engine} loads is required (e.g. {example})"
                    )
        return self

    def model(self, name: str) -> Model | None:
        return next((m for m in self.models if m.name == name), None)

    def to_doc(self) -> dict[str, Any]:
        """The catalog as a document that reads back as the same catalog (what the state
        keeps): only what was given, so that an ``engines`` left out stays left out."""
        return self.model_dump(mode="json", exclude_unset=True)

    def command(self, engine: str) -> str:
        """The binary of ``engine`` (the catalog's ``command``, else the adapter's default name)."""
        cfg = self.engines.get(engine)
        if cfg is not None:
            return cfg.command
        return {"llamacpp": "llama-server"}.get(engine, engine)


def _field_of(problem: str, p: Profile) -> str:
    """Best guess at the field an adapter's complaint is about, for the error location."""
    if "gpu_class" in problem:
        return ".gpu_class"
    if "node" in problem and p.nodes > 1:
        return ".nodes"
    if "gpu" in problem.lower():
        return ".gpus"
    return ""


def load_catalog(path: Path | str) -> Catalog:
    """Read and validate a catalog; errors are one line: ``file: field.path: message``."""
    return load_model(Path(path), Catalog)
