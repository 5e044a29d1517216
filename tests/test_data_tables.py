"""Training data from parquet, csv and arrow files and folders: the same examples, the same
checks and the same errors as the equivalent JSONL (rows numbered from 1 instead of lines).

The tables are written here with pyarrow and Python's csv module, independently of the
`datasets` reader under test.
"""

from __future__ import annotations

import csv
import json
import os
import sys

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from helpers_train import byte_tokenizer, qa_rows, run_cli, write_jsonl
from mlxtoy.config import TrainConfig
from mlxtoy.errors import UserError
from mlxtoy.train.data import load_dataset, tokenize
from mlxtoy.train.records import DataOptions, read_data

TRICKY = ["plain", "a, comma", 'a "quoted" word', "two\nlines", "NA", "043", "ñ 中文 🤖", " spaced "]


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path, monkeypatch):
    """`datasets` keeps its prepared copies under the test's folder, not the user's cache."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "datasets-cache"))


@pytest.fixture
def tok(tmp_path):
    return byte_tokenizer(tmp_path)


def text_rows():
    return [{"text": t + " and more"} for t in TRICKY]


def completion_rows():
    rows = [{"prompt": t, "completion": str(i).zfill(3)} for i, t in enumerate(TRICKY)]
    return rows + [{"prompt": r["messages"][0]["content"], "completion": r["messages"][1]["content"]}
                   for r in qa_rows(12)]


def chat_rows():
    return qa_rows(12) + [{"messages": [{"role": "user", "content": t}, {"role": "assistant", "content": t[::-1]}]}
                          for t in TRICKY]


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def write_arrow(path, rows):
    table = pa.Table.from_pylist(rows)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    return str(path)


def write_csv(path, rows):
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return str(path)


WRITERS = {"parquet": write_parquet, "arrow": write_arrow, "csv": write_csv}
CASES = [("text", text_rows, "parquet"), ("text", text_rows, "csv"), ("text", text_rows, "arrow"),
         ("completion", completion_rows, "parquet"), ("completion", completion_rows, "csv"),
         ("completion", completion_rows, "arrow"), ("chat", chat_rows, "parquet"), ("chat", chat_rows, "arrow")]


@pytest.mark.parametrize("kind,rows,fmt", CASES, ids=[f"{k}-{f}" for k, _, f in CASES])
def test_tables_give_the_jsonl_examples(tmp_path, tok, kind, rows, fmt):
    rows = rows()
    jsonl = write_jsonl(str(tmp_path / "d.jsonl"), rows)
    table = WRITERS[fmt](tmp_path / f"d.{fmt}", rows)
    a, b = read_data(jsonl), read_data(table)
    assert [r.kind for r in b.train] == [kind] * len(rows)
    assert [r.value for r in b.train] == [r.value for r in a.train]  # "043" stays a string in CSV
    assert [r.where for r in b.train] == [f"{table} row {i}" for i in range(1, len(rows) + 1)]
    ea, sa = tokenize(a.train, tok, seq_len=64)
    eb, sb = tokenize(b.train, tok, seq_len=64)
    assert sa == sb and len(ea) == len(eb) > 0
    for x, y in zip(ea, eb):
        assert np.array_equal(x.tokens, y.tokens) and np.array_equal(x.loss, y.loss)
    # the seeded train / valid split of one file picks the same examples
    da, db = load_dataset(jsonl, tok, 64, seed=5), load_dataset(table, tok, 64, seed=5)
    assert [e.tokens.tolist() for e in da.valid] == [e.tokens.tolist() for e in db.valid]
    assert [e.tokens.tolist() for e in da.train] == [e.tokens.tolist() for e in db.train]


def test_table_folder_splits_match_jsonl_folder(tmp_path, tok):
    jdir, pdir = tmp_path / "j", tmp_path / "p"
    pdir.mkdir()
    rows = completion_rows()  # one schema for every split: datasets reads them as one table
    splits = {"train": rows[:12], "valid": rows[12:16], "test": rows[16:]}
    for name, rows in splits.items():
        write_jsonl(str(jdir / f"{name}.jsonl"), rows)
        # datasets' split names: "validation" (or valid / val / dev)
        write_parquet(pdir / f"{'validation' if name == 'valid' else name}.parquet", rows)
    a, b = read_data(str(jdir)), read_data(str(pdir))
    for part in ("train", "valid", "test"):
        assert [r.value for r in getattr(b, part)] == [r.value for r in getattr(a, part)], part
    assert b.valid[1].where == f"{pdir} validation row 2"
    da, db = load_dataset(str(jdir), tok, 64, raw=a), load_dataset(str(pdir), tok, 64, raw=b)
    assert [e.tokens.tolist() for e in db.valid] == [e.tokens.tolist() for e in da.valid]
    # --data-split picks another split to train on; no split by that name is one error
    assert [r.value for r in read_data(str(pdir), DataOptions(split="test")).train] == [r.value for r in a.test]
    with pytest.raises(UserError, match=r"no split 'tarin' \(splits: .*train"):
        read_data(str(pdir), DataOptions(split="tarin"))


def test_saved_dataset_folder(tmp_path):
    rows = completion_rows()
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows),
                          "test": datasets.Dataset.from_list(rows[:2])}).save_to_disk(str(tmp_path / "saved"))
    raw = read_data(str(tmp_path / "saved"))
    assert [r.value for r in raw.train] == [(r["prompt"], r["completion"]) for r in rows]
    assert len(raw.test) == 2 and raw.valid is None


@pytest.mark.parametrize("fmt", ["parquet", "csv"])
def test_column_options(tmp_path, fmt):
    rows = [{"question": f"{i}+1", "answer": str(i + 1), "id": i} for i in range(5)]
    table = WRITERS[fmt](tmp_path / f"q.{fmt}", rows)
    with pytest.raises(UserError, match=rf"q\.{fmt} row 1: missing field: expected 'text'"):
        read_data(table)
    cfg = TrainConfig(prompt_column="question", completion_column="answer")
    raw = read_data(table, DataOptions.of(cfg))
    assert [r.value for r in raw.train] == [(r["question"], r["answer"]) for r in rows]
    # the same option renames JSONL fields too
    jsonl = write_jsonl(str(tmp_path / "q.jsonl"), rows)
    assert [r.value for r in read_data(jsonl, DataOptions.of(cfg)).train] == [r.value for r in raw.train]
    with pytest.raises(UserError, match=r"row 1: no column 'query' \(named by --prompt-column"):
        read_data(table, DataOptions(columns=(("prompt", "query"),)))


@pytest.mark.parametrize("fmt", ["parquet", "csv"])
def test_pair_column_options(tmp_path, fmt):
    """--chosen-column / --rejected-column read a preference table with other names as the
    standard chosen/rejected JSONL gives it."""
    rows = [{"question": f"{i}+1=", "good": str(i + 1), "bad": str(i + 2)} for i in range(5)]
    table = WRITERS[fmt](tmp_path / f"p.{fmt}", rows)
    standard = write_jsonl(str(tmp_path / "p.jsonl"), [{"prompt": r["question"], "chosen": r["good"],
                                                        "rejected": r["bad"]} for r in rows])
    cfg = TrainConfig(prompt_column="question", chosen_column="good", rejected_column="bad")
    got, want = read_data(table, DataOptions.of(cfg)), read_data(standard)
    assert [r.kind for r in got.train] == [r.kind for r in want.train] == ["pref"] * 5
    assert [r.value for r in got.train] == [r.value for r in want.train]
    with pytest.raises(UserError, match=r"row 1: no column 'worse' \(named by --rejected-column"):
        read_data(table, DataOptions(columns=(("rejected", "worse"),)))


ERRORS = [
    ([{"prompt": "a", "completion": "b"}, {"prompt": "c", "completion": "d"}, {"prompt": "e", "completion": None}],
     "{where3}: field 'completion' must be a string"),
    ([{"foo": 1}], "{where1}: missing field: expected 'text', 'prompt'/'completion', 'messages' or 'chosen'/'rejected' (got foo)"),
    ([{"messages": [{"role": "user", "content": None}]}],
     "{where1}: message 0 needs 'role' and 'content' (or, from the assistant, 'tool_calls')"),
    ([{"messages": []}], "{where1}: 'messages' must be a non-empty list"),
    ([{"text": 5}], "{where1}: field 'text' must be a string"),
]


@pytest.mark.parametrize("rows,msg", ERRORS)
def test_table_errors_are_jsonl_errors_with_row_numbers(tmp_path, rows, msg):
    jsonl = write_jsonl(str(tmp_path / "bad.jsonl"), rows)
    table = write_parquet(tmp_path / "bad.parquet", rows)
    with pytest.raises(UserError) as ej:
        read_data(jsonl)
    with pytest.raises(UserError) as et:
        read_data(table)
    assert str(ej.value) == msg.format(where1=f"{jsonl}:1", where3=f"{jsonl}:3")
    assert str(et.value) == msg.format(where1=f"{table} row 1", where3=f"{table} row 3")


def test_bad_table_files(tmp_path):
    empty = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), empty)
    with pytest.raises(UserError, match=r"empty\.parquet: empty dataset"):
        read_data(str(empty))
    (tmp_path / "empty.csv").write_text("prompt,completion\n")
    with pytest.raises(UserError, match=r"empty\.csv: empty dataset"):
        read_data(str(tmp_path / "empty.csv"))
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"PAR1 not really")
    with pytest.raises(UserError, match=r"broken\.parquet: cannot read \(ArrowInvalid"):
        read_data(str(broken))
    dup = tmp_path / "dup.csv"
    dup.write_text("text,text\na,b\n")
    with pytest.raises(UserError, match=r"dup\.csv:1: the header needs distinct"):
        read_data(str(dup))
    with pytest.raises(UserError, match=r"nothere\.parquet: no such file or folder$"):
        read_data(str(tmp_path / "nothere.parquet"))
    (tmp_path / "nodata").mkdir()
    with pytest.raises(UserError, match=r"no train\.jsonl or train\.txt \(or parquet"):
        read_data(str(tmp_path / "nodata"))


def test_without_datasets_one_clear_error(tmp_path, monkeypatch):
    table = write_parquet(tmp_path / "d.parquet", text_rows())
    jsonl = write_jsonl(str(tmp_path / "d.jsonl"), text_rows())
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(UserError, match=r"needs the `datasets` package: pip install 'mlxtoy\[data\]'"):
        read_data(table)
    assert len(read_data(jsonl).train) == len(TRICKY)  # JSONL needs no `datasets`


def test_train_help_lists_the_data_options():
    r = run_cli("train", "--help")
    assert r.returncode == 0
    for flag in ("--data-split", "--data-subset", "--text-column", "--prompt-column", "--completion-column",
                 "--messages-column", "--chosen-column", "--rejected-column"):
        assert flag in r.stdout, flag
    with pytest.raises(UserError, match="data_split is empty"):
        TrainConfig(data="x.jsonl", out="r", data_split=" ").validate()


def test_cli_trains_on_csv(tmp_path):
    """End to end: a CSV file trains like its JSONL twin (same examples, same first loss)."""
    from helpers_train import write_tiny_model_folder

    model = write_tiny_model_folder(str(tmp_path / "m"))
    rows = completion_rows()
    jsonl = write_jsonl(str(tmp_path / "d.jsonl"), rows)
    table = write_csv(tmp_path / "d.csv", rows)
    losses = []
    for data, out in ((jsonl, "rj"), (table, "rc")):
        r = run_cli("train", "--model", model, "--data", data, "--out", str(tmp_path / out), "--steps", "2",
                    "--batch-size", "2", "--seq-len", "64", "--eval-every", "0", "--save-every", "0",
                    env={"HF_DATASETS_CACHE": str(tmp_path / "dc")})
        assert r.returncode == 0, r.stderr
        with open(tmp_path / out / "metrics.jsonl") as f:
            losses.append([e["loss"] for e in map(json.loads, f) if e["event"] == "step"])
    assert losses[0] == losses[1] and len(losses[0]) == 2
    assert os.path.exists(tmp_path / "dc")  # datasets' copies went where we said
