"""Training data as the files say it: records, checked, each with where it came from.

Formats (mlx-lm's three JSONL formats, plus plain text):
- `{"text": ...}`: every token is trained.
- `{"prompt": ..., "completion": ...}`: loss on the completion only (`mask_prompt`).
- `{"messages": [{"role", "content"}, ...]}`: rendered with the model's chat template.
- `.txt`: one continuous stream, cut into windows of `seq_len` tokens.
- Preference pairs (DPO, ORPO; tokenized and batched by mlxtoy.train.pairs):
  `{"prompt", "chosen", "rejected"}` strings (optional `"system"`), or TRL's conversational
  `{"chosen": [messages], "rejected": [messages]}` whose shared prefix is the prompt and whose
  differing final assistant turns are the completions. Both become kind "pref".
- Prompts to sample from (GRPO; mlxtoy.train.grpo): `{"prompt", "answer"}` (optional
  `"system"`) or `{"messages": [...], "answer"}`; every other column is kept for the rewards.
  Kind "prompt".

`data` is one file (split into train/valid deterministically from the seed) or a folder with
`train.jsonl|train.txt` and optionally `valid.*` and `test.*`. Also a `.parquet`, `.csv` or
`.arrow` file or folder, or a Hugging Face dataset id, whose rows (io.tables, through `datasets`)
go through the same checks as JSONL objects, named "<file> row N". `DataOptions` picks the
split / subset and renames columns (`--prompt-column question` ...) for every format.
Every byte is read through mlxtoy.textio, so bad input is one error naming file:line.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from mlxtoy.errors import UserError
from mlxtoy.io.tables import Table, dataset_id, is_table_file, is_table_folder, read_tables
from mlxtoy.textio import check_string, iter_lines, parse_json, read_text


@dataclass
class Record:
    where: str  # "file:line"
    kind: str  # "text" | "completion" | "chat" | "stream" | "pref" | "prompt"
    # str | (prompt, completion) | list of messages | (prompt messages, chosen, rejected) |
    # (prompt messages, answer, the row's columns)
    value: Any


PREF_KIND = "pref"
PROMPT_KIND = "prompt"
# what the kinds that only some objectives train on are called, and which objectives take them
KIND_NEEDS = {PREF_KIND: ("preference pairs", "dpo or orpo"), PROMPT_KIND: ("prompt/answer rows", "grpo")}


def _check_prompt_row(obj: dict, where: str) -> Record:
    """A GRPO row -> Record("prompt", (prompt messages, answer, every column))."""
    if "messages" in obj:
        messages = _check_messages(obj["messages"], where)
    else:
        for key in ("prompt",) + (("system",) if "system" in obj else ()):
            if not isinstance(obj[key], str):
                raise UserError(f"{where}: field '{key}' must be a string")
            check_string(obj[key], f"{where}: field '{key}'")
        messages = ([{"role": "system", "content": obj["system"]}] if "system" in obj else []) + [
            {"role": "user", "content": obj["prompt"]}]
    if obj["answer"] is None:
        raise UserError(f"{where}: field 'answer' is empty (null)")
    return Record(where, PROMPT_KIND, (messages, obj["answer"], dict(obj)))


def _check_pref(obj: dict, where: str) -> Record:
    """A preference row -> Record("pref", (prompt messages, chosen text, rejected text))."""
    for key in ("chosen", "rejected"):
        if key not in obj:
            raise UserError(f"{where}: missing field '{key}' (a preference pair needs 'chosen' and 'rejected')")
    chosen, rejected = obj["chosen"], obj["rejected"]
    if isinstance(chosen, list) or isinstance(rejected, list):
        c, r = _check_messages(chosen, where), _check_messages(rejected, where)
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
        prompt = ([{"role": "system", "content": obj["system"]}] if "system" in obj else []) + [
            {"role": "user", "content": obj["prompt"]}]
    for name, text in (("chosen", chosen), ("rejected", rejected)):
        if not text.strip():
            raise UserError(f"{where}: empty completion in '{name}'")
    if chosen == rejected:
        raise UserError(f"{where}: 'chosen' and 'rejected' are identical (nothing to prefer)")
    return Record(where, PREF_KIND, (prompt, chosen, rejected))


def _check_messages(msgs: Any, where: str) -> list[dict[str, str]]:
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


COLUMN_ROLES = ("text", "prompt", "completion", "messages", "chosen", "rejected", "answer")  # the fields a record reads


@dataclass(frozen=True)
class DataOptions:
    """Which part of the data to read: the split to train on and the subset (tables and
    Hugging Face datasets), and columns to read as our fields ({"prompt": "question"})."""

    split: str = "train"
    subset: str | None = None
    columns: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of(cls, cfg: Any) -> "DataOptions":
        """From a TrainConfig: data_split, data_subset and the *_column fields."""
        cols = tuple((role, getattr(cfg, f"{role}_column")) for role in COLUMN_ROLES
                     if getattr(cfg, f"{role}_column", None))
        return cls(cfg.data_split, cfg.data_subset, cols)

    def rename(self, obj: dict[str, Any], where: str) -> dict[str, Any]:
        if not self.columns:
            return obj
        obj = dict(obj)
        for role, column in self.columns:
            if column not in obj:
                raise UserError(f"{where}: no column {column!r} (named by --{role}-column; "
                                f"has {', '.join(sorted(obj)) or 'none'})")
            obj[role] = obj.pop(column)
        return obj


def parse_object(obj: Any, where: str) -> Record:
    """One JSON object or table row -> Record, checked; errors name `where`."""
    if not isinstance(obj, dict):
        raise UserError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if "chosen" in obj or "rejected" in obj:
        return _check_pref(obj, where)
    if "answer" in obj and ("prompt" in obj or "messages" in obj) and "completion" not in obj:
        return _check_prompt_row(obj, where)
    if "messages" in obj:
        return Record(where, "chat", _check_messages(obj["messages"], where))
    if "prompt" in obj or "completion" in obj:
        for key in ("prompt", "completion"):
            if key not in obj:
                raise UserError(f"{where}: missing field '{key}'")
            if not isinstance(obj[key], str):
                raise UserError(f"{where}: field '{key}' must be a string")
            check_string(obj[key], f"{where}: field '{key}'")
        return Record(where, "completion", (obj["prompt"], obj["completion"]))
    if "text" in obj:
        if not isinstance(obj["text"], str):
            raise UserError(f"{where}: field 'text' must be a string")
        check_string(obj["text"], f"{where}: field 'text'")
        return Record(where, "text", obj["text"])
    raise UserError(f"{where}: missing field: expected 'text', 'prompt'/'completion', 'messages' "
                    f"or 'chosen'/'rejected' (got {', '.join(sorted(obj)) or 'an empty object'})")


def _one_format(records: list[Record]) -> list[Record]:
    for prev, rec in zip(records, records[1:]):
        if rec.kind != prev.kind:
            raise UserError(f"{rec.where}: mixes formats ({rec.kind} after {prev.kind})")
    return records


def parse_jsonl(path: str, opts: DataOptions | None = None) -> list[Record]:
    opts = opts or DataOptions()
    records: list[Record] = []
    # one record per line; decoding and JSON errors name the line (mlxtoy.textio)
    for lineno, line in iter_lines(path):
        where = f"{path}:{lineno}"
        if not line.strip():
            continue
        obj = parse_json(line, where)
        if isinstance(obj, dict):
            obj = opts.rename(obj, where)
        rec = parse_object(obj, where)
        if records and rec.kind != records[-1].kind:
            raise UserError(f"{where}: mixes formats ({rec.kind} after {records[-1].kind})")
        records.append(rec)
    return records


def parse_rows(table: Table, opts: DataOptions | None = None) -> list[Record]:
    """A table's rows (io.tables) -> Records, with JSONL's checks; `where` is "<label> row N"."""
    opts = opts or DataOptions()
    records = []
    for i, row in enumerate(table.rows, 1):
        where = f"{table.label} row {i}"
        records.append(parse_object(opts.rename(row, where), where))
    return _one_format(records)


def parse_txt(path: str) -> list[Record]:
    text = read_text(path)
    return [Record(f"{path}:1", "stream", text)] if text.strip() else []


def parse_file(path: str, opts: DataOptions | None = None) -> list[Record]:
    if path.endswith(".jsonl"):
        return parse_jsonl(path, opts)
    if path.endswith(".txt"):
        return parse_txt(path)
    if is_table_file(path):
        return parse_rows(read_tables(path).train, opts)
    raise UserError(f"{path}: unsupported data file (use .jsonl, .txt, .parquet, .csv or .arrow)")


def _find_split(folder: str, name: str) -> str | None:
    found = [os.path.join(folder, name + ext) for ext in (".jsonl", ".txt")
             if os.path.exists(os.path.join(folder, name + ext))]
    if len(found) > 1:
        raise UserError(f"{folder}: both {name}.jsonl and {name}.txt; keep one")
    return found[0] if found else None


@dataclass
class RawSplits:
    train: list[Record]
    valid: list[Record] | None  # None: split off train after tokenizing
    test: list[Record]
    train_path: str


def read_data(path: str, opts: DataOptions | None = None) -> RawSplits:
    """Parse the data (file, folder or dataset id); errors name file:line or file row N.
    No tokenizer needed."""
    opts = opts or DataOptions()
    if not path:
        raise UserError("no training data (--data PATH)")
    train = _find_split(path, "train") if os.path.isdir(path) else None
    if train is not None:
        valid = _find_split(path, "valid")
        test = _find_split(path, "test")
        splits = RawSplits(parse_file(train, opts), parse_file(valid, opts) if valid else None,
                           parse_file(test, opts) if test else [], train)
    elif os.path.isdir(path) and not is_table_folder(path):
        raise UserError(f"{path}: no train.jsonl or train.txt (or parquet, csv or arrow files)")
    elif os.path.isfile(path):
        splits = RawSplits(parse_file(path, opts), None, [], path)
    elif os.path.isdir(path) or (dataset_id(path) and not _looks_like_file(path)):
        tables = read_tables(path, opts.split, opts.subset)
        splits = RawSplits(parse_rows(tables.train, opts),
                           parse_rows(tables.valid, opts) if tables.valid else None,
                           parse_rows(tables.test, opts) if tables.test else [], tables.train.label)
    elif os.path.exists(path):
        raise UserError(f"{path}: not a regular file or folder")
    else:
        raise UserError(f"{path}: no such file or folder" + ("" if _looks_like_file(path) else
                                                             " (nor a Hugging Face dataset id, org/name)"))
    if not splits.train:
        raise UserError(f"{splits.train_path}: empty dataset (no examples)")
    return splits


def _looks_like_file(path: str) -> bool:
    return os.path.splitext(path)[1].lower() in (".jsonl", ".txt", ".json", ".parquet", ".csv", ".arrow")


def check_kinds(raw: RawSplits, objective: str, kinds: tuple[str, ...], wanted: str | None) -> None:
    """The objective trains on records of `kinds` (described as `wanted`, None for "the
    general formats"): say which file:line holds another kind (each file holds one format; the
    test split only needs prompts/answers)."""
    for recs in (raw.train, raw.valid or []):
        for rec in recs[:1]:
            if rec.kind in kinds:
                continue
            if wanted is not None:
                raise UserError(f"{rec.where}: --objective {objective} needs {wanted}, not {rec.kind} data")
            name, objectives = KIND_NEEDS[rec.kind]
            raise UserError(f"{rec.where}: {name} need --objective {objectives} (the objective is {objective})")
