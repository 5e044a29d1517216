"""Character- and byte-level tokenizers for the reference TransformerLM.

`CharTokenizer` has every member of `mlxtoy.io.tokenizer.TokenizerLike`, so the trainer,
generation and the CLI use it like a model's tokenizer: no chat template (`chat_template` is
None, `apply_chat_template` raises), no BOS or padding token (None), and no Hugging Face or
GGUF form (the `to_*` exports raise UserError).

- "char": one token per Unicode character seen in the training text (sorted, so the vocabulary
  is a pure function of the text), plus `<|endoftext|>` (id 0, end of a document) and `<unk>`
  (id 1, any character the text never had).
- "byte": one token per byte value (ids 1..256 = bytes 0..255) plus `<|endoftext|>` (id 0);
  every string is encodable.

A tokenizer is saved as a small JSON object (`to_dict` / `from_dict`), e.g. inside a run's
config.yaml, so a run reloads exactly the vocabulary it was trained with.
"""

from __future__ import annotations

import json
from typing import Any, Iterable

from mlxtoy.errors import UserError
from mlxtoy.fsutil import write_text_atomic

EOT = "<|endoftext|>"
UNK = "<unk>"
KINDS = ("char", "byte")


class CharTokenizer:
    """A character- or byte-level vocabulary (`kind` "char" or "byte"); see the module docstring."""

    def __init__(self, kind: str, chars: Iterable[str] = ()):
        if kind not in KINDS:
            raise UserError(f"unknown character tokenizer {kind!r} (choose from {', '.join(KINDS)})")
        self.kind = kind
        self.source = kind
        if kind == "char":
            chars = sorted(set(chars))
            bad = [c for c in chars if len(c) != 1]
            if bad:
                raise UserError(f"char tokenizer: entries must be single characters, got {bad[0]!r}")
            if not chars:
                raise UserError("char tokenizer: the text has no characters")
            self._tokens = [EOT, UNK] + chars
            self.unk_id: int | None = 1
            self._index = {c: i + 2 for i, c in enumerate(chars)}
        else:
            self._tokens = [EOT] + [f"<0x{b:02X}>" for b in range(256)]
            self.unk_id = None
            self._index = {}
        self.bos_id: int | None = None
        self.eos_id: int | None = 0
        self.eos_ids = {0}
        self.pad_id: int | None = None
        self.add_bos = False
        self.add_eos = False

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_text(cls, text: str, kind: str = "char") -> "CharTokenizer":
        """A char tokenizer over the characters of `text` (a byte tokenizer ignores it)."""
        return cls(kind, set(text) if kind == "char" else ())

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.kind}
        if self.kind == "char":
            out["chars"] = "".join(self._tokens[2:])
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CharTokenizer":
        if not isinstance(d, dict) or d.get("type") not in KINDS:
            raise UserError(f"not a character tokenizer description: {str(d)[:80]}")
        return cls(d["type"], d.get("chars", ""))

    def save(self, path: str) -> None:
        write_text_atomic(path, json.dumps(self.to_dict(), ensure_ascii=False))

    @classmethod
    def load(cls, path: str) -> "CharTokenizer":
        try:
            with open(path, encoding="utf-8") as f:
                return cls.from_dict(json.load(f))
        except (OSError, json.JSONDecodeError) as e:
            raise UserError(f"{path}: cannot read the character tokenizer ({e})") from None

    # ------------------------------------------------------------------ encode / decode

    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    @property
    def chat_template(self) -> str | None:
        return None

    def encode(self, text: str, add_bos: bool | None = None, parse_special: bool = True,
               add_eos: bool | None = None) -> list[int]:
        """Text -> ids. With parse_special, `<|endoftext|>` written in the text is token 0."""
        ids: list[int] = []
        parts = text.split(EOT) if parse_special else [text]
        for n, part in enumerate(parts):
            if n:
                ids.append(0)
            if self.kind == "byte":
                ids.extend(b + 1 for b in part.encode("utf-8"))
            else:
                get, unk = self._index.get, self.unk_id
                ids.extend(get(c, unk) for c in part)
        if add_eos:
            ids.append(0)
        return ids

    def decode_token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a byte token may be part of a UTF-8 character)."""
        if not 0 <= token_id < len(self._tokens):
            return b""
        if self.kind == "byte" and token_id > 0:
            return bytes([token_id - 1])
        if token_id == self.unk_id:
            return "\ufffd".encode("utf-8")
        return self._tokens[token_id].encode("utf-8")

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        out = bytearray()
        for i in ids:
            i = int(i)
            if skip_special and self.is_special(i):
                continue
            out += self.decode_token_bytes(i)
        return out.decode("utf-8", errors="replace")

    def token_text(self, token_id: int) -> str:
        return self._tokens[token_id]

    def is_special(self, token_id: int) -> bool:
        return token_id == 0 or token_id == self.unk_id

    def token_to_id(self, text: str) -> int | None:
        if text == EOT:
            return 0
        if self.kind == "char":
            return self._index.get(text)
        b = text.encode("utf-8")
        return b[0] + 1 if len(b) == 1 else None

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        raise UserError(f"a {self.kind}-level tokenizer has no chat template; use plain text")

    def with_template_kwargs(self, kwargs: dict[str, Any]) -> "CharTokenizer":
        return self  # no template to give them to

    # ------------------------------------------------------------------ export

    # Only the reference TransformerLM (arch tiny) uses these vocabularies, and it has no
    # Hugging Face or llama.cpp equivalent to carry them.

    def to_hf_tokenizer_json(self) -> str:
        raise UserError(f"a {self.kind}-level tokenizer has no Hugging Face tokenizer.json form")

    def to_hf_tokenizer_config(self) -> dict[str, Any]:
        raise UserError(f"a {self.kind}-level tokenizer has no Hugging Face tokenizer_config.json form")

    def to_gguf_metadata(self) -> dict[str, Any]:
        raise UserError(f"this tokenizer cannot be written to GGUF metadata ({self.kind}-level vocabulary)")

    def describe(self) -> dict[str, Any]:
        return {"type": f"{self.kind}-level", "vocab": self.vocab_size, "eos": f"0 {EOT!r}"}

    def __repr__(self) -> str:
        return f"CharTokenizer({self.kind}, vocab={self.vocab_size})"
