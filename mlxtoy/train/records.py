"""Training data as the files say it: records, checked, each with where it came from.

What a record is, per format (text, prompt/completion, messages, `.txt` streams, preference
pairs, GRPO's prompt/answer rows), lives in mlxtoy.train.formats: this module finds the files
and rows and hands each object to `parse_object` there.

`data` is one file (split into train/valid deterministically from the seed) or a folder with
`train.jsonl|train.txt` and optionally `valid.*` and `test.*`. Also a `.parquet`, `.csv` or
`.arrow` file or folder, or a Hugging Face dataset id, whose rows (io.tables, through `datasets`)
go through the same checks as JSONL objects, named "<file> row N". `DataOptions` picks the
split / subset and renames columns (`--prompt-column question` ...) for every format.
Every byte is read through mlxtoy.textio, so bad input is one error naming file:line.
A file holds one format.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from mlxtoy.errors import UserError
from mlxtoy.io.tables import Table, dataset_id, is_table_file, is_table_folder, read_tables
from mlxtoy.textio import iter_lines, parse_json, read_text
from mlxtoy.train.formats import STREAM, Record, parse_object

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


def check_one_format(prev: Record | None, rec: Record) -> None:
    if prev is not None and rec.kind != prev.kind:
        raise UserError(f"{rec.where}: mixes formats ({rec.kind} after {prev.kind})")


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
        check_one_format(records[-1] if records else None, rec)
        records.append(rec)
    return records


def parse_rows(table: Table, opts: DataOptions | None = None) -> list[Record]:
    """A table's rows (io.tables) -> Records, with JSONL's checks; `where` is "<label> row N"."""
    opts = opts or DataOptions()
    records: list[Record] = []
    for i, row in enumerate(table.rows, 1):
        where = f"{table.label} row {i}"
        rec = parse_object(opts.rename(row, where), where)
        check_one_format(records[-1] if records else None, rec)
        records.append(rec)
    return records


def parse_txt(path: str) -> list[Record]:
    return STREAM.parse_text(read_text(path), f"{path}:1")


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
            name, objectives = rec.format.needs
            raise UserError(f"{rec.where}: {name} need --objective {objectives} (the objective is {objective})")
