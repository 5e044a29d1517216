"""The data formats, one class each: how a JSON object or table row of that kind is recognised
and checked, how it is rendered to tokens with its loss mask, its prompt (for samples and
accuracy), and the preview the TUI shows. The trainer's batches and the TUI's data preview
both go through these classes; nothing else branches on a record's kind.

| kind         | the file says                                               | trained tokens        |
|--------------|-------------------------------------------------------------|-----------------------|
| `text`       | `{"text"}`                                                  | all                   |
| `completion` | `{"prompt", "completion"}`                                  | the completion        |
| `chat`       | `{"messages": [{"role", "content"}, ...]}`, optional `"tools"` | every assistant turn (its tool calls too) |
| `stream`     | a `.txt` file: one text, cut into windows of seq_len tokens | all                   |
| `pref`       | `{"prompt", "chosen", "rejected"}` (optional `"system"`), or TRL's conversational `{"chosen": [messages], "rejected": [messages]}` whose shared prefix is the prompt | each side's completion (DPO, ORPO) |
| `prompt`     | `{"prompt", "answer"}` (optional `"system"`) or `{"messages", "answer"}`; every column is kept for the rewards | none: GRPO samples the completions |

With `mask_prompt` off (`--no-mask-prompt`) a completion or conversation trains every token.

Tool calling, as transformers, TRL and mlx-lm take it: a row's `"tools"` (JSON schemas, or a
JSON string of them) go to the chat template as its `tools` variable; an assistant message may
carry `"tool_calls"` (OpenAI's form, `content` then optional) and `"tool"` messages the results
(`tool_call_id`, `name`). A template that leaves a turn's tool calls out is an error naming the
row: training on that turn would teach an empty reply.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Sequence

from mlxtoy.errors import UserError
from mlxtoy.textio import check_string

Tokens = tuple[list[int], list[bool]]  # token ids, and which of them are trained


@dataclass
class Record:
    where: str  # "file:line" or "<table> row N"
    kind: str  # "text" | "completion" | "chat" | "stream" | "pref" | "prompt": a Format's kind
    # str | (prompt, completion) | list of messages | (prompt messages, chosen, rejected) |
    # (prompt messages, answer, the row's columns)
    value: Any
    tools: list[dict[str, Any]] | None = None  # chat, pref, prompt: the row's tool definitions

    @property
    def format(self) -> "Format":
        """The class that knows this record's kind (FORMATS)."""
        return FORMATS[self.kind]


# ---------------------------------------------------------------------------------------------
# Rendering with a tokenizer: token ids and loss masks
# ---------------------------------------------------------------------------------------------


def with_template_kwargs(tokenizer, kwargs: dict[str, Any], where: str = "chat_template_kwargs"):
    """The tokenizer rendering every chat with `kwargs` too (a run's chat_template_kwargs);
    a variable the model's template never reads is an error, not a silent no-op."""
    if not kwargs:
        return tokenizer
    template = tokenizer.chat_template
    if not template:
        raise UserError(f"{where}: {tokenizer.source} has no chat template to give {', '.join(kwargs)} to")
    unread = [name for name in kwargs if name not in template]
    if unread:
        raise UserError(f"{where}: the chat template of {tokenizer.source} does not read {unread[0]!r}")
    return tokenizer.with_template_kwargs(kwargs)


def common_prefix(a: Sequence, b: Sequence) -> int:
    """How many leading items (token ids, or characters) a and b share."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Renderer:
    """Turns messages and texts into token ids and loss masks for one tokenizer."""

    def __init__(self, tokenizer, mask_prompt: bool = True):
        self.tok = tokenizer
        self.mask_prompt = mask_prompt
        self.has_template = bool(tokenizer.chat_template)

    def render_text(self, messages, add_generation_prompt: bool, where: str,
                    tools: list[dict[str, Any]] | None = None) -> str:
        extra = {"tools": tools} if tools else {}
        try:
            return self.tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **extra)
        except UserError:
            raise
        except Exception as e:
            raise UserError(f"{where}: the chat template failed ({type(e).__name__}: {e})") from None

    def render(self, messages, add_generation_prompt: bool, where: str,
               tools: list[dict[str, Any]] | None = None) -> list[int]:
        return self.tok.encode(self.render_text(messages, add_generation_prompt, where, tools), add_bos=False)

    def token_ends(self, ids: list[int], text: str) -> list[int] | None:
        """Each token's end as a byte offset into `text` (None when the tokens' bytes do not
        spell `text` exactly, e.g. a SentencePiece space prefix)."""
        ends, at = [], 0
        for t in ids:
            at += len(self.tok.decode_token_bytes(t))
            ends.append(at)
        return ends if at == len(text.encode("utf-8")) else None

    def _eos(self, ids: list[int]) -> list[int]:
        eos = self.tok.eos_id
        if eos is not None and (not ids or ids[-1] != eos):
            ids = ids + [eos]
        return ids

    def chat(self, messages: list[dict], where: str, tools: list[dict[str, Any]] | None = None) -> Tokens:
        if not self.has_template:
            raise UserError(f"{where}: chat data needs a chat template, and this tokenizer has none "
                            f"(use {{\"text\"}} or {{\"prompt\",\"completion\"}})")
        text = self.render_text(messages, False, where, tools)
        full = self.tok.encode(text, add_bos=False)
        ends = self.token_ends(full, text)
        loss = [not self.mask_prompt] * len(full)
        # Each assistant turn is the text that rendering messages[:i+1] adds to the rendering
        # of messages[:i] with the generation prompt (common prefixes: templates that render a
        # turn differently once later turns follow). The tokens overlapping it train, as in
        # transformers' assistant mask; a token merged across the boundary carries the turn's
        # first character, so it trains. Tool calls are part of their assistant turn; tool
        # results are the next turn's prompt.
        for i, m in enumerate(messages):
            if m["role"] != "assistant" or not (self.mask_prompt or m.get("tool_calls")):
                continue
            before = self.render_text(messages[:i], True, where, tools) if i else ""
            through = text if i == len(messages) - 1 else self.render_text(messages[: i + 1], False, where, tools)
            first, last = common_prefix(before, text), common_prefix(through, text)
            check_calls_rendered(m, i, text[first:last], where)
            if ends is not None:
                lo, hi = len(text[:first].encode("utf-8")), len(text[:last].encode("utf-8"))
                start = next((t for t, e in enumerate(ends) if e > lo), len(full))
                end = next((t for t, e in enumerate(ends) if e >= hi), len(full) - 1) + 1 if hi > lo else start
            else:  # token-level prefixes of the renderings
                start = common_prefix(self.tok.encode(before, add_bos=False), full) if i else 0
                end = common_prefix(self.tok.encode(through, add_bos=False), full)
            if self.mask_prompt:
                loss[start:end] = [True] * max(0, end - start)
        return full, loss

    def final_turn(self, messages: list[dict], where: str, tools: list[dict[str, Any]] | None = None) -> Tokens:
        """Like `chat`, but only the final assistant turn (and the end-of-turn tokens the
        template adds after it) is trained: a preference pair's completion. For a one-turn
        conversation this is `chat`'s mask."""
        if not self.has_template:
            raise UserError(f"{where}: chat data needs a chat template, and this tokenizer has none")
        full = self.render(messages, False, where, tools)
        start = common_prefix(self.render(messages[:-1], True, where, tools), full)
        return full, [t >= start for t in range(len(full))]

    def pair_side(self, prompt: list[dict], completion: str, where: str,
                  tools: list[dict[str, Any]] | None = None) -> Tokens:
        """One completion of a preference pair after its prompt messages: ids and loss mask
        (the completion only), as SFT renders the same conversation."""
        if self.has_template:
            return self.final_turn(prompt + [{"role": "assistant", "content": completion}], where, tools)
        if len(prompt) != 1 or prompt[0]["role"] != "user":
            raise UserError(f"{where}: a system message or a conversation needs a chat template, "
                            f"and this tokenizer has none")
        return Renderer(self.tok, True).completion(prompt[0]["content"], completion, where)

    def completion(self, prompt: str, completion: str, where: str) -> Tokens:
        if self.has_template:
            return self.chat([{"role": "user", "content": prompt},
                              {"role": "assistant", "content": completion}], where)
        p = self.tok.encode(prompt)
        full = self._eos(self.tok.encode(prompt + completion))
        start = common_prefix(p, full) if self.mask_prompt else 0
        return full, [t >= start for t in range(len(full))]

    def text(self, text: str) -> Tokens:
        ids = self._eos(self.tok.encode(text))
        return ids, [True] * len(ids)

    def generation_prompt(self, messages: list[dict], where: str,
                          tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Prompt messages -> ids that ask for the assistant's reply. Without a chat template
        only a single user message can be asked (as its plain text)."""
        if self.has_template:
            return self.render(messages, True, where, tools)
        if len(messages) == 1 and messages[0]["role"] == "user":
            return self.tok.encode(messages[0]["content"])
        raise UserError(f"{where}: a system message or a conversation needs a chat template, "
                        f"and this tokenizer has none")

    def prompt_of(self, rec: Record) -> tuple[list[int], str | None]:
        """(prompt ids ready for generation, the exact expected answer or None)."""
        return rec.format.prompt(rec, self)

    def pieces(self, ids: list[int], loss: list[bool]) -> list[tuple[str, bool]]:
        """Token ids -> their text in runs of equal mask: [(text, trained), ...]."""
        out: list[tuple[str, bool]] = []
        start = 0
        for t in range(1, len(ids) + 1):
            if t == len(ids) or loss[t] != loss[start]:
                out.append((self.tok.decode(ids[start:t]), bool(loss[start])))
                start = t
        return out


# ---------------------------------------------------------------------------------------------
# The formats
# ---------------------------------------------------------------------------------------------


def clip(s: str, n: int) -> str:
    """Whitespace runs as one space, at most n characters (an ellipsis where cut)."""
    s = " ".join(s.split())
    return s if len(s) <= n else s[: n - 1] + "…"


# text a message may carry besides role and content (tool results, reasoning), kept for the template
MESSAGE_TEXT_KEYS = ("name", "tool_call_id", "reasoning_content", "thinking")


def check_messages(msgs: Any, where: str) -> list[dict[str, Any]]:
    """Chat messages, checked: role, content (a string; None or absent only beside
    `tool_calls`), and the tool-calling and reasoning keys templates read. Keys a table row
    holds as null (its schema's union) are left out, as a JSON object would leave them."""
    if not isinstance(msgs, list) or not msgs:
        raise UserError(f"{where}: 'messages' must be a non-empty list")
    out = []
    for i, m in enumerate(msgs):
        at = f"{where}: message {i}"
        if not isinstance(m, dict) or "role" not in m or (m.get("content") is None and not m.get("tool_calls")):
            raise UserError(f"{at} needs 'role' and 'content' (or, from the assistant, 'tool_calls')")
        msg: dict[str, Any] = {"role": str(m["role"]), "content": m.get("content")}
        if msg["content"] is not None:
            if not isinstance(msg["content"], str):
                raise UserError(f"{at} 'content' must be a string")
            check_string(msg["content"], at)
        if m.get("tool_calls"):
            msg["tool_calls"] = check_tool_calls(m["tool_calls"], at)
        for key in MESSAGE_TEXT_KEYS:
            if m.get(key) is not None:
                if not isinstance(m[key], str):
                    raise UserError(f"{at} '{key}' must be a string")
                check_string(m[key], f"{at} '{key}'")
                msg[key] = m[key]
        out.append(msg)
    return out


def check_tool_calls(calls: Any, at: str) -> list[dict[str, Any]]:
    """An assistant message's tool calls: each {"function": {"name", "arguments"}} (OpenAI's
    form, with "type" and "id" optional) or {"name", "arguments"}; arguments an object or its
    JSON text."""
    if not isinstance(calls, list):
        raise UserError(f"{at} 'tool_calls' must be a list")
    for j, call in enumerate(calls):
        fn = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise UserError(f"{at} tool call {j} needs a function 'name'")
        if not isinstance(fn.get("arguments", {}), (dict, str)):
            raise UserError(f"{at} tool call {j} 'arguments' must be an object or its JSON text")
    return calls


def check_tools(obj: dict, where: str) -> list[dict[str, Any]] | None:
    """A row's "tools": a list of JSON schemas, or that list as JSON text (tables often hold it
    so); None when the row has none."""
    tools = obj.get("tools")
    if tools is None:
        return None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools) if tools.strip() else []
        except json.JSONDecodeError as e:
            raise UserError(f"{where}: field 'tools' is text but not JSON ({e.msg})") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise UserError(f"{where}: field 'tools' must be a list of tool definitions (JSON objects)")
    return tools or None


def call_names(message: dict[str, Any]) -> list[str]:
    """The function names of an assistant message's tool calls."""
    return [call.get("function", call)["name"] for call in message.get("tool_calls") or ()]


def check_calls_rendered(message: dict[str, Any], i: int, turn_text: str, where: str) -> None:
    """The template wrote every tool call of message i into its turn (some templates have no
    tool-call block and drop them silently)."""
    missing = [name for name in call_names(message) if name not in turn_text]
    if missing:
        raise UserError(f"{where}: the chat template leaves out the tool call {missing[0]!r} of message {i} "
                        f"(it has no tool-call block); use a model whose template renders tool calls, "
                        f"or write the call into 'content'")


def message_text(m: dict[str, Any]) -> str:
    """A message as the preview shows it: its content, then its tool calls."""
    calls = " ".join(f"{name}(…)" for name in call_names(m))
    return " ".join(x for x in (m.get("content") or "", calls and f"→ {calls}") if x)


def check_strings(obj: dict, keys: tuple[str, ...], where: str) -> None:
    for key in keys:
        if not isinstance(obj[key], str):
            raise UserError(f"{where}: field '{key}' must be a string")
        check_string(obj[key], f"{where}: field '{key}'")


def prompt_messages(obj: dict) -> list[dict[str, str]]:
    """A row's "prompt" string (and optional "system" string) as chat messages."""
    return ([{"role": "system", "content": obj["system"]}] if "system" in obj else []) + [
        {"role": "user", "content": obj["prompt"]}]


def last_user(messages: list[dict]) -> str:
    return next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")


class Format:
    """One record kind. Subclasses override what differs; every method takes the record."""

    kind = ""
    # for kinds only some objectives train on: (what they are called, the objectives that take them)
    needs: tuple[str, str] | None = None
    windowed = False  # one long text, cut into windows of seq_len tokens (not truncated)
    answer_at_end = False  # truncating it cuts the answer off (so truncating all is an error)

    def matches(self, obj: dict) -> bool:
        """Whether a JSON object or table row (a dict) is of this kind."""
        return False

    def parse(self, obj: dict, where: str) -> Record:
        """The object -> a checked Record; errors name `where`."""
        raise NotImplementedError

    def sequences(self, rec: Record, r: Renderer) -> list[Tokens]:
        """The token sequences the trainer builds from the record, each with its loss mask
        (before truncation to seq_len + 1 and before the first token is unmarked)."""
        raise NotImplementedError

    def prompt(self, rec: Record, r: Renderer) -> tuple[list[int], str | None]:
        """(prompt ids ready for generation, the exact expected answer or None)."""
        ids = r.tok.encode(rec.value if isinstance(rec.value, str) else "")
        return ids[: max(1, len(ids) // 2)], None

    def prompt_text(self, rec: Record) -> str:
        """The prompt as a person wrote it (samples, accuracy reports)."""
        return str(rec.value)

    def preview(self, rec: Record) -> list[tuple[str, str]]:
        """[(label, text), ...], the text clipped: what the TUI shows of the record."""
        return [("", clip(str(rec.value), 140))]


class TextFormat(Format):
    kind = "text"

    def matches(self, obj: dict) -> bool:
        return "text" in obj

    def parse(self, obj: dict, where: str) -> Record:
        check_strings(obj, ("text",), where)
        return Record(where, self.kind, obj["text"])

    def sequences(self, rec: Record, r: Renderer) -> list[Tokens]:
        return [r.text(rec.value)]


class StreamFormat(TextFormat):
    """A `.txt` file: consecutive windows sharing one boundary token, so every token is
    predicted exactly once."""

    kind = "stream"
    windowed = True

    def matches(self, obj: dict) -> bool:
        return False  # a .txt file, never a JSON object

    def parse_text(self, text: str, where: str) -> list[Record]:
        return [Record(where, self.kind, text)] if text.strip() else []


class CompletionFormat(Format):
    kind = "completion"
    answer_at_end = True

    def matches(self, obj: dict) -> bool:
        return "prompt" in obj or "completion" in obj

    def parse(self, obj: dict, where: str) -> Record:
        for key in ("prompt", "completion"):
            if key not in obj:  # a prompt alone: grpo's rows, missing their answer?
                hint = " (or 'answer', for --objective grpo)" if key == "completion" else ""
                raise UserError(f"{where}: missing field '{key}'{hint}")
            check_strings(obj, (key,), where)
        return Record(where, self.kind, (obj["prompt"], obj["completion"]))

    def sequences(self, rec: Record, r: Renderer) -> list[Tokens]:
        return [r.completion(*rec.value, rec.where)]

    def prompt(self, rec: Record, r: Renderer) -> tuple[list[int], str | None]:
        prompt, answer = rec.value
        if r.has_template:
            return r.render([{"role": "user", "content": prompt}], True, rec.where), answer
        return r.tok.encode(prompt), answer

    def prompt_text(self, rec: Record) -> str:
        return rec.value[0]

    def preview(self, rec: Record) -> list[tuple[str, str]]:
        return [("prompt", clip(rec.value[0], 60)), ("→", clip(rec.value[1], 60))]


class ChatFormat(Format):
    kind = "chat"
    answer_at_end = True

    def matches(self, obj: dict) -> bool:
        return "messages" in obj

    def parse(self, obj: dict, where: str) -> Record:
        return Record(where, self.kind, check_messages(obj["messages"], where), check_tools(obj, where))

    def sequences(self, rec: Record, r: Renderer) -> list[Tokens]:
        return [r.chat(rec.value, rec.where, rec.tools)]

    def prompt(self, rec: Record, r: Renderer) -> tuple[list[int], str | None]:
        msgs = rec.value
        last = max((i for i, m in enumerate(msgs) if m["role"] == "assistant"), default=None)
        if last is None:
            return r.render(msgs, True, rec.where, rec.tools), None
        return r.render(msgs[:last], True, rec.where, rec.tools), msgs[last]["content"]

    def prompt_text(self, rec: Record) -> str:
        return last_user(rec.value)

    def preview(self, rec: Record) -> list[tuple[str, str]]:
        return [(f"{m['role']}:", clip(message_text(m), 50)) for m in rec.value[:3]]


class PromptedFormat(Format):
    """The kinds whose value starts with (prompt messages, the expected completion, ...)."""

    def prompt(self, rec: Record, r: Renderer) -> tuple[list[int], str | None]:
        """Without a chat template the last message's text is the prompt."""
        prompt, expected = rec.value[0], str(rec.value[1])
        if r.has_template:
            return r.render(prompt, True, rec.where, rec.tools), expected
        return r.tok.encode(prompt[-1]["content"] or ""), expected

    def prompt_text(self, rec: Record) -> str:
        return last_user(rec.value[0])


class PairFormat(PromptedFormat):
    """Preference pairs (DPO, ORPO; batched by mlxtoy.train.pairs): (prompt messages, chosen
    text, rejected text). Each side is rendered as SFT renders that conversation."""

    kind = "pref"
    needs = ("preference pairs", "dpo or orpo")

    def matches(self, obj: dict) -> bool:
        return "chosen" in obj or "rejected" in obj

    def parse(self, obj: dict, where: str) -> Record:
        for key in ("chosen", "rejected"):
            if key not in obj:
                raise UserError(f"{where}: missing field '{key}' (a preference pair needs 'chosen' and 'rejected')")
        chosen, rejected = obj["chosen"], obj["rejected"]
        if isinstance(chosen, list) or isinstance(rejected, list):
            c, r = check_messages(chosen, where), check_messages(rejected, where)
            for name, msgs in (("chosen", c), ("rejected", r)):
                if msgs[-1]["role"] != "assistant" or not isinstance(msgs[-1]["content"], str):
                    raise UserError(f"{where}: '{name}' must end with an assistant turn whose 'content' is "
                                    f"the completion")
            if c[:-1] != r[:-1]:
                raise UserError(f"{where}: 'chosen' and 'rejected' must share every message but the "
                                f"final assistant turn (the prompt)")
            prompt, chosen, rejected = c[:-1], c[-1]["content"], r[-1]["content"]
        else:
            if "prompt" not in obj:
                raise UserError(f"{where}: missing field 'prompt' (string 'chosen'/'rejected' need one)")
            for key in ("prompt", "chosen", "rejected") + (("system",) if "system" in obj else ()):
                if not isinstance(obj[key], str):
                    raise UserError(f"{where}: field '{key}' must be a string")
            prompt = prompt_messages(obj)
        for name, text in (("chosen", chosen), ("rejected", rejected)):
            if not text.strip():
                raise UserError(f"{where}: empty completion in '{name}'")
        if chosen == rejected:
            raise UserError(f"{where}: 'chosen' and 'rejected' are identical (nothing to prefer)")
        return Record(where, self.kind, (prompt, chosen, rejected), check_tools(obj, where))

    def sequences(self, rec: Record, r: Renderer) -> list[Tokens]:
        """[chosen, rejected]: the completion trained, never the prompt (mask_prompt ignored)."""
        prompt, chosen, rejected = rec.value
        return [r.pair_side(prompt, text, rec.where, rec.tools) for text in (chosen, rejected)]

    def preview(self, rec: Record) -> list[tuple[str, str]]:
        prompt, chosen, rejected = rec.value
        return [("prompt", clip(message_text(prompt[-1]), 50)), ("chosen", clip(chosen, 30)),
                ("rejected", clip(rejected, 30))]


class PromptFormat(PromptedFormat):
    """GRPO's rows (mlxtoy.train.grpo): (prompt messages, answer, every column of the row, for
    the rewards). Nothing of the row is trained: the completions are sampled."""

    kind = "prompt"
    needs = ("prompt/answer rows", "grpo")

    def matches(self, obj: dict) -> bool:
        return "answer" in obj and ("prompt" in obj or "messages" in obj) and "completion" not in obj

    def parse(self, obj: dict, where: str) -> Record:
        if "messages" in obj:
            messages = check_messages(obj["messages"], where)
        else:
            check_strings(obj, ("prompt",) + (("system",) if "system" in obj else ()), where)
            messages = prompt_messages(obj)
        if obj["answer"] is None:
            raise UserError(f"{where}: field 'answer' is empty (null)")
        return Record(where, self.kind, (messages, obj["answer"], dict(obj)), check_tools(obj, where))

    def sequences(self, rec: Record, r: Renderer) -> list[Tokens]:
        ids = r.generation_prompt(rec.value[0], rec.where, rec.tools)
        return [(ids, [False] * len(ids))]

    def preview(self, rec: Record) -> list[tuple[str, str]]:
        prompt, answer, _ = rec.value
        return [("prompt", clip(message_text(prompt[-1]), 60)), ("answer", clip(str(answer), 40))]


# in the order a JSON object is recognised: the first whose `matches` says yes reads it
RECOGNISED = (PairFormat(), PromptFormat(), ChatFormat(), CompletionFormat(), TextFormat())
STREAM = StreamFormat()
FORMATS: dict[str, Format] = {f.kind: f for f in RECOGNISED + (STREAM,)}


def parse_object(obj: Any, where: str) -> Record:
    """One JSON object or table row -> Record, checked; errors name `where`."""
    if not isinstance(obj, dict):
        raise UserError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    for fmt in RECOGNISED:
        if fmt.matches(obj):
            return fmt.parse(obj, where)
    raise UserError(f"{where}: missing field: expected 'text', 'prompt'/'completion', 'messages' "
                    f"or 'chosen'/'rejected' (got {', '.join(sorted(obj)) or 'an empty object'})")


def as_trained(ids: list[int], loss: list[bool], seq_len: int | None) -> Tokens:
    """What the trainer keeps of a sequence: at most seq_len + 1 tokens (a stream: its first
    window; None: all), and the first token is never predicted."""
    keep = len(ids) if seq_len is None else seq_len + 1
    return ids[:keep], [bool(t) and i > 0 for i, t in enumerate(loss[:keep])]
