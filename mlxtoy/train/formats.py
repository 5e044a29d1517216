"""The data formats, one class each: how a JSON object or table row of that kind is recognised
and checked, how it is rendered to tokens with its loss mask, its prompt (for samples and
accuracy), and the preview the TUI shows. The trainer's batches and the TUI's data preview
both go through these classes; nothing else branches on a record's kind.

| kind         | the file says                                               | trained tokens        |
|--------------|-------------------------------------------------------------|-----------------------|
| `text`       | `{"text"}`                                                  | all                   |
| `completion` | `{"prompt", "completion"}`                                  | the completion        |
| `chat`       | `{"messages": [{"role", "content"}, ...]}`                  | every assistant turn  |
| `stream`     | a `.txt` file: one text, cut into windows of seq_len tokens | all                   |
| `pref`       | `{"prompt", "chosen", "rejected"}` (optional `"system"`), or TRL's conversational `{"chosen": [messages], "rejected": [messages]}` whose shared prefix is the prompt | each side's completion (DPO, ORPO) |
| `prompt`     | `{"prompt", "answer"}` (optional `"system"`) or `{"messages", "answer"}`; every column is kept for the rewards | none: GRPO samples the completions |

With `mask_prompt` off (`--no-mask-prompt`) a completion or conversation trains every token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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

    @property
    def format(self) -> "Format":
        """The class that knows this record's kind (FORMATS)."""
        return FORMATS[self.kind]


# ---------------------------------------------------------------------------------------------
# Rendering with a tokenizer: token ids and loss masks
# ---------------------------------------------------------------------------------------------


def common_prefix(a: list[int], b: list[int]) -> int:
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

    def render(self, messages, add_generation_prompt: bool, where: str) -> list[int]:
        try:
            text = self.tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        except UserError:
            raise
        except Exception as e:
            raise UserError(f"{where}: the chat template failed ({type(e).__name__}: {e})") from None
        return self.tok.encode(text, add_bos=False)

    def _eos(self, ids: list[int]) -> list[int]:
        eos = self.tok.eos_id
        if eos is not None and (not ids or ids[-1] != eos):
            ids = ids + [eos]
        return ids

    def chat(self, messages: list[dict], where: str) -> Tokens:
        if not self.has_template:
            raise UserError(f"{where}: chat data needs a chat template, and this tokenizer has none "
                            f"(use {{\"text\"}} or {{\"prompt\",\"completion\"}})")
        full = self.render(messages, False, where)
        loss = [not self.mask_prompt] * len(full)
        if self.mask_prompt:
            # Each assistant turn is what rendering messages[:i+1] adds to the rendering of
            # messages[:i] with the generation prompt; common prefixes make this robust to
            # templates whose prefixes do not tokenize identically at the boundary.
            for i, m in enumerate(messages):
                if m["role"] != "assistant":
                    continue
                before = self.render(messages[:i], True, where) if i else []
                through = full if i == len(messages) - 1 else self.render(messages[: i + 1], False, where)
                start, end = common_prefix(before, full), common_prefix(through, full)
                for t in range(start, end):
                    loss[t] = True
        return full, loss

    def final_turn(self, messages: list[dict], where: str) -> Tokens:
        """Like `chat`, but only the final assistant turn (and the end-of-turn tokens the
        template adds after it) is trained: a preference pair's completion. For a one-turn
        conversation this is `chat`'s mask."""
        if not self.has_template:
            raise UserError(f"{where}: chat data needs a chat template, and this tokenizer has none")
        full = self.render(messages, False, where)
        start = common_prefix(self.render(messages[:-1], True, where), full)
        return full, [t >= start for t in range(len(full))]

    def pair_side(self, prompt: list[dict], completion: str, where: str) -> Tokens:
        """One completion of a preference pair after its prompt messages: ids and loss mask
        (the completion only), as SFT renders the same conversation."""
        if self.has_template:
            return self.final_turn(prompt + [{"role": "assistant", "content": completion}], where)
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

    def generation_prompt(self, messages: list[dict], where: str) -> list[int]:
        """Prompt messages -> ids that ask for the assistant's reply. Without a chat template
        only a single user message can be asked (as its plain text)."""
        if self.has_template:
            return self.render(messages, True, where)
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


def check_messages(msgs: Any, where: str) -> list[dict[str, str]]:
    if not isinstance(msgs, list) or not msgs:
        raise UserError(f"{where}: 'messages' must be a non-empty list")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise UserError(f"{where}: message {i} needs 'role' and 'content'")
        if not isinstance(m["content"], str):
            raise UserError(f"{where}: message {i} 'content' must be a string")
        check_string(m["content"], f"{where}: message {i}")
        out.append({"role": str(m["role"]), "content": m["content"]})
    return out


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
        return Record(where, self.kind, check_messages(obj["messages"], where))

    def sequences(self, rec: Record, r: Renderer) -> list[Tokens]:
        return [r.chat(rec.value, rec.where)]

    def prompt(self, rec: Record, r: Renderer) -> tuple[list[int], str | None]:
        msgs = rec.value
        last = max((i for i, m in enumerate(msgs) if m["role"] == "assistant"), default=None)
        if last is None:
            return r.render(msgs, True, rec.where), None
        return r.render(msgs[:last], True, rec.where), msgs[last]["content"]

    def prompt_text(self, rec: Record) -> str:
        return last_user(rec.value)

    def preview(self, rec: Record) -> list[tuple[str, str]]:
        return [(f"{m['role']}:", clip(m["content"], 50)) for m in rec.value[:3]]


class PromptedFormat(Format):
    """The kinds whose value starts with (prompt messages, the expected completion, ...)."""

    def prompt(self, rec: Record, r: Renderer) -> tuple[list[int], str | None]:
        """Without a chat template the last message's text is the prompt."""
        prompt, expected = rec.value[0], str(rec.value[1])
        if r.has_template:
            return r.render(prompt, True, rec.where), expected
        return r.tok.encode(prompt[-1]["content"]), expected

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
                if msgs[-1]["role"] != "assistant":
                    raise UserError(f"{where}: '{name}' must end with an assistant turn (the completion)")
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
        return Record(where, self.kind, (prompt, chosen, rejected))

    def sequences(self, rec: Record, r: Renderer) -> list[Tokens]:
        """[chosen, rejected]: the completion trained, never the prompt (mask_prompt ignored)."""
        prompt, chosen, rejected = rec.value
        return [r.pair_side(prompt, text, rec.where) for text in (chosen, rejected)]

    def preview(self, rec: Record) -> list[tuple[str, str]]:
        prompt, chosen, rejected = rec.value
        return [("prompt", clip(prompt[-1]["content"], 50)), ("chosen", clip(chosen, 30)),
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
        return Record(where, self.kind, (messages, obj["answer"], dict(obj)))

    def sequences(self, rec: Record, r: Renderer) -> list[Tokens]:
        ids = r.generation_prompt(rec.value[0], rec.where)
        return [(ids, [False] * len(ids))]

    def preview(self, rec: Record) -> list[tuple[str, str]]:
        prompt, answer, _ = rec.value
        return [("prompt", clip(prompt[-1]["content"], 60)), ("answer", clip(str(answer), 40))]


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
