"""Exact-answer accuracy: greedy-answer each prompt and compare with the expected answer.

Used by `mlxtoy train --eval-accuracy` (before and after training, on the data's test split)
and by the demo test. An answer counts when it equals the expected one after trimming
whitespace at both ends (nothing else is forgiven: the demo's task has exact answers).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mlxtoy.errors import UserError
from mlxtoy.generate import stream_generate
from mlxtoy.train.formats import Record, Renderer


@dataclass
class AccuracyReport:
    correct: int
    total: int
    samples: list[dict] = field(default_factory=list)  # {"prompt", "expected", "answer", "ok"}

    @property
    def accuracy(self) -> float:
        return self.correct / self.total if self.total else 0.0

    def to_dict(self) -> dict:
        return {"accuracy": self.accuracy, "correct": self.correct, "total": self.total,
                "samples": self.samples}


def _normalize(s: str) -> str:
    return " ".join(s.split())


def _answer(model, tokenizer, ids: list[int], expected: str, max_tokens: int, full: bool) -> str:
    """Greedy answer; unless `full`, stop as soon as it can no longer equal `expected` (an
    exact-match score does not need the rest, and a wrong base model is slow to finish)."""
    want = _normalize(expected)
    text = ""
    for chunk in stream_generate(model, tokenizer, ids, max_tokens=max_tokens, temp=0.0):
        text += chunk.text
        if not full and not want.startswith(_normalize(text)):
            return text + "..."
    return text


def accuracy(model, tokenizer, examples: list[Record], max_tokens: int = 32,
             limit: int = 0, full_answers: int = 5) -> AccuracyReport:
    """Greedy answers vs the exact expected answers of chat / prompt-completion records.

    The first `full_answers` answers are generated in full (to show them); the others stop at
    the first token that rules the exact match out (marked with a trailing "...").
    """

    r = Renderer(tokenizer)
    was_training = getattr(model, "training", False)
    model.eval()
    correct, samples = 0, []
    todo = examples[:limit] if limit else examples
    if not todo:
        raise UserError("no test examples to measure accuracy on (add test.jsonl to the data folder)")
    for rec in todo:
        ids, expected = rec.format.prompt(rec, r)
        if expected is None:
            raise UserError(f"{rec.where}: no expected answer (needs a completion or an assistant turn)")
        answer = _answer(model, tokenizer, ids, expected, max_tokens, len(samples) < full_answers)
        ok = _normalize(answer) == _normalize(expected)
        correct += ok
        samples.append({"prompt": rec.format.prompt_text(rec), "expected": expected, "answer": answer, "ok": ok})
    if was_training:
        model.train()
    return AccuracyReport(correct, len(todo), samples)
