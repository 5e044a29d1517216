"""Tokenizers for GGUF and Hugging Face models, built on HF `tokenizers`, matching llama.cpp.

A GGUF carries its vocabulary as metadata (`tokenizer.ggml.*`). We translate it into an HF
`tokenizers.Tokenizer` whose output equals llama.cpp's `llama_tokenize` (the reference for
GGUF files):

- "gpt2" (byte-level BPE): llama.cpp splits text with a list of regexes chosen by
  `tokenizer.ggml.pre`, each regex splitting the pieces of the previous one and keeping the
  unmatched gaps. That is a Sequence of `Split(regex, "isolated")` pre-tokenizers followed by
  the byte-level alphabet mapping, then BPE with the merges in rank order.
- "llama" (SentencePiece): llama.cpp merges adjacent symbols greedily, highest score of the
  merged piece first, and falls back to <0xXX> byte tokens. That is a BPE model whose merge
  ranks are the pieces' scores, with byte_fallback; spaces become "▁" and, with
  add_space_prefix, every text fragment (the start, and each stretch after a special token) gets
  a leading "▁" exactly like llama.cpp's `is_prev_special` rule.
- Control (3) and unknown (2) tokens are special added tokens, user-defined (4) tokens are
  plain added tokens: both are matched verbatim before any splitting, as llama.cpp's
  `tokenizer_st_partition` does; with parse_special=False only user-defined ones still are.

Decoding does not go through HF: each id maps to the exact bytes llama.cpp's
`token_to_piece` produces, so streaming code can join bytes and decode UTF-8 safely.
"""

from __future__ import annotations

import copy
import json
import os
import re
import warnings
from typing import Any, Iterable

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from mlxtoy.errors import UserError

# GGUF token types (llama.cpp's enum llama_token_type)
TT_UNDEFINED, TT_NORMAL, TT_UNKNOWN, TT_CONTROL, TT_USER_DEFINED, TT_UNUSED, TT_BYTE = range(7)

SPIECE_SPACE = "\u2581"  # "▁": SentencePiece's visible space

# --- pre-tokenizer regexes, from llama.cpp src/llama-vocab.cpp (llm_tokenizer_bpe) -----------
# llama.cpp rewrites some HF regexes for std::regex (case-insensitive groups, \p{Lu} classes);
# HF's Oniguruma handles the originals, so where they differ we keep the original form.

# GPT-2's regex. llama.cpp's string lacks the final `|\s+`, but its hand-written matcher for it
# (unicode_regex_split_custom_gpt2) does have that branch, as HF's ByteLevel regex does.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
           r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
          r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+"
           r"|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SEED_CODER = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
               r"|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_BLOOM = r" ?[^(\s|.,!?…。，、।۔،)]+"
_DEEPSEEK_V3_WORDS = (r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
                      r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


class _Pre:
    """One llama.cpp pre-tokenizer: its regexes (applied in turn) and the flags it sets."""

    def __init__(self, regexes: list[str], ignore_merges: bool = False, add_bos: bool = False):
        self.regexes = regexes
        self.ignore_merges = ignore_merges  # a word that is already a token skips the merges
        self.add_bos = add_bos              # llama.cpp's default when add_bos_token is absent


_PRE_GROUPS: list[tuple[tuple[str, ...], _Pre]] = [
    (("default",), _Pre([r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"])),
    (("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0",
      "mellum", "modern-bert", "jina-v1-en", "jina-v2-code", "roberta-bpe", "exaone4", "mpt",
      "olmo", "jais", "trillion", "granite-docling"), _Pre([_GPT2])),
    (("llama-bpe", "llama3", "llama-v3", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
      "jina-v5-nano"), _Pre([_LLAMA3], ignore_merges=True, add_bos=True)),
    (("dbrx", "smaug-bpe"), _Pre([_LLAMA3])),
    (("falcon",), _Pre([r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"])),
    (("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b", "mellum2"),
     _Pre([r"\p{N}", _GPT2])),
    (("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "stablelm2", "hunyuan", "megrez", "solar-open"),
     _Pre([_QWEN2])),
    (("qwen35",), _Pre([_QWEN35])),
    (("chatglm-bpe",), _Pre([_LLAMA3])),
    (("glm4", "glm5"), _Pre([_LLAMA3], ignore_merges=True)),
    (("poro-chat", "bloom", "gpt3-finnish"), _Pre([_BLOOM])),
    (("viking",), _Pre([_BLOOM, r"\p{N}"])),
    (("deepseek-coder",), _Pre([r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[一-龥ࠀ-一가-퟿]+", r"\p{N}"])),
    (("deepseek-v3", "hunyuan-dense", "joyai-llm"),
     _Pre([r"\p{N}{1,3}", r"[一-龥぀-ゟ゠-ヿ]+", _DEEPSEEK_V3_WORDS])),
    (("tekken",), _Pre([_TEKKEN], ignore_merges=True, add_bos=True)),
    (("gpt-4o", "llama4", "kanana2", "talkie"), _Pre([_GPT4O])),
    (("seed-coder",), _Pre([_SEED_CODER])),
]
# Within a group the regexes are identical; the first name is the one written when exporting a
# Hugging Face tokenizer (e.g. "smollm" over "starcoder": llama.cpp then leaves decoded spaces
# alone, and "llama-bpe" is what llama.cpp's own converter writes for Llama 3).
PRE_TOKENIZERS: dict[str, _Pre] = {name: pre for names, pre in _PRE_GROUPS for name in names}

# Token texts llama.cpp treats as end-of-generation whatever the metadata says
# (llama_vocab::impl::load, "special_eog_ids"), minus its FIM tokens.
_EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
              "<EOT>", "<|end_of_text|>", "<end_of_utterance>", "<|return|>", "<|call|>")

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _bytes_to_unicode() -> dict[int, str]:
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


_BYTE_DECODER: dict[str, int] = {c: b for b, c in _bytes_to_unicode().items()}


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


def _spm_merges(vocab: dict[str, int], scores: list[float], skip: set[int]) -> list[tuple[str, str]]:
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


def _split_pretokenizer(regexes: Iterable[str]) -> list[Any]:
    return [pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False) for r in regexes]


def _as_str(v: Any) -> str:
    return v.decode("utf-8", errors="replace") if isinstance(v, (bytes, bytearray)) else str(v)


def _opt_int(v: Any) -> int | None:
    return None if v is None else int(v)


def _list(v: Any) -> list[Any]:
    """A GGUF array as a list (callers may hand us numpy arrays as well as lists)."""
    if v is None or isinstance(v, (str, bytes)):
        return []
    return list(v.tolist() if hasattr(v, "tolist") else v)


class Tokenizer:
    """Text <-> token ids for one model, with its chat template and GGUF/HF round trips.

    Build it with `from_gguf_metadata` or `from_hf_folder`.
    """

    def __init__(self, *, hf: HFTokenizer, tokens: list[str], types: list[int], kind: str,
                 source: str, bos_id: int | None, eos_id: int | None, eot_id: int | None = None,
                 eom_id: int | None = None, unk_id: int | None = None, pad_id: int | None = None,
                 add_bos: bool = False, add_eos: bool = False, add_space_prefix: bool = False,
                 chat_template: str | None = None, pre: str | None = None,
                 gguf_metadata: dict[str, Any] | None = None, extra_eos: Iterable[int] = ()):
        self._hf = hf
        self._hf_literal: HFTokenizer | None = None  # clone that leaves special tokens as text
        self._tokens = tokens
        self._types = types
        self.kind = kind  # "bpe" (byte-level) or "spm" (SentencePiece-style, byte fallback)
        self.source = source
        self.pre = pre
        n = len(tokens)

        def valid(i: int | None) -> int | None:
            return i if i is not None and 0 <= i < n else None

        self.bos_id = valid(bos_id)
        self.eos_id = valid(eos_id)
        self.eot_id = valid(eot_id)
        self.eom_id = valid(eom_id)
        self.unk_id = valid(unk_id)
        self.pad_id = valid(pad_id)
        self.add_bos = bool(add_bos)
        self.add_eos = bool(add_eos)
        self.add_space_prefix = bool(add_space_prefix)
        self._chat_template = chat_template or None
        self._gguf_md = gguf_metadata
        self._hf_json: dict[str, Any] | None = None  # the tokenizer.json we were loaded from
        self._pieces = [self._piece(i) for i in range(n)]
        self._template_cache: dict[str, Any] = {}
        self.eos_ids = self._find_eos_ids(extra_eos)

    # ------------------------------------------------------------------ construction: GGUF

    @classmethod
    def from_gguf_metadata(cls, md: dict[str, Any], source: str = "") -> "Tokenizer":
        """Build from GGUF key/values (plain Python values, as gguf-py's `contents()` gives)."""
        src = source or "GGUF metadata"
        raw_tokens = _list(md.get("tokenizer.ggml.tokens"))
        if not raw_tokens:
            raise UserError(f"{src}: no tokenizer in the file (tokenizer.ggml.tokens is missing or empty)")
        # llama.cpp renames empty tokens so that every text maps to one id
        tokens = [_as_str(t) or f"[EMPTY_{i}]" for i, t in enumerate(raw_tokens)]
        n = len(tokens)
        model = _as_str(md.get("tokenizer.ggml.model", ""))
        if model not in ("gpt2", "llama"):
            raise UserError(f"{src}: unsupported tokenizer model {model!r} (supported: gpt2, llama)")

        types = [int(t) for t in _list(md.get("tokenizer.ggml.token_type")) or [TT_NORMAL] * n]
        if len(types) < n:
            raise UserError(f"{src}: tokenizer.ggml.token_type has {len(types)} entries for {n} tokens")
        types = types[:n]
        scores = [float(s) for s in _list(md.get("tokenizer.ggml.scores")) or [0.0] * n]
        if len(scores) < n:
            raise UserError(f"{src}: tokenizer.ggml.scores has {len(scores)} entries for {n} tokens")

        # llama.cpp marks tokens named like turn ends as control, even when the converter did
        # not, so they are split out of text and count as end of generation.
        for i, t in enumerate(tokens):
            if t in _EOG_TEXTS and types[i] not in (TT_CONTROL, TT_UNKNOWN):
                types[i] = TT_CONTROL

        vocab: dict[str, int] = {}
        for i, t in enumerate(tokens):
            vocab[t] = i  # a duplicated text maps to its last id, as in llama.cpp's token_to_id

        def key(name: str, default: Any = None) -> Any:
            return md.get(f"tokenizer.ggml.{name}", default)

        pre_name: str | None = None
        if model == "gpt2":
            raw_merges = _list(key("merges"))
            if not raw_merges:
                raise UserError(f"{src}: byte-level BPE tokenizer without tokenizer.ggml.merges")
            merges: list[tuple[str, str]] = []
            dropped = 0
            for m in raw_merges:
                m = _as_str(m)
                pos = m.find(" ", 1)  # llama.cpp splits at the first space after position 0
                left, right = (m[:pos], m[pos + 1:]) if pos > 0 else (m, "")
                if left in vocab and right in vocab and left + right in vocab:
                    merges.append((left, right))
                else:
                    dropped += 1  # unusable: HF rejects merges that leave the vocab
            if dropped:
                warnings.warn(f"{src}: ignored {dropped} BPE merges whose pieces are not in the vocab",
                              stacklevel=2)
            pre_name = _as_str(key("pre", "default") or "default")
            pre = PRE_TOKENIZERS.get(pre_name)
            if pre is None:
                warnings.warn(f"{src}: unknown pre-tokenizer {pre_name!r}; using GPT-2's regex "
                              f"(tokenization may differ from llama.cpp)", stacklevel=2)
                pre = _Pre([_GPT2])
            hf = HFTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=pre.ignore_merges))
            hf.pre_tokenizer = pre_tokenizers.Sequence(
                _split_pretokenizer(pre.regexes)
                + [pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
            hf.decoder = decoders.ByteLevel()
            kind = "bpe"
            default_ids: dict[str, int | None] = {"bos": None, "eos": None, "unk": None}
            add_bos_default, add_space_default = pre.add_bos, False
        else:
            # SentencePiece: llama.cpp's defaults for this model type
            default_ids = {"bos": 1, "eos": 2, "unk": 0}
            add_bos_default, add_space_default = True, True
            kind = "spm"
            byte_ids = {i for i, t in enumerate(types) if t == TT_BYTE}
            merges = _spm_merges(vocab, scores, skip=byte_ids)
            unk_id = _opt_int(key("unknown_token_id", default_ids["unk"]))
            unk_text = tokens[unk_id] if unk_id is not None and 0 <= unk_id < n else None
            hf = HFTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk_text,
                                        byte_fallback=True, fuse_unk=True))

        add_space_prefix = bool(key("add_space_prefix", add_space_default))
        if kind == "spm":
            _setup_spm_pipeline(hf, add_space_prefix)

        _add_special_tokens(hf, tokens, types)
        bos_id = _opt_int(key("bos_token_id", default_ids["bos"]))
        eos_id = _opt_int(key("eos_token_id", default_ids["eos"]))
        add_bos = bool(key("add_bos_token", add_bos_default))
        add_eos = bool(key("add_eos_token", False))
        tok = cls(hf=hf, tokens=tokens, types=types, kind=kind, source=src,
                  bos_id=bos_id, eos_id=eos_id,
                  eot_id=_opt_int(key("eot_token_id")), eom_id=_opt_int(key("eom_token_id")),
                  unk_id=_opt_int(key("unknown_token_id", default_ids["unk"])),
                  pad_id=_opt_int(key("padding_token_id")),
                  add_bos=add_bos, add_eos=add_eos, add_space_prefix=add_space_prefix,
                  chat_template=_as_str(md.get("tokenizer.chat_template") or ""), pre=pre_name,
                  gguf_metadata={k: copy.deepcopy(v) for k, v in md.items() if k.startswith("tokenizer.")})
        tok._set_post_processor()
        return tok

    # ------------------------------------------------------------------ construction: HF folder

    @classmethod
    def from_hf_folder(cls, path: str | os.PathLike) -> "Tokenizer":
        """Build from a Hugging Face folder: tokenizer.json (+ tokenizer_config.json, config.json)."""
        path = os.fspath(path)
        tj = os.path.join(path, "tokenizer.json")
        if not os.path.exists(tj):
            raise UserError(f"{path}: no tokenizer.json")
        try:
            with open(tj, encoding="utf-8") as f:
                data = json.load(f)
            hf = HFTokenizer.from_str(json.dumps(data))
        except Exception as e:  # json errors, or tokenizers' own parse errors
            raise UserError(f"{tj}: not a valid tokenizer.json ({type(e).__name__}: {e})") from None
        model = data.get("model") or {}
        if model.get("type") != "BPE":
            raise UserError(f"{tj}: unsupported tokenizer model {model.get('type')!r} (supported: BPE)")

        cfg = _read_json(os.path.join(path, "tokenizer_config.json"))
        mcfg = _read_json(os.path.join(path, "config.json"))
        gcfg = _read_json(os.path.join(path, "generation_config.json"))

        pipeline = json.dumps([data.get("normalizer"), data.get("pre_tokenizer"), data.get("decoder")])
        if model.get("byte_fallback") or "Metaspace" in pipeline or SPIECE_SPACE in pipeline:
            kind = "spm"
        elif "ByteLevel" in pipeline:
            kind = "bpe"
        else:
            raise UserError(f"{tj}: BPE tokenizer that is neither byte-level nor SentencePiece-style")

        vocab = hf.get_vocab(with_added_tokens=True)
        n = max(vocab.values()) + 1 if vocab else 0
        # gaps in the id space (padded vocabularies) become unused placeholders, as
        # convert_hf_to_gguf.py writes them
        tokens = [f"[PAD{i}]" for i in range(n)]
        types = [TT_UNUSED] * n
        for text, i in vocab.items():
            tokens[i] = text
            types[i] = TT_NORMAL
        for t in data.get("added_tokens") or []:
            if 0 <= t["id"] < n:
                types[t["id"]] = TT_CONTROL if t.get("special") else TT_USER_DEFINED
        unk_text = model.get("unk_token")
        if unk_text in vocab:
            types[vocab[unk_text]] = TT_UNKNOWN
        if kind == "spm":
            for i, t in enumerate(tokens):
                if types[i] == TT_NORMAL and _BYTE_TOKEN.match(t):
                    types[i] = TT_BYTE

        def tid(name: str) -> int | None:
            v = cfg.get(name)
            if isinstance(v, dict):
                v = v.get("content")
            return vocab.get(v) if isinstance(v, str) else None

        def cfg_ids(c: dict[str, Any], name: str) -> list[int]:
            v = c.get(name)
            return [int(x) for x in (v if isinstance(v, list) else [v]) if x is not None]

        eos_candidates = cfg_ids(mcfg, "eos_token_id") + cfg_ids(gcfg, "eos_token_id")
        bos_id = tid("bos_token")
        if bos_id is None:
            bos_id = next(iter(cfg_ids(mcfg, "bos_token_id")), None)
        eos_id = tid("eos_token")
        if eos_id is None and eos_candidates:
            eos_id = eos_candidates[0]

        # Whether BOS/EOS are added: the config says so, or the post-processor does it.
        probe_with = hf.encode("a", add_special_tokens=True).ids
        probe_without = hf.encode("a", add_special_tokens=False).ids
        add_bos = cfg.get("add_bos_token")
        if add_bos is None:
            add_bos = bos_id is not None and len(probe_with) > len(probe_without) and probe_with[0] == bos_id
        add_eos = cfg.get("add_eos_token")
        if add_eos is None:
            add_eos = eos_id is not None and len(probe_with) > len(probe_without) and probe_with[-1] == eos_id

        add_space_prefix = False
        if kind == "spm":
            add_space_prefix = "Prepend" in pipeline or '"prepend_scheme": "always"' in pipeline \
                or '"prepend_scheme": "first"' in pipeline or '"add_prefix_space": true' in pipeline

        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: take "default", else the first
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_file = os.path.join(path, "chat_template.jinja")
        if not template and os.path.exists(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                template = f.read()

        tok = cls(hf=hf, tokens=tokens, types=types, kind=kind, source=path, bos_id=bos_id,
                  eos_id=eos_id, unk_id=vocab.get(unk_text) if unk_text else None,
                  pad_id=tid("pad_token"), add_bos=bool(add_bos), add_eos=bool(add_eos),
                  add_space_prefix=add_space_prefix, chat_template=template,
                  extra_eos=eos_candidates)
        tok._hf_json = data
        return tok

    # ------------------------------------------------------------------ encode / decode

    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    def encode(self, text: str, add_bos: bool | None = None, parse_special: bool = True,
               add_eos: bool | None = None) -> list[int]:
        """Text -> ids, as llama.cpp's llama_tokenize(text, add_special, parse_special).

        add_bos / add_eos: None follows the model's metadata (add_bos_token / add_eos_token, or
        llama.cpp's default for the tokenizer type), True / False force it.
        parse_special: when False, control tokens written in the text (`<|im_start|>`) are
        tokenized as plain text; user-defined tokens are still matched.
        """
        hf = self._hf if parse_special else self._literal()
        ids = hf.encode(text, add_special_tokens=False).ids if text else []
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        if (self.add_eos if add_eos is None else add_eos) and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    def decode_token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (may be part of a UTF-8 character).

        As llama.cpp's token_to_piece with special=True; no leading-space removal.
        Ids outside the vocabulary (models often pad their embedding rows) give b"".
        """
        if 0 <= token_id < len(self._pieces):
            return self._pieces[token_id]
        return b""

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Ids -> text. skip_special drops control and unknown tokens (llama.cpp special=False).

        With add_space_prefix (SentencePiece) the space the encoder put in front of the text is
        removed from the first piece, so decode(encode(text)) == text.
        """
        out = bytearray()
        strip = self.add_space_prefix
        for i in ids:
            i = int(i)
            if not 0 <= i < len(self._pieces):
                continue
            t = self._types[i]
            if skip_special and t in (TT_CONTROL, TT_UNKNOWN):
                continue
            piece = self._pieces[i]
            if strip and piece:
                if t == TT_NORMAL and piece.startswith(b" "):
                    piece = piece[1:]
                strip = False
            out += piece
        return out.decode("utf-8", errors="replace")

    def token_text(self, token_id: int) -> str:
        """The vocabulary entry itself (e.g. "Ġthe", "▁the", "<0x0A>")."""
        return self._tokens[token_id]

    def token_type(self, token_id: int) -> int:
        return self._types[token_id]

    def is_special(self, token_id: int) -> bool:
        return 0 <= token_id < len(self._types) and self._types[token_id] in (TT_CONTROL, TT_UNKNOWN)

    def token_to_id(self, text: str) -> int | None:
        return self._hf.token_to_id(text)

    # ------------------------------------------------------------------ chat template

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """Render messages with the model's chat template (ChatML when it has none).

        Runs in jinja2's immutable sandbox: a template from a downloaded file can read the
        variables it is given, but cannot reach Python internals or mutate anything.
        """
        source = self._chat_template or CHATML_TEMPLATE
        try:
            template = self._template_cache.get(source)
            if template is None:
                template = _jinja_env().from_string(source)
                self._template_cache[source] = template
            return template.render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self._special_text(self.bos_id), eos_token=self._special_text(self.eos_id),
                **kwargs)
        except Exception as e:  # syntax errors, sandbox violations, raise_exception(), bad data
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise UserError(f"{self.source}: chat template failed: {msg}") from e

    # ------------------------------------------------------------------ export

    def to_gguf_metadata(self) -> dict[str, Any]:
        """Every `tokenizer.*` GGUF key. From a GGUF: the original values, unchanged."""
        if self._gguf_md is not None:
            return copy.deepcopy(self._gguf_md)
        return self._derive_gguf_metadata()

    def to_hf_tokenizer_json(self) -> str:
        """A tokenizer.json that Hugging Face `tokenizers` / transformers load."""
        return self._hf.to_str(pretty=True)

    def to_hf_tokenizer_config(self) -> dict[str, Any]:
        """The matching tokenizer_config.json contents."""
        out: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast",
                               "add_bos_token": self.add_bos, "add_eos_token": self.add_eos,
                               "clean_up_tokenization_spaces": False}
        for name, tid in (("bos_token", self.bos_id), ("eos_token", self.eos_id),
                          ("unk_token", self.unk_id), ("pad_token", self.pad_id)):
            if tid is not None:
                out[name] = self._tokens[tid]
        if self._chat_template:
            out["chat_template"] = self._chat_template
        return out

    def describe(self) -> dict[str, Any]:
        """A short summary for `mlxtoy inspect`."""
        out: dict[str, Any] = {"type": "byte-level BPE" if self.kind == "bpe" else "SentencePiece",
                               "vocab": self.vocab_size}
        if self.pre:
            out["pre"] = self.pre
        for name, tid in (("bos", self.bos_id), ("eos", self.eos_id)):
            if tid is not None:
                out[name] = f"{tid} {self._tokens[tid]!r}"
        out["add_bos"] = self.add_bos
        return out

    def __repr__(self) -> str:
        return f"Tokenizer({self.kind}, vocab={self.vocab_size}, source={self.source!r})"

    # ------------------------------------------------------------------ internals

    def _literal(self) -> HFTokenizer:
        if self._hf_literal is None:
            clone = HFTokenizer.from_str(self._hf.to_str())
            clone.encode_special_tokens = True  # special added tokens are plain text; others still split
            self._hf_literal = clone
        return self._hf_literal

    def _piece(self, i: int) -> bytes:
        """llama.cpp's token_to_piece(i, special=True) for this vocabulary."""
        text, t = self._tokens[i], self._types[i]
        if t in (TT_CONTROL, TT_UNKNOWN, TT_USER_DEFINED):
            return text.encode("utf-8")
        if t == TT_BYTE:
            m = _BYTE_TOKEN.match(text)
            if m:
                return bytes([int(m.group(1), 16)])
            return _byte_level_bytes(text) if self.kind == "bpe" else text.encode("utf-8")
        if t == TT_NORMAL:
            if self.kind == "spm":
                return text.replace(SPIECE_SPACE, " ").encode("utf-8")
            return _byte_level_bytes(text)
        return b""  # unused / undefined tokens print nothing, as in llama.cpp

    def _special_text(self, tid: int | None) -> str:
        return self._tokens[tid] if tid is not None else ""

    def _find_eos_ids(self, extra: Iterable[int]) -> set[int]:
        ids = {i for i in (self.eos_id, self.eot_id, self.eom_id) if i is not None}
        ids.update(i for i in extra if 0 <= i < self.vocab_size)
        for text in _EOG_TEXTS:
            i = self._hf.token_to_id(text)
            if i is not None:
                ids.add(i)
        # The special token the chat template puts right after a message ends the turn
        # (`<|im_end|>`, `<end_of_turn>`, ...): generation must stop there too.
        if self._chat_template:
            try:
                marker = "\x00MLXTOY_TURN_END\x00"
                text = self.apply_chat_template(
                    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}],
                    add_generation_prompt=False)
                after = text.split(marker, 1)[1] if marker in text else ""
                for i in self._hf.encode(after, add_special_tokens=False).ids[:1]:
                    if self._types[i] == TT_CONTROL:
                        ids.add(i)
            except UserError:
                pass  # templates that reject this probe conversation still load
        return ids

    def _set_post_processor(self) -> None:
        """Let HF consumers of to_hf_tokenizer_json() add BOS/EOS as the metadata asks."""
        if not (self.add_bos and self.bos_id is not None) and not (self.add_eos and self.eos_id is not None):
            return
        specials: dict[str, int] = {}
        single, pair = "$A:0", "$A:0 $B:1"
        if self.add_bos and self.bos_id is not None:
            bos = self._tokens[self.bos_id]
            specials[bos] = self.bos_id
            single, pair = f"{bos}:0 {single}", f"{bos}:0 $A:0 {bos}:1 $B:1"
        if self.add_eos and self.eos_id is not None:
            eos = self._tokens[self.eos_id]
            specials[eos] = self.eos_id
            single = f"{single} {eos}:0"
            pair = pair.replace("$A:0", f"$A:0 {eos}:0").replace("$B:1", f"$B:1 {eos}:1")
        try:
            self._hf.post_processor = processors.TemplateProcessing(
                single=single, pair=pair, special_tokens=list(specials.items()))
        except Exception:
            pass  # token texts with spaces cannot be written in a template; HF then adds nothing

    def _derive_gguf_metadata(self) -> dict[str, Any]:
        """GGUF tokenizer keys for a tokenizer that came from a Hugging Face folder."""
        md: dict[str, Any] = {"tokenizer.ggml.model": "gpt2" if self.kind == "bpe" else "llama"}
        data = self._hf_json or json.loads(self._hf.to_str())
        merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"].get("merges") or []]
        if self.kind == "bpe":
            md["tokenizer.ggml.pre"] = _detect_pre(data.get("pre_tokenizer"), self.source)
        md["tokenizer.ggml.tokens"] = list(self._tokens)
        if self.kind == "spm":
            # llama.cpp merges SentencePiece pieces by score: score each piece by the rank of the
            # first merge that makes it, so its greedy order is BPE's merge order.
            scores = [0.0] * self.vocab_size
            done: set[int] = set()
            for rank, m in enumerate(merges):
                left, _, right = m.partition(" ")
                pid = self._hf.token_to_id(left + right)
                if pid is not None and pid not in done:
                    scores[pid] = -float(rank + 1)
                    done.add(pid)
            for i in range(self.vocab_size):
                if i not in done and self._types[i] == TT_NORMAL and len(self._tokens[i]) > 1:
                    scores[i] = -float(len(merges) + 1 + i)  # unreachable by merges: never first
            md["tokenizer.ggml.scores"] = scores
        md["tokenizer.ggml.token_type"] = list(self._types)
        if self.kind == "bpe":
            md["tokenizer.ggml.merges"] = merges
        for name, tid in (("bos_token_id", self.bos_id), ("eos_token_id", self.eos_id),
                          ("eot_token_id", self.eot_id), ("eom_token_id", self.eom_id),
                          ("unknown_token_id", self.unk_id), ("padding_token_id", self.pad_id)):
            if tid is not None:
                md[f"tokenizer.ggml.{name}"] = tid
        md["tokenizer.ggml.add_bos_token"] = self.add_bos
        md["tokenizer.ggml.add_eos_token"] = self.add_eos
        if self.kind == "spm":
            md["tokenizer.ggml.add_space_prefix"] = self.add_space_prefix
        if self._chat_template:
            md["tokenizer.chat_template"] = self._chat_template
        return md


# ---------------------------------------------------------------------- helpers


def _setup_spm_pipeline(hf: HFTokenizer, add_space_prefix: bool) -> None:
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


def _add_special_tokens(hf: HFTokenizer, tokens: list[str], types: list[int]) -> None:
    # normalized=False: matched in the raw text before any normalizer, like llama.cpp does
    special = [AddedToken(tokens[i], special=True, normalized=False)
               for i, t in enumerate(types) if t in (TT_CONTROL, TT_UNKNOWN)]
    user = [AddedToken(tokens[i], special=False, normalized=False)
            for i, t in enumerate(types) if t == TT_USER_DEFINED]
    if special:
        hf.add_special_tokens(special)
    if user:
        hf.add_tokens(user)


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.exists(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            v = json.load(f)
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: unreadable JSON ({e})") from None
    return v if isinstance(v, dict) else {}


# HF writes some regexes in the (?i:...) form llama.cpp spells out; map both to one name.
_HF_ALIASES = {
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)": r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])",
}


def _detect_pre(pre: dict[str, Any] | None, source: str) -> str:
    """Name the llama.cpp pre-tokenizer whose regex list equals this HF pre-tokenizer's."""
    regexes: list[str] = []

    def walk(node: dict[str, Any] | None) -> None:
        if not node:
            return
        kind = node.get("type")
        if kind == "Sequence":
            for sub in node.get("pretokenizers", []):
                walk(sub)
        elif kind == "Split":
            pat = node.get("pattern", {})
            regexes.append(pat.get("Regex") or re.escape(pat.get("String", "")))
        elif kind == "Digits":
            regexes.append(r"\p{N}" if node.get("individual_digits") else r"\p{N}+")
        elif kind == "ByteLevel" and node.get("use_regex", True):
            regexes.append(_GPT2)

    walk(pre)
    normalized = []
    for r in regexes:
        for hf_form, cpp_form in _HF_ALIASES.items():
            r = r.replace(hf_form, cpp_form)
        normalized.append(r)
    for names, p in _PRE_GROUPS:
        if p.regexes == normalized:
            return names[0]
    warnings.warn(f"{source}: pre-tokenizer matches no llama.cpp preset; writing 'default'",
                  stacklevel=3)
    return "default"


_JINJA_ENV = None


def _jinja_env():
    """jinja2's immutable sandbox with the helpers transformers gives chat templates."""
    global _JINJA_ENV
    if _JINJA_ENV is not None:
        return _JINJA_ENV
    from datetime import datetime

    from jinja2.exceptions import SecurityError, TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class StrictSandbox(ImmutableSandboxedEnvironment):
        # The stock sandbox answers a forbidden attribute with an undefined value that prints
        # as "", so a hostile template would render quietly; make the attempt an error instead.
        def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
            raise SecurityError(f"access to attribute {attribute!r} of "
                                f"{type(obj).__name__!r} object is unsafe")

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = StrictSandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    _JINJA_ENV = env
    return env
