"""Model sizes read on the nodes (a part of ``Store``): by model path or hub id, with the
listing they were read from, so that an unchanged model is not read again. Kept in the
``meta`` table (``model-size:MODEL``); a cache, not a decision: no state version."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from cluster_cli.facts import ModelSize
from cluster_cli.state.backend import Tx
from cluster_cli.state.meta import set_meta

_KEY = "model-size:"


class ModelSizes:
    """Mixed into ``Store``."""

    if TYPE_CHECKING:  # provided by Store

        def _read(self) -> Any: ...
        def _tx(self, *, bump: bool = False) -> Any: ...

    def model_sizes(self) -> dict[str, tuple[str, ModelSize]]:
        """Model -> (the listing's key, its size)."""
        with self._read() as tx:
            return _sizes(tx)

    def known_model_sizes(self) -> dict[str, ModelSize]:
        """Model -> its size, as last read (what ``place`` plans with: it reads no node)."""
        return {m: size for m, (_, size) in self.model_sizes().items()}

    def save_model_size(self, model: str, listing_key: str, size: ModelSize) -> None:
        with self._tx() as tx:
            set_meta(tx, _KEY + model, json.dumps({"listing": listing_key, "size": size.to_dict()}))


def _sizes(tx: Tx) -> dict[str, tuple[str, ModelSize]]:
    out = {}
    for key, value in tx.execute("SELECT key, value FROM meta WHERE key LIKE ?", (_KEY + "%",)).fetchall():
        try:
            doc = json.loads(value)
            out[key[len(_KEY) :]] = (str(doc["listing"]), ModelSize.from_dict(doc["size"]))
        except (ValueError, KeyError, TypeError):
            continue  # a cache entry that cannot be read is read again
    return out
