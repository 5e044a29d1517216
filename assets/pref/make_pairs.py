"""Generate the preference demo: the date task of assets/demo as (chosen, rejected) pairs.

Prompt: "Write the date 2021-07-14 as day, month name and year." Chosen: the right answer
("14 July 2021", assets/demo's `answer`). Rejected: one plausible wrong answer, drawn per row
from the mistakes a small model makes with this format: the ISO date echoed, "July 14, 2021",
"14/07/2021", the day's leading zero kept, the month abbreviated, the year left out, or a
sentence instead of the date only.
A short system message keeps the rendered pair short (the template's default one is long).

Deterministic: `python assets/pref/make_pairs.py` rewrites the same files. Splits: train.jsonl
(400, {"prompt", "chosen", "rejected", "system"}), valid.jsonl (40, TRL's conversational
{"chosen": [messages], "rejected": [messages]}) and test.jsonl (100, as train). No date is in
two splits, and none is in assets/demo's splits' (a different seed draws from other years).
"""

from __future__ import annotations

import datetime
import os
import random
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "demo"))
from make_demo import MONTHS, PROMPT, answer, write_split  # noqa: E402  (the one definition of the task)

SIZES = {"train": 400, "valid": 40, "test": 100}
SYSTEM = "Answer with the date only."
YEARS = (2050, 2099)  # assets/demo draws from 1950-2049: no date in common


def wrong(d: datetime.date, rng: random.Random) -> str:
    month = MONTHS[d.month - 1]
    return rng.choice([
        d.isoformat(),  # the question echoed
        f"{month} {d.day}, {d.year}",  # US order
        f"{d.day:02d}/{d.month:02d}/{d.year}",  # numeric
        f"{d.day:02d} {month} {d.year}",  # the leading zero kept
        f"{d.day} {month[:3]} {d.year}",  # the month abbreviated
        f"{d.day} {month}",  # the year left out
        f"The date is {d.day} {month} {d.year}.",  # not the date only
        f"{d.day} {month} {d.year} is a {d.strftime('%A')}.",
    ])


def row(d: datetime.date, rng: random.Random, conversational: bool) -> dict:
    prompt = PROMPT.format(iso=d.isoformat())
    chosen, rejected = answer(d), wrong(d, rng)
    while rejected == chosen:  # e.g. "the leading zero kept" of a day >= 10
        rejected = wrong(d, rng)
    if not conversational:
        return {"system": SYSTEM, "prompt": prompt, "chosen": chosen, "rejected": rejected}
    head = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}]
    return {"chosen": head + [{"role": "assistant", "content": chosen}],
            "rejected": head + [{"role": "assistant", "content": rejected}]}


def main(out_dir: str = HERE, seed: int = 4321) -> None:
    rng = random.Random(seed)
    start = datetime.date(YEARS[0], 1, 1).toordinal()
    end = datetime.date(YEARS[1], 12, 31).toordinal()
    days = rng.sample(range(start, end + 1), sum(SIZES.values()))
    i = 0
    for split, n in SIZES.items():
        write_split(out_dir, split, [row(datetime.date.fromordinal(o), rng, split == "valid")
                                     for o in days[i: i + n]])
        i += n


if __name__ == "__main__":
    main()
