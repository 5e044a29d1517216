"""llama.cpp's vocabulary rules (src/llama-vocab.cpp) and the HF `tokenizers` pieces that follow them.

- token types (`TT_*`, GGUF `tokenizer.ggml.token_type`) and the token texts llama.cpp always
  treats as end of generation (`EOG_TEXTS`);
- `token_piece`: the exact bytes llama.cpp's token_to_piece prints for a token, byte-level
  (`bytes_to_unicode` alphabet) or SentencePiece ("▁" spaces, <0xXX> byte tokens);
- SentencePiece ("llama" vocabularies): `spm_merges` turns piece scores into BPE merges,
  `spm_scores` goes back, `setup_spm_pipeline` sets the normalizer and decoder;
- `add_special_tokens`: control / unknown / user-defined tokens as HF added tokens.
"""

from __future__ import annotations

import re
from typing import Any, Callable

from tokenizers import AddedToken, decoders, normalizers
from tokenizers import Tokenizer as HFTokenizer

# GGUF token types (llama.cpp's enum llama_token_type)
TT_UNDEFINED, TT_NORMAL, TT_UNKNOWN, TT_CONTROL, TT_USER_DEFINED, TT_UNUSED, TT_BYTE = range(7)

SPIECE_SPACE = "\u2581"  # "▁": SentencePiece's visible space

# Token texts llama.cpp treats as end-of-generation whatever the metadata says
# (llama_vocab::impl::load, "special_eog_ids"), minus its FIM tokens.
EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
             "<EOT>", "<|end_of_text|>", "<end_of_utterance>", "<|return|>", "<|call|>")

BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (the byte-level BPE alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


_BYTE_DECODER: dict[str, int] = {c: b for b, c in bytes_to_unicode().items()}


def _byte_level_bytes(text: str) -> bytes:
    # Characters outside the alphabet cannot come from a real byte-level vocab; keep their UTF-8
    # rather than failing (llama.cpp prints an "[UNK_BYTE_..]" marker instead).
    out = bytearray()
    for ch in text:
        b = _BYTE_DECODER.get(ch)
        if b is None:
            out += ch.encode("utf-8")
        else:
            out.append(b)
    return bytes(out)


def token_piece(text: str, token_type: int, kind: str) -> bytes:
    """llama.cpp's token_to_piece(special=True) for one vocabulary entry.

    kind: "bpe" (byte-level) or "spm" (SentencePiece-style).
    """
    if token_type in (TT_CONTROL, TT_UNKNOWN, TT_USER_DEFINED):
        return text.encode("utf-8")
    if token_type == TT_BYTE:
        m = BYTE_TOKEN.match(text)
        if m:
            return bytes([int(m.group(1), 16)])
        return _byte_level_bytes(text) if kind == "bpe" else text.encode("utf-8")
    if token_type == TT_NORMAL:
        if kind == "spm":
            return text.replace(SPIECE_SPACE, " ").encode("utf-8")
        return _byte_level_bytes(text)
    return b""  # unused / undefined tokens print nothing, as in llama.cpp


def spm_merges(vocab: dict[str, int], scores: list[float], skip: set[int]) -> list[tuple[str, str]]:
    """BPE merges that reproduce SentencePiece/llama.cpp's score-greedy merging.

    llama.cpp joins the adjacent pair whose concatenation is the highest-scoring vocab piece.
    Every way of writing a piece as left+right (both pieces themselves) becomes a merge, ranked
    by the merged piece's score, so BPE's "lowest rank first" picks the same pair.
    """
    ranked: list[tuple[float, int, int, str, str]] = []
    for piece, pid in vocab.items():
        if pid in skip or len(piece) < 2:
            continue
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in vocab and right in vocab:
                ranked.append((-scores[pid], pid, k, left, right))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]


def spm_scores(merges: list[str], token_to_id: Callable[[str], int | None], tokens: list[str],
               types: list[int]) -> list[float]:
    """Piece scores for llama.cpp from BPE merges ("left right", in rank order).

    llama.cpp merges SentencePiece pieces by score: score each piece by the rank of the first
    merge that makes it, so its greedy order is BPE's merge order.
    """
    scores = [0.0] * len(tokens)
    done: set[int] = set()
    for rank, m in enumerate(merges):
        left, _, right = m.partition(" ")
        pid = token_to_id(left + right)
        if pid is not None and pid not in done:
            scores[pid] = -float(rank + 1)
            done.add(pid)
    for i in range(len(tokens)):
        if i not in done and types[i] == TT_NORMAL and len(tokens[i]) > 1:
            scores[i] = -float(len(merges) + 1 + i)  # unreachable by merges: never first
    return scores


def setup_spm_pipeline(hf: HFTokenizer, add_space_prefix: bool) -> None:
    # No pre-tokenizer: SentencePiece merges across the whole fragment, spaces included.
    # Normalizers run on each fragment left between added tokens, so Prepend gives every
    # fragment its leading "▁", which is llama.cpp's rule (a space after each special token).
    steps: list[Any] = [normalizers.Prepend(SPIECE_SPACE)] if add_space_prefix else []
    steps.append(normalizers.Replace(" ", SPIECE_SPACE))
    hf.normalizer = normalizers.Sequence(steps)
    hf.pre_tokenizer = None
    dec: list[Any] = [decoders.Replace(SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        dec.append(decoders.Strip(" ", 1, 0))
    hf.decoder = decoders.Sequence(dec)


def add_special_tokens(hf: HFTokenizer, tokens: list[str], types: list[int]) -> None:
    # normalized=False: matched in the raw text before any normalizer, like llama.cpp does
    special = [AddedToken(tokens[i], special=True, normalized=False)
               for i, t in enumerate(types) if t in (TT_CONTROL, TT_UNKNOWN)]
    user = [AddedToken(tokens[i], special=False, normalized=False)
            for i, t in enumerate(types) if t == TT_USER_DEFINED]
    if special:
        hf.add_special_tokens(special)
    if user:
        hf.add_tokens(user)
