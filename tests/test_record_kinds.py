"""Every record kind through its one home (mlxtoy.train.formats): the TUI's data preview and the
trainer's batches agree, with SmolLM2's real tokenizer and chat template.

For each kind a small file is read twice: by the Setup screen's `data_preview` (what the TUI
shows: the first record rendered, trained text marked) and by the objective that trains on it
(tokenize, then the first batch of its stream, as the loop gets it). The text of the batch's
tokens, split where its loss mask changes, must equal the preview's, and the mask must cover
exactly the completions (and each turn's end-of-turn tokens), never a prompt.
"""

from __future__ import annotations

import json

import pytest

from mlxtoy.config import TrainConfig
from mlxtoy.errors import UserError
from mlxtoy.loading import load_tokenizer
from mlxtoy.train.formats import FORMATS, Renderer, parse_object
from mlxtoy.train.objectives import make_objective
from mlxtoy.train.records import read_data
from tui.setup import data_preview

SEQ_LEN = 96
SYSTEM = "You answer in one word."

ROWS = {
    "text": [{"text": "The cat sat on the mat."}, {"text": "A dog ran in the park."}],
    "completion": [{"prompt": "What is 2+2?", "completion": " 4"}, {"prompt": "Say hi", "completion": " hi"}],
    "chat": [{"messages": [{"role": "system", "content": SYSTEM},
                           {"role": "user", "content": "Colour of the sky?"},
                           {"role": "assistant", "content": "Blue."},
                           {"role": "user", "content": "And grass?"},
                           {"role": "assistant", "content": "Green."}]}],
    "pref": [{"system": SYSTEM, "prompt": "Best pet?", "chosen": "Cats.", "rejected": "Rocks, honestly."}],
    "pref-trl": [{"chosen": [{"role": "user", "content": "Capital of France?"},
                             {"role": "assistant", "content": "Paris."}],
                  "rejected": [{"role": "user", "content": "Capital of France?"},
                               {"role": "assistant", "content": "Lyon, I think."}]}],
    "prompt": [{"prompt": "What is 6*7?", "answer": "42", "difficulty": "easy"}],
    "prompt-messages": [{"messages": [{"role": "system", "content": SYSTEM},
                                      {"role": "user", "content": "What is 3+4?"}], "answer": 7}],
}
STREAM = "Once upon a time there was a small model that read one long text. " * 12
KIND = {"text": "text", "completion": "completion", "chat": "chat", "pref": "pref", "pref-trl": "pref",
        "prompt": "prompt", "prompt-messages": "prompt", "stream": "stream"}
OBJECTIVE = {"pref": "dpo", "prompt": "grpo"}


@pytest.fixture(scope="module")
def tok(smollm2_path):
    return load_tokenizer(smollm2_path)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("kinds")
    out = {}
    for name, rows in ROWS.items():
        path = root / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        out[name] = str(path)
    (root / "stream.txt").write_text(STREAM)
    out["stream"] = str(root / "stream.txt")
    return out


def trainer_sequences(path: str, tok) -> tuple[str, list[tuple[list[int], list[bool]]]]:
    """(kind, the first example's sequences as the trainer's first batch holds them: token ids
    and which are trained), through the objective that trains on the kind."""
    raw = read_data(path)
    kind = raw.train[0].kind
    cfg = TrainConfig(objective=OBJECTIVE.get(kind, "sft"), batch_size=1, seq_len=SEQ_LEN, pack=False,
                      reward="exact" if kind == "prompt" else "")
    objective = make_objective(cfg.validate())
    objective.check_records(raw)
    examples, _ = objective.tokenize(raw.train, tok, SEQ_LEN, True, name=path)
    stream = objective.stream(examples, shuffle=False, pad_id=0)
    if kind == "prompt":  # GRPO: prompts to sample from, nothing of them trained
        ids = stream.prompts(0)[0].tokens.tolist()
        return kind, [(ids, [False] * len(ids))]
    batch = stream.batch(0)
    out = []
    for row in range(batch.inputs.shape[0]):  # a pair (--no-pack): chosen, then rejected
        n = int((batch.segments[row] >= 0).sum())
        ids = batch.inputs[row, :n].tolist() + [int(batch.targets[row, n - 1])]
        out.append((ids, [False] + [bool(w) for w in batch.weights[row, :n]]))
    return kind, out


def end_of_turn(tok) -> str:
    """What the chat template writes after an assistant turn's text."""
    text = tok.apply_chat_template([{"role": "user", "content": "q"}, {"role": "assistant", "content": "MARK"}],
                                   add_generation_prompt=False)
    return text.split("MARK", 1)[1]


def generation_prompt(tok) -> str:
    with_prompt = tok.apply_chat_template([{"role": "user", "content": "q"}], add_generation_prompt=True)
    return with_prompt[len(tok.apply_chat_template([{"role": "user", "content": "q"}],
                                                   add_generation_prompt=False)):]


def mask_problems(pieces: list[tuple[str, bool]], name: str, record, tok) -> list[str]:
    """What is wrong with a rendered, masked sequence of `record` (a Record of `name`'s kind):
    [] when the trained pieces are exactly the completions with their end-of-turn tokens."""
    trained = [t for t, on in pieces if on]
    untrained = "".join(t for t, on in pieces if not on)
    whole = "".join(t for t, _ in pieces)
    eot, gen = end_of_turn(tok), generation_prompt(tok)
    if record.kind in ("text", "stream"):
        first = tok.decode(tok.encode(record.value)[:1])
        want = record.value + tok.decode([tok.eos_id]) if record.kind == "text" else None
        problems = [] if untrained == first and (want is None or whole == want) else [
            f"{name}: all but the first token should be trained: untrained {untrained!r}"]
        if record.kind == "stream" and not record.value.startswith(whole):
            problems.append(f"{name}: the window is not the start of the stream")
        return problems
    if record.kind == "completion":
        answers, prompts = [record.value[1]], [record.value[0]]
    elif record.kind == "chat":
        answers = [m["content"] for m in record.value if m["role"] == "assistant"]
        prompts = [m["content"] for m in record.value if m["role"] != "assistant"]
    elif record.kind == "pref":
        answers = None  # checked by the caller, per side
        prompts = [m["content"] for m in record.value[0]]
    else:  # prompt: nothing trained
        answers, prompts = [], [m["content"] for m in record.value[0]]
    problems = []
    if answers is not None and not completions_only(pieces, answers, eot, gen):
        problems.append(f"{name}: trained {trained!r}, want {[a + eot for a in answers]!r}")
    for p in prompts:
        if p not in untrained:
            problems.append(f"{name}: prompt text {p!r} is not in the untrained part")
    return problems


def completions_only(pieces: list[tuple[str, bool]], answers: list[str], eot: str, gen: str) -> bool:
    """The trained pieces are the answers, each with its end-of-turn text, and each follows
    the generation prompt. A trained piece may start with whitespace that ends the generation
    prompt: where a token spans the boundary (SmolLM2 merges the prompt's "\n" with a completion's
    leading space), the renderer trains that token, as it must to train the completion."""
    trained = [(i, t) for i, (t, on) in enumerate(pieces) if on]
    if len(trained) != len(answers):
        return False
    for (i, t), a in zip(trained, answers):
        if not t.endswith(a + eot):
            return False
        overlap = t[: len(t) - len(a + eot)]
        before = "".join(text for text, _ in pieces[:i]) + overlap
        if overlap.strip() or not gen.endswith(overlap) or not before.endswith(gen):
            return False
    return True


def pieces_of(tok, ids: list[int], mask: list[bool]) -> list[tuple[str, bool]]:
    return Renderer(tok).pieces(ids, mask)


@pytest.mark.parametrize("name", list(KIND))
def test_preview_and_batches_agree(name, files, tok):
    preview = data_preview(files[name], "smollm2", SEQ_LEN, {"smollm2": tok})
    kind, sequences = trainer_sequences(files[name], tok)
    record = read_data(files[name]).train[0]
    assert kind == preview["kind"] == KIND[name] == record.kind
    assert preview["tokenizer_error"] is None
    assert len(preview["rendered"]) == len(sequences) == (2 if kind == "pref" else 1)

    for shown, (ids, mask) in zip(preview["rendered"], sequences):
        # the preview's text, trained parts marked, is the text of the batch's tokens
        assert shown == pieces_of(tok, ids, mask), name
        assert "".join(t for t, _ in shown) == tok.decode(ids)
    # the lengths the preview reports are the trainer's (before any cut at seq_len)
    if kind != "stream":
        assert preview["lengths"]["max"] == max(len(ids) for ids, _ in sequences)

    if kind == "pref":
        prompt, chosen, rejected = record.value
        eot = end_of_turn(tok)
        (ids_c, mask_c), (ids_r, mask_r) = sequences
        gen = generation_prompt(tok)
        assert completions_only(preview["rendered"][0], [chosen], eot, gen)
        assert completions_only(preview["rendered"][1], [rejected], eot, gen)
        # both sides share the prompt tokens exactly, untrained
        n = mask_c.index(True)
        assert ids_c[:n] == ids_r[:n] and mask_r.index(True) == n
    for shown in preview["rendered"]:
        assert mask_problems(shown, name, record, tok) == []

    # the TUI's one-line preview of the record names its fields
    first = preview["examples"][0]
    for label, text in record.format.preview(record):
        assert text.split()[0] in first and (not label or label in first)


def test_a_wrong_mask_is_caught(files, tok):
    """Positive control: the checks above fail on a mask that trains one prompt token, or that
    leaves the completion's last token out, and on tokens that are not the preview's."""
    _, [(ids, mask)] = trainer_sequences(files["completion"], tok)
    record = read_data(files["completion"]).train[0]
    assert mask_problems(pieces_of(tok, ids, mask), "completion", record, tok) == []
    start = mask.index(True)
    leaks = list(mask)
    leaks[start - 1] = True  # the generation prompt's last token trained
    assert mask_problems(pieces_of(tok, ids, leaks), "completion", record, tok)
    short = list(mask)
    short[len(short) - 1] = False
    assert mask_problems(pieces_of(tok, ids, short), "completion", record, tok)
    preview = data_preview(files["completion"], "smollm2", SEQ_LEN, {"smollm2": tok})
    assert preview["rendered"][0] != pieces_of(tok, ids, leaks)
    assert preview["rendered"][0] != pieces_of(tok, ids[:-1] + [ids[-2]], mask)


def test_every_kind_has_one_class():
    """The kinds the files hold are exactly the format classes; each JSON shape goes to its own."""
    assert sorted(FORMATS) == ["chat", "completion", "pref", "prompt", "stream", "text"]
    for name, rows in ROWS.items():
        assert parse_object(rows[0], "x:1").kind == KIND[name]
    with pytest.raises(UserError, match=r"^x:1: missing field: expected 'text'"):
        parse_object({"foo": 1}, "x:1")
