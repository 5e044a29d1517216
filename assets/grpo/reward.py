"""The GRPO example's reward: a third of a point for each part of the date the completion
names (the day as a number, the month by name, the year), as whole words. mlxtoy calls it
with the completion and the row's `day`, `month` and `year` columns (its signature names them).

    mlxtoy train --config assets/grpo/grpo.yaml --out runs/grpo
"""

import re


def date_parts(completion: str, day: int, month: str, year: int) -> float:
    words = re.findall(r"[A-Za-z]+|\d+", completion)
    return (str(day) in words) / 3 + (month in words) / 3 + (str(year) in words) / 3
