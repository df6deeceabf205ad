"""Generate a tiny, random-weight llama GGUF model that a real ``llama-server`` can load on CPU.

The model is a 2-layer llama (64-dim embeddings, 4 heads / 2 KV heads, FFN 192) with an SPM ("llama")
vocabulary made of ``<unk>``/``<s>``/``</s>``, the chatml control tokens, the 256 byte-fallback tokens
(``<0x00>``..``<0xFF>``) and a few plain word pieces, plus a chatml-like ``tokenizer.chat_template`` so
``/v1/chat/completions`` works.  The file is about 0.55 MB and fully deterministic for a given seed.

Its output is gibberish built from the plain word pieces: the unembedding rows of every special and byte
token are zero while those of plain pieces have a large spread, so sampling practically never picks
end-of-sequence (``</s>``/``<|im_end|>``) or a lone byte.  Clients must therefore always cap tokens
(``max_tokens``/``n_predict``); a generation ends with ``finish_reason == "length"``.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

# Architecture (small enough to run instantly on one CPU thread).
N_EMBD = 64
N_LAYER = 2
N_HEAD = 4
N_HEAD_KV = 2
N_FF = 192
N_CTX_TRAIN = 2048
RMS_EPS = 1e-5

UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
IM_START, IM_END = "<|im_start|>", "<|im_end|>"

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Plain SentencePiece pieces ("▁" marks a leading space); taken in order to fill the vocabulary.
# fmt: off
_WORDS: tuple[str, ...] = (
    "the", "of", "and", "to", "in", "is", "it", "that", "was", "for", "on", "are", "as", "with", "be",
    "at", "by", "this", "from", "or", "have", "an", "they", "which", "one", "you", "all", "were", "her",
    "she", "there", "would", "their", "we", "him", "been", "has", "when", "who", "will", "more", "no",
    "if", "out", "so", "said", "what", "up", "its",
)
# fmt: on
_PIECES: tuple[str, ...] = (
    "▁",
    *(chr(c) for c in range(ord("a"), ord("z") + 1)),
    *("▁" + w for w in _WORDS),
    *(chr(c) for c in range(ord("A"), ord("Z") + 1)),
    *"0123456789.,!?-:;'\"()",
)

# Number of tokens that are not plain pieces: unk, bos, eos, 2 chatml controls, 256 bytes.
N_SPECIAL = 5 + 256
MIN_VOCAB = N_SPECIAL + 27  # at least "▁" and a..z
MAX_VOCAB = N_SPECIAL + len(_PIECES)


def _vocab(n_vocab: int) -> tuple[list[str], list[float], list[int]]:
    tokens: list[str] = ["<unk>", "<s>", "</s>", IM_START, IM_END]
    types: list[int] = [
        gguf.TokenType.UNKNOWN,
        gguf.TokenType.CONTROL,
        gguf.TokenType.CONTROL,
        gguf.TokenType.CONTROL,
        gguf.TokenType.CONTROL,
    ]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [gguf.TokenType.BYTE] * 256
    pieces = _PIECES[: n_vocab - N_SPECIAL]
    tokens += pieces
    types += [gguf.TokenType.NORMAL] * len(pieces)
    # SPM merges prefer higher scores: specials/bytes 0, pieces decreasing so longer words still win
    # over splitting (all pieces are either single characters or whole words, so ties cannot matter).
    scores = [0.0] * N_SPECIAL + [-float(i) for i in range(len(pieces))]
    return tokens, scores, [int(t) for t in types]


FILE_TYPES = {
    "F32": (gguf.LlamaFileType.ALL_F32, None),
    "F16": (gguf.LlamaFileType.MOSTLY_F16, gguf.GGMLQuantizationType.F16),
    "Q8_0": (gguf.LlamaFileType.MOSTLY_Q8_0, gguf.GGMLQuantizationType.Q8_0),
}


def make_tiny_gguf(path: Path, *, n_vocab: int = 300, seed: int = 0, file_type: str = "F32") -> Path:
    """Write the tiny llama model to ``path`` (parents created) and return ``path``.

    ``n_vocab`` must lie in ``[MIN_VOCAB, MAX_VOCAB]``; ``seed`` fixes the random weights, so equal arguments
    produce byte-identical files. ``file_type`` (``FILE_TYPES``) stores the 2-D weights as F32, F16 or
    Q8_0 (norms stay F32, as llama.cpp's converter keeps them).
    """
    if not MIN_VOCAB <= n_vocab <= MAX_VOCAB:
        raise ValueError(f"n_vocab must be in [{MIN_VOCAB}, {MAX_VOCAB}], got {n_vocab}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)

    tokens, scores, types = _vocab(n_vocab)
    rng = np.random.default_rng(seed)
    head_dim = N_EMBD // N_HEAD
    n_embd_kv = head_dim * N_HEAD_KV

    def mat(n_out: int, n_in: int, std: float | None = None) -> np.ndarray:
        # numpy (rows, cols) == ggml ne[1], ne[0]: i.e. (out_features, in_features).
        s = std if std is not None else 1.0 / np.sqrt(n_in)
        return rng.normal(0.0, s, size=(n_out, n_in)).astype(np.float32)

    def ones(n: int) -> np.ndarray:
        return np.ones(n, dtype=np.float32)

    def put(name: str, t: np.ndarray) -> None:
        if qtype is None or t.ndim != 2:
            writer.add_tensor(name, t)
        else:
            q = gguf.quants.quantize(t, qtype)
            writer.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qtype)

    writer = gguf.GGUFWriter(path, "llama")
    try:
        writer.add_name("clusterctl-tiny-test")
        writer.add_context_length(N_CTX_TRAIN)
        writer.add_embedding_length(N_EMBD)
        writer.add_block_count(N_LAYER)
        writer.add_feed_forward_length(N_FF)
        writer.add_head_count(N_HEAD)
        writer.add_head_count_kv(N_HEAD_KV)
        writer.add_layer_norm_rms_eps(RMS_EPS)
        writer.add_rope_dimension_count(head_dim)
        writer.add_rope_freq_base(10000.0)
        writer.add_vocab_size(n_vocab)
        ftype, qtype = FILE_TYPES[file_type]
        writer.add_file_type(ftype)

        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_unk_token_id(UNK_ID)
        writer.add_bos_token_id(BOS_ID)
        writer.add_eos_token_id(EOS_ID)
        writer.add_add_bos_token(True)
        writer.add_add_eos_token(False)
        writer.add_chat_template(CHAT_TEMPLATE)

        put("token_embd.weight", mat(n_vocab, N_EMBD, std=1.0))
        for i in range(N_LAYER):
            p = f"blk.{i}"
            writer.add_tensor(f"{p}.attn_norm.weight", ones(N_EMBD))
            put(f"{p}.attn_q.weight", mat(N_EMBD, N_EMBD))
            put(f"{p}.attn_k.weight", mat(n_embd_kv, N_EMBD))
            put(f"{p}.attn_v.weight", mat(n_embd_kv, N_EMBD))
            put(f"{p}.attn_output.weight", mat(N_EMBD, N_EMBD))
            writer.add_tensor(f"{p}.ffn_norm.weight", ones(N_EMBD))
            put(f"{p}.ffn_gate.weight", mat(N_FF, N_EMBD))
            put(f"{p}.ffn_up.weight", mat(N_FF, N_EMBD))
            put(f"{p}.ffn_down.weight", mat(N_EMBD, N_FF))
        writer.add_tensor("output_norm.weight", ones(N_EMBD))
        # After the final RMSNorm the hidden state has norm ~sqrt(N_EMBD) = 8, so std 1.5 gives plain pieces
        # logits of std ~12 while specials and bytes stay at exactly 0: they are (practically) never sampled.
        out = mat(n_vocab, N_EMBD, std=1.5)
        out[:N_SPECIAL] = 0.0
        put("output.weight", out)

        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    return path


if __name__ == "__main__":
    import sys

    target = Path(sys.argv[1] if len(sys.argv) > 1 else "tiny.gguf")
    print(make_tiny_gguf(target))
