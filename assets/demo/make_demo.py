"""Generate the demo dataset: ISO dates -> "day Month year" (e.g. 2021-07-14 -> 14 July 2021).

A task with exact answers that the base SmolLM2-135M-Instruct gets wrong (it answers in other
formats, or with the wrong day or month) and that LoRA learns in a few minutes on a CPU: the
answer is a fixed rearrangement of the question (drop the day's leading zero, name the month,
keep the year). Deterministic: `python assets/demo/make_demo.py` rewrites the same files.

Splits: train.jsonl (600), valid.jsonl (60, validation loss during training) and test.jsonl
(100, held-out accuracy). No date appears in two splits.
"""

from __future__ import annotations

import datetime
import json
import os
import random

MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August",
          "September", "October", "November", "December"]
SIZES = {"train": 600, "valid": 60, "test": 100}
PROMPT = "Write the date {iso} as day, month name and year."


def answer(d: datetime.date) -> str:
    return f"{d.day} {MONTHS[d.month - 1]} {d.year}"


def example(d: datetime.date) -> dict:
    return {"messages": [{"role": "user", "content": PROMPT.format(iso=d.isoformat())},
                         {"role": "assistant", "content": answer(d)}]}


def main(out_dir: str = os.path.dirname(os.path.abspath(__file__)), seed: int = 1234) -> None:
    rng = random.Random(seed)
    start = datetime.date(1950, 1, 1).toordinal()
    end = datetime.date(2049, 12, 31).toordinal()
    days = rng.sample(range(start, end + 1), sum(SIZES.values()))
    i = 0
    for split, n in SIZES.items():
        write_split(out_dir, split, [example(datetime.date.fromordinal(o)) for o in days[i: i + n]])
        i += n


def write_split(out_dir: str, split: str, rows: list) -> None:
    """out_dir/<split>.jsonl, written to a temp name and renamed."""
    tmp = os.path.join(out_dir, f".{split}.jsonl.tmp")
    with open(tmp, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    os.replace(tmp, os.path.join(out_dir, f"{split}.jsonl"))


if __name__ == "__main__":
    main()
