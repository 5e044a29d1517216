"""Exact-answer accuracy: greedy-answer each prompt and compare with the expected answer.

Used by `mlxtoy train --eval-accuracy` (before and after training, on the data's test split)
and by the demo test. An answer counts when it equals the expected one after trimming
whitespace at both ends (nothing else is forgiven: the demo's task has exact answers).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mlxtoy.errors import UserError
from mlxtoy.engine import BatchDecoder, Request
from mlxtoy.generate import StreamingDetokenizer, check_prompt
from mlxtoy.sampling import SamplingParams
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


EVAL_ROWS = 16  # answers decoded together (the batched decoder's rows)


def _answers(model, tokenizer, prompts: list[list[int]], expected: list[str], max_tokens: int,
             full: list[bool]) -> list[str]:
    """Greedy answers, decoded together (`mlxtoy.engine`: each row what it would be alone);
    unless `full[i]`, answer i stops as soon as it can no longer equal `expected[i]` (an
    exact-match score does not need the rest, and a wrong base model is slow to finish)."""
    engine = BatchDecoder(model)
    eos = frozenset(tokenizer.eos_ids)
    answers: list[str] = [""] * len(prompts)
    rows: dict[int, tuple[int, StreamingDetokenizer]] = {}
    todo = list(range(len(prompts)))
    while todo or engine.rows:
        joining = todo[:EVAL_ROWS - len(engine.rows)]
        todo = todo[len(joining):]
        added = engine.add_many([(Request(prompts[i], check_prompt(model, prompts[i], max_tokens), SamplingParams(),
                                          eos), 1) for i in joining])
        for i, (row,) in zip(joining, added):
            rows[id(row)] = (i, StreamingDetokenizer(tokenizer))
        for row, tok in engine.step():
            i, detok = rows[id(row)]
            if tok.finish == "stop":  # the end-of-sequence token is not part of the answer
                answers[i] += detok.finish()
                continue
            answers[i] += detok.add(tok.token)
            if tok.finish == "length":
                answers[i] += detok.finish()
            elif not full[i] and not _normalize(expected[i]).startswith(_normalize(answers[i])):
                answers[i] += "..."
                engine.cancel(row)
    return answers


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
    prompts, wants = [], []
    for rec in todo:
        ids, expected = rec.format.prompt(rec, r)
        if expected is None:
            raise UserError(f"{rec.where}: no expected answer (needs a completion or an assistant turn)")
        prompts.append(ids)
        wants.append(expected)
    answers = _answers(model, tokenizer, prompts, wants, max_tokens, [i < full_answers for i in range(len(todo))])
    for rec, expected, answer in zip(todo, wants, answers):
        ok = _normalize(answer) == _normalize(expected)
        correct += ok
        samples.append({"prompt": rec.format.prompt_text(rec), "expected": expected, "answer": answer, "ok": ok})
    if was_training:
        model.train()
    return AccuracyReport(correct, len(todo), samples)
