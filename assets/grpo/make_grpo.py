"""Generate the GRPO example: ISO dates -> "day Month year", learnt from a reward alone.

The same task as assets/demo (e.g. 2021-07-14 -> 14 July 2021), but no completion is given:
each row has the prompt, the answer and its parts (`day`, `month`, `year`: columns that the
reward function in reward.py names, so mlxtoy hands them to it). The base SmolLM2-135M-Instruct
mostly echoes the ISO date; some of its samples name the month, and GRPO pulls the policy
toward those. Deterministic: `python assets/grpo/make_grpo.py` rewrites the same files.

Splits: train.jsonl (200 prompts), valid.jsonl (16: the mean greedy reward at each evaluation)
and test.jsonl (40, held out: tests/test_grpo.py scores them before and after training).
"""

from __future__ import annotations

import datetime
import json
import os
import random

MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August",
          "September", "October", "November", "December"]
SIZES = {"train": 200, "valid": 16, "test": 40}
PROMPT = "Write the date {iso} as day, month name and year."


def row(d: datetime.date) -> dict:
    month = MONTHS[d.month - 1]
    return {"prompt": PROMPT.format(iso=d.isoformat()), "answer": f"{d.day} {month} {d.year}",
            "day": d.day, "month": month, "year": d.year}


def main(out_dir: str = os.path.dirname(os.path.abspath(__file__)), seed: int = 4321) -> None:
    rng = random.Random(seed)
    start = datetime.date(1950, 1, 1).toordinal()
    end = datetime.date(2049, 12, 31).toordinal()
    days = rng.sample(range(start, end + 1), sum(SIZES.values()))
    i = 0
    for split, n in SIZES.items():
        tmp = os.path.join(out_dir, f".{split}.jsonl.tmp")
        with open(tmp, "w") as f:
            for o in days[i: i + n]:
                f.write(json.dumps(row(datetime.date.fromordinal(o))) + "\n")
        os.replace(tmp, os.path.join(out_dir, f"{split}.jsonl"))
        i += n


if __name__ == "__main__":
    main()
