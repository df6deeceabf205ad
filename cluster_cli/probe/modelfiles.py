"""Reading a model's size where it lives: the remote commands, and their output parsed.

Two steps, so that an unchanged model costs one small command: ``stat_command`` lists the
model's files with their sizes and modification times (a GGUF file; a Hugging Face folder's
``*.safetensors`` and ``config.json``; a hub id in the node's Hugging Face cache), and only
when that listing differs from the one cached, ``read_command`` sends the GGUF file's first
bytes or the folder's ``config.json``. Pure: commands are built with ``shlex.quote``, outputs
parsed here; running them is the caller's.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

from cluster_cli.facts import ModelSize
from cluster_cli.probe.parsers.gguf import GgufError, parse_gguf_header
from cluster_cli.probe.parsers.hfmodel import HfConfigError, parse_hf_config

HEADER_BYTES = 1 << 20  # a GGUF's shape comes before its tokenizer's arrays: 1 MiB is ample
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")


class ModelFileError(ValueError):
    """The model is not there, or its files say nothing of its size."""


@dataclass(frozen=True)
class Listing:
    """What ``stat_command`` found: ``kind`` ``file`` or ``folder``, where, and its files as
    (name, bytes, mtime)."""

    kind: str
    path: str
    files: tuple[tuple[str, int, int], ...]

    @property
    def weights_bytes(self) -> int:
        if self.kind == "file":
            return self.files[0][1]
        return sum(b for n, b, _ in self.files if n.endswith((".safetensors", ".gguf")))

    def key(self) -> str:
        """Equal keys: the same files, unchanged (what the cache compares)."""
        return f"{self.kind}|{self.path}|" + ";".join(f"{n}:{b}:{t}" for n, b, t in self.files)


def stat_command(model: str) -> str:
    """List the files of ``model`` (a path, or a hub id looked up in the Hugging Face cache)."""
    q = shlex.quote(model)
    hub = ""
    if not model.startswith(("/", "~", ".")) and _HUB_ID.fullmatch(model):
        org, name = model.split("/")
        snap = shlex.quote(f"models--{org}--{name}")
        hub = (
            f'if [ ! -e "$p" ]; then h="${{HF_HUB_CACHE:-${{HF_HOME:-$HOME/.cache/huggingface}}/hub}}"/{snap}/snapshots; '
            'for d in "$h"/*; do [ -d "$d" ] && p="$d"; done; fi; '
        )
    return (
        f"p={q}; {hub}"
        'if [ -f "$p" ]; then echo "F $(stat -Lc \'%s %Y\' "$p") $p"; '
        'elif [ -d "$p" ]; then echo "D $p"; for f in "$p"/*.safetensors "$p"/*.gguf "$p"/config.json; do '
        '[ -f "$f" ] && echo "W $(stat -Lc \'%s %Y\' "$f") ${f##*/}"; done; '
        "else echo N; fi"
    )


def parse_stat(out: str, model: str) -> Listing:
    """``stat_command``'s output as a listing; :class:`ModelFileError` when the model is not there."""
    lines = [ln for ln in out.splitlines() if ln.strip()]
    if not lines or lines[0] == "N":
        raise ModelFileError(f"{model}: not found on the node")
    head = lines[0]
    if head.startswith("F "):
        parts = head.split(" ", 3)
        if len(parts) < 4 or not parts[1].isdigit() or not parts[2].isdigit():
            raise ModelFileError(f"{model}: unreadable listing {head[:100]!r}")
        return Listing("file", parts[3], ((parts[3].rsplit("/", 1)[-1], int(parts[1]), int(parts[2])),))
    if head.startswith("D "):
        files = []
        for ln in lines[1:]:
            parts = ln.split(" ", 3)
            if len(parts) == 4 and parts[0] == "W" and parts[1].isdigit() and parts[2].isdigit():
                files.append((parts[3], int(parts[1]), int(parts[2])))
        return Listing("folder", head[2:], tuple(sorted(files)))
    raise ModelFileError(f"{model}: unreadable listing {head[:100]!r}")


def read_command(listing: Listing) -> str:
    """The bytes that tell the model's shape: a GGUF's first ``HEADER_BYTES``, or ``config.json``."""
    if listing.kind == "file":
        return f"head -c {HEADER_BYTES} {shlex.quote(listing.path)}"
    gguf = [n for n, _, _ in listing.files if n.endswith(".gguf")]
    if gguf and not any(n == "config.json" for n, _, _ in listing.files):
        return f"head -c {HEADER_BYTES} {shlex.quote(listing.path + '/' + gguf[0])}"
    return f"cat {shlex.quote(listing.path + '/config.json')}"


def size_of(listing: Listing, content: bytes, model: str) -> ModelSize:
    """The model's size from its listing and what ``read_command`` sent."""
    weights = listing.weights_bytes
    if weights <= 0:
        raise ModelFileError(f"{model}: no weights (*.safetensors, *.gguf) in {listing.path}")
    source = listing.path
    if content[:4] == b"GGUF":
        try:
            g = parse_gguf_header(content)
        except GgufError as e:
            raise ModelFileError(f"{model}: {e}") from None
        return ModelSize(weights, g.kv_bytes_per_token(), g.context_length, source)
    try:
        h = parse_hf_config(content.decode("utf-8", "replace"))
    except HfConfigError as e:
        raise ModelFileError(f"{model}: {e}") from None
    # The KV cache at 2 bytes an element, as the estimate expects (its dtype is applied there).
    return ModelSize(weights, h.kv_bytes_per_token(2), h.max_context, source)
