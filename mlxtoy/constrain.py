"""Constrained decoding: output that must match a JSON schema (`response_format`) or a Lark
grammar (a forced tool call, `mlxtoy.tool_calls`), through llguidance (its grammar compiler and
token-mask computation), over the model's own vocabulary.

`Grammars(tokenizer, vocab_size)` wraps a tokenizer once (llguidance reads every token's bytes;
the end-of-sequence tokens end a match); `.json_schema(schema)` compiles a schema, raising
UserError with llguidance's message when it cannot; `.constraint(grammar)` is one row's
matcher, a `mlxtoy.engine.Constraint`: the tokens it allows next, and the token taken.
"""

from __future__ import annotations

import json
from typing import Any

import llguidance
import mlx.core as mx
import numpy as np

from mlxtoy.errors import UserError


class _Vocabulary:
    """What llguidance's TokenizerWrapper reads: each token's bytes, EOS/BOS, the special
    tokens (never matched as text) and the encoder."""

    def __init__(self, tokenizer, vocab_size: int):
        eos = sorted(tokenizer.eos_ids)
        self.eos_token_id = tokenizer.eos_id if tokenizer.eos_id is not None else (eos[0] if eos else None)
        self.bos_token_id = tokenizer.bos_id
        n = tokenizer.vocab_size
        is_special = getattr(tokenizer, "is_special", lambda i: i in tokenizer.eos_ids)
        self.tokens = [tokenizer.decode_token_bytes(i) if i < n else b"" for i in range(vocab_size)]
        self.special_token_ids = [i for i in range(n) if is_special(i)] + list(range(n, vocab_size))
        self._tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_bos=False, parse_special=False)


class Grammars:
    def __init__(self, tokenizer, vocab_size: int):
        self.vocab_size = vocab_size
        self.eos = sorted(tokenizer.eos_ids)
        wrapper = llguidance.TokenizerWrapper(_Vocabulary(tokenizer, vocab_size))
        self.tokenizer = llguidance.LLTokenizer(wrapper, n_vocab=vocab_size, eos_token=self.eos or None)

    def json_schema(self, schema: Any) -> str:
        """A grammar for JSON matching `schema` (a dict, or True for any JSON object)."""
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                {"type": "object"} if schema is True else schema,
                defaults={"whitespace_flexible": False})
        except (ValueError, TypeError) as e:
            raise UserError(f"the JSON schema cannot be compiled: {e}") from None
        return self.checked(grammar, "the JSON schema")

    def lark(self, text: str, what: str) -> str:
        """A grammar from llguidance's Lark syntax (`%json {schema}` for a JSON value inside
        it); `what` names it in the error when it cannot be compiled."""
        try:
            grammar = llguidance.LLMatcher.grammar_from_lark(text)
        except (ValueError, TypeError) as e:
            raise UserError(f"{what} cannot be compiled: {e}") from None
        return self.checked(grammar, what)

    def checked(self, grammar: str, what: str) -> str:
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if failed:
            raise UserError(f"{what} cannot be compiled: " + " ".join(messages[0].split()))
        return grammar

    def constraint(self, grammar: str) -> "GrammarConstraint":
        return GrammarConstraint(llguidance.LLMatcher(self.tokenizer, grammar, log_level=0), self.vocab_size, self.eos)


class GrammarConstraint:
    """One row's matcher: `allowed()` the next tokens (only the end-of-sequence tokens once
    the value is complete), `advance(token)` the one sampled."""

    def __init__(self, matcher: "llguidance.LLMatcher", vocab_size: int, eos: list[int]):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.eos = eos

    def allowed(self) -> mx.array:
        if self.matcher.is_error():  # (cannot happen for tokens it allowed) end the row, not the batch
            allow = np.zeros(self.vocab_size, dtype=bool)
            allow[self.eos] = True
            return mx.array(allow)
        bias = np.frombuffer(self.matcher.compute_logit_bias(), dtype=np.uint8)[:self.vocab_size]
        return mx.array(bias > 0)

    def advance(self, token: int) -> None:
        self.matcher.consume_token(token)


def schema_of(response_format: Any) -> Any:
    """OpenAI's `response_format` -> the JSON schema to match (True: any JSON object), or None
    for plain text; UserError naming what is wrong."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise UserError("response_format must be an object")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return True
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), (dict, bool)):
            raise UserError("response_format.json_schema must be an object with a `schema` object")
        schema = spec.get("schema", True)
        try:
            json.dumps(schema)
        except (TypeError, ValueError):
            raise UserError("response_format.json_schema.schema is not JSON") from None
        return schema
    raise UserError(f"response_format.type must be text, json_object or json_schema, got {kind!r}")
