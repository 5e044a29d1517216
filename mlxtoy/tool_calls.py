"""Tool calls in a model's output, in the forms chat templates teach (and `mlxtoy train` trains,
`mlxtoy.train.formats`); the server (`mlxtoy.api`) turns them into OpenAI's `tool_calls`, whole
or streamed, and forces them for tool_choice "required" or a named function (a grammar):

- "tags" (Qwen2.5, Qwen3, Hermes, SmolLM3): each call a JSON object {"name": ..., "arguments":
  {...}} between <tool_call> and </tool_call>, anywhere in the reply;
- "json" (Llama 3.1-3.3): the whole reply one JSON object {"name": ..., "parameters": {...}}
  (after <|python_tag|> where the model writes one), or several joined by "; ";
- "list" (Mistral 7B v0.3, Mixtral 8x22B, Mistral Nemo): the whole reply [TOOL_CALLS] and a JSON
  array of {"name": ..., "arguments": {...}, "id": ...}; those templates take only ids of 9
  letters and digits, so the calls read in this form get such ids.

What is not such a call stays text: the client sees what the model wrote.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from mlxtoy.generate import held_back

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
TOOL_CALLS = "[TOOL_CALLS]"
# JSON as templates write it (tojson: ", " and ": "), no free whitespace for a model to wander into
TEMPLATE_JSON = {"x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}}


@dataclass(frozen=True)
class CallFormat:
    kind: str  # "tags", "json" or "list"
    arguments: str  # the key of a call's arguments

    def reader(self) -> "CallReader | ReplyReader":
        return CallReader() if self.kind == "tags" else ReplyReader(self.kind)

    def read(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """A whole reply -> (its content: the text outside the calls, stripped beside calls and
        None if nothing is left; the calls)."""
        reader = self.reader()
        content = reader.add(text)[0] + reader.finish()
        if reader.calls:
            return content.strip() or None, reader.calls
        return content, reader.calls

    def grammar(self, tools: list[dict[str, Any]], name: str | None = None) -> str:
        """A Lark grammar (llguidance's) for one or more calls and nothing else, each of one of
        `tools` (of `name` only, where given) with arguments matching its parameters' schema."""
        calls = []
        for tool in tools:
            fn = tool["function"]
            if name is not None and fn["name"] != name:
                continue
            calls.append({"type": "object", "properties": {"name": {"const": fn["name"]},
                                                           self.arguments: fn.get("parameters") or {"type": "object"}},
                          "required": ["name", self.arguments], "additionalProperties": False})
        schema = dict(calls[0] if len(calls) == 1 else {"anyOf": calls}, **TEMPLATE_JSON)
        if self.kind == "tags":
            return (f"start: block (\"\\n\" block)*\n"
                    f"block: {json.dumps(OPEN + chr(10))} call {json.dumps(chr(10) + CLOSE)}\n"
                    f"call: %json {json.dumps(schema)}\n")
        if self.kind == "list":
            return f"start: {json.dumps(TOOL_CALLS + ' [')} call (\", \" call)* \"]\"\ncall: %json {json.dumps(schema)}\n"
        return f"start: call (\"; \" call)*\ncall: %json {json.dumps(schema)}\n"


def call_format(template: str | None) -> CallFormat | None:
    """The form a chat template writes an assistant's tool calls in, if one it is read for."""
    if not template:
        return None
    if OPEN in template:
        return CallFormat("tags", "arguments")
    if TOOL_CALLS in template:
        return CallFormat("list", "arguments")
    if '"parameters": ' in template and "tool_call" in template:
        return CallFormat("json", "parameters")
    return None


def as_call(block: Any, short_id: bool = False) -> dict[str, Any] | None:
    """A call's JSON text (or its value) -> OpenAI's tool call (arguments as JSON text), or None
    when it is not {"name": str, "arguments" or "parameters": object}. Its id is a fresh one,
    "call_" and 24 hex digits, or with `short_id` the 9 letters and digits the model wrote, or 9
    fresh hex digits (Mistral's templates take no other)."""
    if isinstance(block, str):
        try:
            obj = json.loads(block)
        except json.JSONDecodeError:
            return None
    else:
        obj = block
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    if not short_id:
        call_id = "call_" + uuid.uuid4().hex[:24]
    elif isinstance(obj.get("id"), str) and len(obj["id"]) == 9 and obj["id"].isalnum():
        call_id = obj["id"]
    else:
        call_id = uuid.uuid4().hex[:9]
    return {"id": call_id, "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


class CallReader:
    """Reads a reply's <tool_call> blocks as it streams: `add(text)` -> (text to pass on now,
    calls whose block closed). Text that may be the start of a block is held until it is known
    not to be; a block is held until it closes. `finish()` gives back what is held (an
    unclosed block is text)."""

    def __init__(self) -> None:
        self.held = ""
        self.calls: list[dict[str, Any]] = []  # every call read so far

    def add(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        self.held += text
        out, calls = "", []
        while True:
            start = self.held.find(OPEN)
            if start < 0:
                keep = held_back(self.held, [OPEN])
                out += self.held[:len(self.held) - keep]
                self.held = self.held[len(self.held) - keep:]
                break
            end = self.held.find(CLOSE, start)
            if end < 0:
                out += self.held[:start]
                self.held = self.held[start:]
                break
            call = as_call(self.held[start + len(OPEN):end].strip())
            if call is None:  # not a call after all: the block stays text
                out += self.held[:end + len(CLOSE)]
            else:
                out += self.held[:start]
                calls.append(call)
            self.held = self.held[end + len(CLOSE):]
        self.calls += calls
        # the whitespace a template puts around blocks is not content
        return (out if out.strip() or not self.calls else ""), calls

    def finish(self) -> str:
        held, self.held = self.held, ""
        return held


class ReplyReader:
    """Reads a reply that is all calls or all text (the "json" and "list" forms) as it streams:
    a reply that begins as calls begin (JSON or <|python_tag|>; [TOOL_CALLS]) could be calls, so
    it is held to its end; then `finish()` reads the calls into `calls` or gives the text back."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.held = ""
        self.passing = False  # known to be text: passed on as it comes
        self.calls: list[dict[str, Any]] = []

    def may_be_a_call(self, head: str) -> bool:
        if self.kind == "list":
            return TOOL_CALLS.startswith(head[:len(TOOL_CALLS)])
        return head[0] == "{" or PYTHON_TAG.startswith(head[:len(PYTHON_TAG)])

    def add(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        if self.passing:
            return text, []
        self.held += text
        head = self.held.lstrip()
        if not head or self.may_be_a_call(head):
            return "", []
        self.passing = True
        held, self.held = self.held, ""
        return held, []

    def finish(self) -> str:
        held, self.held = self.held, ""
        text = held.strip()
        if self.kind == "list":
            parts = json_parts(text.removeprefix(TOOL_CALLS)) if text.startswith(TOOL_CALLS) else []
            items = json.loads(parts[0]) if len(parts) == 1 else None
            calls = [as_call(item, short_id=True) for item in items] if isinstance(items, list) else []
        else:
            calls = [as_call(part) for part in json_parts(text.removeprefix(PYTHON_TAG))]
        if calls and all(calls):
            self.calls += calls
            return ""
        return held


def json_parts(text: str) -> list[str]:
    """The JSON values of `text` one after another, joined by ";" and whitespace (each part's
    own text); [] when anything else is there."""
    decoder, parts, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and (text[i].isspace() or (text[i] == ";" and parts)):
            i += 1
        if i == len(text):
            return parts
        try:
            end = decoder.raw_decode(text, i)[1]
        except json.JSONDecodeError:
            return []
        parts.append(text[i:end])
        i = end
