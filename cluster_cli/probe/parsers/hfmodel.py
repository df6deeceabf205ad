"""The shape of a Hugging Face model folder from its ``config.json`` (what vLLM loads).

Pure: the file's text in, :class:`HfShape` out. The weights' size is the sum of the
folder's ``*.safetensors`` files, which the node reports with it (the index's
``total_size`` is the same number less the headers). Multimodal and other nested configs
keep the language model's numbers under ``text_config`` (or ``llm_config``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# torch_dtype -> bytes per element: what the KV cache uses unless --kv-cache-dtype says otherwise
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}


class HfConfigError(ValueError):
    """config.json is not a JSON object, or lacks what a KV-cache estimate needs."""


@dataclass(frozen=True)
class HfShape:
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    max_context: int | None = None
    dtype_bytes: int = 2
    experts: int | None = None
    model_type: str | None = None

    def kv_bytes_per_token(self, bytes_per_element: float | None = None) -> int:
        """K and V of one token across every layer (at the model's dtype unless given)."""
        b = self.dtype_bytes if bytes_per_element is None else bytes_per_element
        return round(2 * self.layers * self.kv_heads * self.head_dim * b)


def _int(cfg: dict[str, Any], *keys: str) -> int | None:
    for k in keys:
        v = cfg.get(k)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def parse_hf_config(text: str) -> HfShape:
    """Read the numbers a memory estimate needs from ``config.json``'s text."""
    try:
        cfg = json.loads(text)
    except ValueError as e:
        raise HfConfigError(f"config.json is not JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise HfConfigError("config.json is not a JSON object")
    for nested in ("text_config", "llm_config", "language_config"):
        inner = cfg.get(nested)
        if isinstance(inner, dict) and "num_hidden_layers" in inner:
            cfg = {**cfg, **inner}
            break
    layers = _int(cfg, "num_hidden_layers", "n_layer", "num_layers")
    heads = _int(cfg, "num_attention_heads", "n_head")
    hidden = _int(cfg, "hidden_size", "n_embd", "d_model")
    if layers is None or heads is None:
        raise HfConfigError("config.json gives no num_hidden_layers or num_attention_heads")
    head_dim = _int(cfg, "head_dim") or (hidden // heads if hidden else None)
    if head_dim is None:
        raise HfConfigError("config.json gives neither head_dim nor hidden_size")
    kv_heads = _int(cfg, "num_key_value_heads", "n_head_kv") or heads
    dtype = cfg.get("torch_dtype") or cfg.get("dtype")
    return HfShape(
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        max_context=_int(cfg, "max_position_embeddings", "n_positions", "seq_length"),
        dtype_bytes=DTYPE_BYTES.get(dtype, 2) if isinstance(dtype, str) else 2,
        experts=_int(cfg, "num_local_experts", "num_experts", "n_routed_experts"),
        model_type=cfg.get("model_type") if isinstance(cfg.get("model_type"), str) else None,
    )
