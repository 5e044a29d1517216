"""Tool calls in a model's output, as the chat templates of Qwen2.5/Qwen3, Hermes and SmolLM3
have the model write them (and `mlxtoy train` trains them, `mlxtoy.train.formats`): each call
a JSON object {"name": ..., "arguments": {...}} between <tool_call> and </tool_call>. The
server (`mlxtoy.api`) turns them into OpenAI's `tool_calls`, whole or streamed.

A block that is not such a JSON object stays text: the client sees what the model wrote.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from mlxtoy.generate import held_back

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def template_writes_calls(template: str | None) -> bool:
    """Whether a chat template writes tool calls as <tool_call> blocks (so the model was taught
    to, and its output is read for them)."""
    return bool(template) and OPEN in template


def forced_calls_grammar(tools: list[dict[str, Any]], name: str | None = None) -> str:
    """A Lark grammar (llguidance's) for one or more <tool_call> blocks and nothing else, each a
    call of one of `tools` (of `name` only, where given) with arguments matching its parameters'
    schema: OpenAI's tool_choice "required" or a named function."""
    calls = []
    for tool in tools:
        fn = tool["function"]
        if name is not None and fn["name"] != name:
            continue
        params = fn.get("parameters") or {"type": "object"}
        calls.append({"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": params},
                      "required": ["name", "arguments"], "additionalProperties": False})
    schema = dict(calls[0] if len(calls) == 1 else {"anyOf": calls},
                  # JSON as templates write it (tojson: ", " and ": "), no free whitespace to wander into
                  **{"x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}})
    return (f"start: block (\"\\n\" block)*\n"
            f"block: {json.dumps(OPEN + chr(10))} call {json.dumps(chr(10) + CLOSE)}\n"
            f"call: %json {json.dumps(schema)}\n")


def as_call(block: str) -> dict[str, Any] | None:
    """A block's text -> OpenAI's tool call (a fresh id; arguments as JSON text), or None when
    it is not {"name": str, "arguments": object}."""
    try:
        obj = json.loads(block)
    except json.JSONDecodeError:
        return None
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
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


class CallReader:
    """Reads a choice's text as it streams: `add(text)` -> (text to pass on now, calls whose
    block closed). Text that may be the start of a block is held until it is known not to be;
    a block is held until it closes. `finish()` gives back what is held (an unclosed block is
    text)."""

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


def read_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """A whole choice's text -> (its content: the text outside the calls, stripped beside calls
    and None if nothing is left; the calls)."""
    reader = CallReader()
    content, calls = reader.add(text)
    content += reader.finish()
    if calls:
        return content.strip() or None, calls
    return content, calls

