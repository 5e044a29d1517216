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

This module: `Tokenizer` (construction from GGUF metadata or an HF folder, encode/decode,
export back to both) and `TokenizerLike`, what the rest of mlxtoy may use of any tokenizer
(this one, or `mlxtoy.io.char_tokenizer.CharTokenizer`). The parts live beside it:
`mlxtoy.io.pretokenizers` (the `tokenizer.ggml.pre` table), `mlxtoy.io.llama_vocab` (token
types, byte pieces, the SentencePiece pipeline) and `mlxtoy.io.chat_template` (the sandboxed
jinja renderer).
"""

from __future__ import annotations

import copy
import json
import os
import warnings
from typing import Any, Iterable, Protocol

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, processors

from mlxtoy.errors import UserError
from mlxtoy.textio import check_string, read_json
from mlxtoy.io.chat_template import CHATML_TEMPLATE, ChatTemplate
from mlxtoy.io.llama_vocab import (BYTE_TOKEN, EOG_TEXTS, SPIECE_SPACE, TT_BYTE, TT_CONTROL,
                                   TT_NORMAL, TT_UNKNOWN, TT_UNUSED, TT_USER_DEFINED,
                                   add_special_tokens, setup_spm_pipeline, spm_merges, spm_scores,
                                   token_piece)
from mlxtoy.io.pretokenizers import GPT2_REGEX, PRE_TOKENIZERS, PreTokenizer, detect_pre


class TokenizerLike(Protocol):
    """What mlxtoy outside io/ may use of a tokenizer; `Tokenizer` and `CharTokenizer` have all of it.

    A missing capability is a value, not a missing attribute: no chat template is
    `chat_template is None` (then `apply_chat_template` raises UserError unless the tokenizer
    falls back to ChatML, as `Tokenizer` does), no BOS / padding token is None, and a tokenizer
    with no Hugging Face or GGUF form raises UserError from the `to_*` exports.
    """

    source: str  # where it was loaded from, for messages
    bos_id: int | None
    eos_id: int | None
    eos_ids: set[int]  # every token that ends generation (eos_id, end of turn, ...)
    pad_id: int | None
    add_bos: bool  # what encode() does when add_bos / add_eos are None
    add_eos: bool

    @property
    def vocab_size(self) -> int: ...

    @property
    def chat_template(self) -> str | None: ...

    def encode(self, text: str, add_bos: bool | None = None, parse_special: bool = True,
               add_eos: bool | None = None) -> list[int]: ...

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str: ...

    def decode_token_bytes(self, token_id: int) -> bytes: ...

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str: ...

    def with_template_kwargs(self, kwargs: dict[str, Any]) -> "TokenizerLike": ...

    def describe(self) -> dict[str, Any]: ...

    def to_hf_tokenizer_json(self) -> str: ...

    def to_hf_tokenizer_config(self) -> dict[str, Any]: ...

    def to_gguf_metadata(self) -> dict[str, Any]: ...


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
        self._pieces = [token_piece(tokens[i], types[i], kind) for i in range(n)]
        self._template = ChatTemplate(self._chat_template or CHATML_TEMPLATE, source)
        self.template_kwargs: dict[str, Any] = {}  # further variables of every render (with_template_kwargs)
        self.eos_ids = self._find_eos_ids(extra_eos)

    # ------------------------------------------------------------------ construction: GGUF

    @classmethod
    def from_gguf_metadata(cls, md: dict[str, Any], source: str = "") -> "Tokenizer":
        """Build from GGUF key/values (plain Python values, as `mlxtoy.io.gguf_file.read_gguf` gives)."""
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
            if t in EOG_TEXTS and types[i] not in (TT_CONTROL, TT_UNKNOWN):
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
                pre = PreTokenizer([GPT2_REGEX])
            hf = HFTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=pre.ignore_merges))
            hf.pre_tokenizer = pre.to_hf()
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
            merges = spm_merges(vocab, scores, skip=byte_ids)
            unk_id = _opt_int(key("unknown_token_id", default_ids["unk"]))
            unk_text = tokens[unk_id] if unk_id is not None and 0 <= unk_id < n else None
            hf = HFTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk_text,
                                        byte_fallback=True, fuse_unk=True))

        add_space_prefix = bool(key("add_space_prefix", add_space_default))
        if kind == "spm":
            setup_spm_pipeline(hf, add_space_prefix)

        add_special_tokens(hf, tokens, types)
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
        data = read_json(tj)
        try:
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
                if types[i] == TT_NORMAL and BYTE_TOKEN.match(t):
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
        try:
            ids = hf.encode(text, add_special_tokens=False).ids if text else []
        except TypeError:  # the Rust side refuses str it cannot encode: say which text
            check_string(text, "text to tokenize")
            raise
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

        Runs in jinja2's immutable sandbox (mlxtoy.io.chat_template): a template from a
        downloaded file can read the variables it is given, but cannot reach Python internals
        or mutate anything. Extra keywords become template variables.
        """
        return self._template.render(messages, add_generation_prompt, self._special_text(self.bos_id),
                                     self._special_text(self.eos_id), {**self.template_kwargs, **kwargs})

    def with_template_kwargs(self, kwargs: dict[str, Any]) -> "Tokenizer":
        """This tokenizer, rendering every chat with these template variables too (a run's
        `chat_template_kwargs`, e.g. Qwen3's enable_thinking: false), as TRL's
        chat_template_kwargs and mlx-lm's chat_template_args do. Keywords given to
        apply_chat_template itself win."""
        out = copy.copy(self)
        out.template_kwargs = dict(kwargs)
        return out

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

    def _special_text(self, tid: int | None) -> str:
        return self._tokens[tid] if tid is not None else ""

    def _find_eos_ids(self, extra: Iterable[int]) -> set[int]:
        ids = {i for i in (self.eos_id, self.eot_id, self.eom_id) if i is not None}
        ids.update(i for i in extra if 0 <= i < self.vocab_size)
        for text in EOG_TEXTS:
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
            md["tokenizer.ggml.pre"] = detect_pre(data.get("pre_tokenizer"), self.source)
        md["tokenizer.ggml.tokens"] = list(self._tokens)
        if self.kind == "spm":
            md["tokenizer.ggml.scores"] = spm_scores(merges, self._hf.token_to_id, self._tokens,
                                                     self._types)
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


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.exists(path):
        return {}
    v = read_json(path)
    return v if isinstance(v, dict) else {}
