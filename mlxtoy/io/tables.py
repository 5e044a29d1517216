"""Tabular data and Hugging Face datasets, read with the `datasets` library, as rows of dicts.

`read_tables(SOURCE, split, subset) -> TableSplits` where SOURCE is a `.parquet`, `.csv` or
`.arrow` file, a folder of such files (split names from the file names, as `datasets` infers
them: train, validation / valid / dev, test) or one written by `Dataset.save_to_disk`, or a
Hugging Face dataset id (`org/name[@revision]`) fetched with `io.hub` into the standard cache
(offline with HF_HUB_OFFLINE=1). Only the subset's data files are fetched when the dataset's card
lists them. What the rows mean (text, prompt/completion, messages) is `train.data`'s business.

`datasets` is an optional dependency (`pip install 'mlxtoy[data]'`), imported only here.
"""

from __future__ import annotations

import csv
import glob
import os
from dataclasses import dataclass
from typing import Any

from mlxtoy.errors import UserError
from mlxtoy.io.hub import HubRef, fetch_dataset, fetch_dataset_card, parse_id

TABLE_BUILDERS = {".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}
# data files a dataset repo may hold (fetched when its card does not say which)
DATA_PATTERNS = ["*.parquet", "*.csv", "*.arrow", "*.jsonl", "*.json"]
VALID_SPLITS = ("validation", "valid", "val", "dev")
SAVED_MARKERS = ("dataset_dict.json", "state.json")  # Dataset(Dict).save_to_disk folders


@dataclass
class Table:
    label: str  # names the rows in errors: "<label> row N" (N from 1)
    rows: list[dict[str, Any]]


@dataclass
class TableSplits:
    train: Table
    valid: Table | None
    test: Table | None


def is_table_file(path: str) -> bool:
    return os.path.splitext(path)[1].lower() in TABLE_BUILDERS


def is_table_folder(path: str) -> bool:
    """A folder `datasets` can read: table files (at the top or one level down) or a saved dataset."""
    if any(os.path.exists(os.path.join(path, m)) for m in SAVED_MARKERS):
        return True
    return any(glob.glob(os.path.join(path, pat, "*" + ext))
               for ext in TABLE_BUILDERS for pat in ("", "*"))


def dataset_id(source: str) -> HubRef | None:
    """A Hugging Face dataset id (`org/name[@revision]`), or None for anything else."""
    ref = parse_id(source)
    return ref if ref is not None and ref.filename is None else None


def _datasets():
    try:
        import datasets
    except ImportError:
        raise UserError("reading parquet, csv, arrow or Hugging Face datasets needs the `datasets` "
                        "package: pip install 'mlxtoy[data]'") from None
    return datasets


def _read(label: str, call, *args, **kw):
    """One `datasets` call; its many failure types (missing files, a bad subset name, a corrupt
    parquet, a CSV parse error) become one UserError naming the source; its own error log
    lines (which repeat it) and its per-split progress bars (files already on disk: the
    download has huggingface_hub's own bars) are held back."""
    datasets = _datasets()
    level = datasets.logging.get_verbosity()
    bars = datasets.is_progress_bar_enabled()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    datasets.disable_progress_bars()
    try:
        return call(*args, **kw)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 (a third-party reader: any failure is the data's)
        while e.__cause__ is not None:  # "An error occurred while generating the dataset": why
            e = e.__cause__
        why = " ".join(str(e).split())
        raise UserError(f"{label}: cannot read ({type(e).__name__}: {why[:300]})") from None
    finally:
        datasets.logging.set_verbosity(level)
        if bars:
            datasets.enable_progress_bars()


def _card_files(ref: HubRef, subset: str | None) -> list[str] | None:
    """The data files the dataset card lists for `subset` (or its default subset); None when
    the card does not list any. A subset the card does not name is an error."""
    from huggingface_hub.repocard import metadata_load

    card = fetch_dataset_card(ref)
    try:
        configs = (metadata_load(card) or {}).get("configs") if card else None
    except Exception as e:  # noqa: BLE001 (the card's YAML header, whatever is wrong with it)
        raise UserError(f"{ref}: its dataset card (README.md) cannot be read ({type(e).__name__})") from None
    if not configs:
        return None
    names = [c.get("config_name", "default") for c in configs]
    if subset is not None and subset not in names:
        raise UserError(f"{ref}: no subset {subset!r} (subsets: {', '.join(names)})")
    if subset is None:
        default = [c for c in configs if c.get("default")] or \
            [c for c in configs if c.get("config_name", "default") == "default"] or configs[:1]
        chosen = default[0]
    else:
        chosen = configs[names.index(subset)]
    files = chosen.get("data_files")
    if files is None:
        return None
    out: list[str] = []
    for item in files if isinstance(files, list) else [files]:
        paths = item.get("path") if isinstance(item, dict) else item
        out.extend(paths if isinstance(paths, list) else [paths])
    return out


def _text_csv(source: str) -> dict[str, Any]:
    """CSV cells are text: every column (named by the first file's header) read as a string and
    empty cells as "" (pandas would make "43" an int and "NA" a missing value, where the JSONL
    equivalent is a string)."""
    files = [source] if os.path.isfile(source) else \
        sorted(glob.glob(os.path.join(source, "**", "*.csv"), recursive=True))
    if not files or not files[0].lower().endswith(".csv"):
        return {}
    datasets = _datasets()
    try:
        with open(files[0], newline="", encoding="utf-8") as f:
            header = next(csv.reader(f), [])
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise UserError(f"{files[0]}: cannot read ({type(e).__name__}: {e})") from None
    if len(set(header)) != len(header) or not all(header):
        raise UserError(f"{files[0]}:1: the header needs distinct, non-empty column names")
    return {"features": datasets.Features({c: datasets.Value("string") for c in header}),
            "na_filter": False}


def _no_rows(path: str, builder: str) -> bool:
    """Whether a table file holds a header / schema and no rows (False when it cannot tell:
    then datasets reads it and says what is wrong)."""
    import pyarrow as pa  # comes with datasets
    import pyarrow.parquet as pq

    try:
        if builder == "parquet":
            return pq.ParquetFile(path).metadata.num_rows == 0
        if builder == "csv":
            with open(path, newline="", encoding="utf-8") as f:
                rows = csv.reader(f)
                next(rows, None)
                return not any(any(cell.strip() for cell in row) for row in rows)
        with pa.OSFile(path, "rb") as f:
            return pa.ipc.open_stream(f).read_all().num_rows == 0
    except Exception:  # noqa: BLE001 (unreadable: datasets gives the reason)
        return False


def _pick(dd: Any, split: str, label: str) -> TableSplits:
    """train = `split`; valid = the first of validation/valid/val/dev; test = test."""
    datasets = _datasets()
    if isinstance(dd, datasets.Dataset):  # one saved split
        return TableSplits(Table(label, dd.to_list()), None, None)
    if split not in dd:
        raise UserError(f"{label}: no split {split!r} (splits: {', '.join(dd) or 'none'}); "
                        f"choose one with --data-split")
    valid = next((s for s in VALID_SPLITS if s in dd and s != split), None)
    test = "test" if "test" in dd and split != "test" else None

    def table(name: str) -> Table:
        return Table(f"{label} {name}" if len(dd) > 1 or name != "train" else label, dd[name].to_list())

    return TableSplits(table(split), table(valid) if valid else None, table(test) if test else None)


def read_tables(source: str, split: str = "train", subset: str | None = None) -> TableSplits:
    """Rows of a table file or folder, or of a Hugging Face dataset id (see the module doc)."""
    datasets = _datasets()
    if os.path.isfile(source):
        builder = TABLE_BUILDERS[os.path.splitext(source)[1].lower()]
        if _no_rows(source, builder):  # datasets fails on these ("corresponds to no data")
            return TableSplits(Table(source, []), None, None)
        ds = _read(source, datasets.load_dataset, builder, data_files=source, split="train",
                   **_text_csv(source))
        return TableSplits(Table(source, ds.to_list()), None, None)
    if os.path.isdir(source):
        if any(os.path.exists(os.path.join(source, m)) for m in SAVED_MARKERS):
            return _pick(_read(source, datasets.load_from_disk, source), split, source)
        return _pick(_read(source, datasets.load_dataset, source, name=subset, **_text_csv(source)),
                     split, source)
    ref = dataset_id(source)
    if ref is None:
        raise UserError(f"{source}: no such file or folder")
    files = _card_files(ref, subset)
    folder = fetch_dataset(ref, ["README.md", *(files or DATA_PATTERNS)])
    return _pick(_read(str(ref), datasets.load_dataset, folder, name=subset, **_text_csv(folder)),
                 split, str(ref))
