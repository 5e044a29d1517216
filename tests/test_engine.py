"""The batched decoder (mlxtoy.engine): every row samples what one-at-a-time decoding
(`generate_tokens`) samples, on every architecture, with rows joining and leaving between
steps, prompts shared by a group, several adapters of one base in one batch and the prompt
cache."""

from __future__ import annotations

import io
from dataclasses import replace

import numpy as np
import pytest

import mlxtoy  # noqa: F401  (fast BLAS before mlx.core)
import mlx.core as mx
from mlx.utils import tree_flatten

from helpers_export import randomize
from helpers_train import byte_tokenizer, tiny_model
from mlxtoy import engine as engine_module
from mlxtoy.engine import BatchDecoder, Request, generate_batch, padded_causal_mask
from mlxtoy.generate import generate, generate_tokens
from mlxtoy.loading import build_model
from mlxtoy.model_config import ModelConfig
from mlxtoy.models import fastmath
from mlxtoy.models import prefill as prefill_module
from mlxtoy.models.adapters import adapter_rows_set, attach_adapters
from mlxtoy.models.cache import KVCache, SlotCache, make_cache
from mlxtoy.models.lora import apply_lora, lora_parameters, merge_lora
from mlxtoy.prompt_cache import PromptCache
from mlxtoy.sampling import SamplingParams
from mlxtoy.train.evaluate import accuracy
from mlxtoy.train.formats import Renderer, parse_object

VOCAB = 300
COMMON = dict(vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_head=16, d_ff=128,
              context_length=96)
# one tiny random model per architecture (the options each spec sets)
ARCHS = {
    "llama": dict(arch="llama"),
    "qwen2": dict(arch="qwen2", qkv_bias=True, rope_traditional=False, tie_embeddings=False),
    "qwen3": dict(arch="qwen3", qk_norm=True, rope_traditional=False),
    "mistral": dict(arch="mistral", sliding_window=8),
    "phi3": dict(arch="phi3", rope_dims=8, rope_traditional=False),
    "gemma3": dict(arch="gemma3", qk_norm=True, sliding_window=8, rope_local_base=10000.0,
                   layer_types=["sliding_attention", "full_attention"], attn_scale=0.25),
    "gpt2": dict(arch="gpt2", n_kv_heads=4, rope_dims=0),
    "tiny": dict(arch="tiny", n_kv_heads=4, rope_dims=0),
}


def arch_model(name: str, seed: int = 0):
    """`randomize`d, with the embeddings scaled down so the next token is not almost surely
    the last one again (a tied table's self-similarity): sampling then has choices to make."""
    model = randomize(build_model(ModelConfig(**{**COMMON, **ARCHS[name]})), seed)
    model.tok_embeddings.weight = model.tok_embeddings.weight * 0.25
    if "output" in model:
        model.output.weight = model.output.weight * 0.25
    mx.eval(model.parameters())
    return model


def prompts(lengths=(5, 23, 11), seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, n).tolist() for n in lengths]


def alone(model, prompt, sampling: SamplingParams, n: int) -> list[int]:
    return [t for t, _ in generate_tokens(model, prompt, sampling=sampling, max_tokens=n)]


def agree(model, prompt, got: list[int], want: list[int], tol: float = 1e-3) -> bool:
    """got == want, or greedy runs that part where the two tokens tie: their logits after the
    common prefix, computed one at a time, within `tol` (a batch's products round differently
    from one row's; a near-tie may then go either way)."""
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            logits = model(mx.array([list(prompt) + want[:i]]))[0, -1]
            return abs((logits[g] - logits[w]).item()) < tol
    return len(got) == len(want)


SAMPLINGS = {"greedy": SamplingParams(temp=0.0),
             "sampled": SamplingParams(temp=1.0, top_p=0.95, repetition_penalty=1.3, repetition_window=8)}


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("how", list(SAMPLINGS))
def test_batched_rows_sample_what_one_at_a_time_samples(arch, how):
    """Prompts of different lengths in one batch (two rows of each: GRPO's group) give each
    row the tokens `generate_tokens` gives that prompt with that row's seed."""
    model = arch_model(arch)
    sp = SAMPLINGS[how]
    ps = prompts()
    got = generate_batch(model, ps, repeats=2, sampling=sp, max_tokens=20, seed=3)
    for r, out in enumerate(got):
        want = alone(model, ps[r // 2], SamplingParams(**{**vars(sp), "seed": 3 * 2**20 + r}), 20)
        assert (out == want) if how == "sampled" else agree(model, ps[r // 2], out, want), (arch, r)
    if how == "sampled":  # the two rows of a prompt draw differently
        assert any(got[2 * i] != got[2 * i + 1] for i in range(len(ps)))


def test_learned_positions_need_each_rows_own_positions(monkeypatch):
    """Control for the test above: with one position for the whole batch (the left-padded
    columns, as batched sampling had it), a learned-position model's rows no longer sample
    what they sample alone."""
    sp = SAMPLINGS["sampled"]
    ps = prompts()
    want = [alone(arch_model("gpt2"), p, SamplingParams(**{**vars(sp), "seed": 2**20 + i}), 20)
            for i, p in enumerate(ps)]
    assert generate_batch(arch_model("gpt2"), ps, sampling=sp, max_tokens=20, seed=1) == want
    monkeypatch.setattr(KVCache, "positions", property(lambda self: self.offset))
    monkeypatch.setattr(SlotCache, "positions", property(lambda self: self.offset))
    got = generate_batch(arch_model("gpt2"), ps, sampling=sp, max_tokens=20, seed=1)
    assert got[1] == want[1]  # the longest prompt has no padding: its columns are its positions
    assert got[0] != want[0] and got[2] != want[2]


def test_rows_join_and_leave_between_steps(monkeypatch):
    """Each row gets its tokens alone while others join, end and go away. The cache's buffers
    are a whole number of steps long (16 positions here, so rows cross several boundaries)
    after every join and compaction, whatever the prompts' lengths: batches of one size then
    share the compiled decode's shapes."""
    monkeypatch.setattr(KVCache, "step", 16)
    model = arch_model("gpt2")
    ps = prompts((7, 30, 4, 12), seed=1)
    want = [alone(model, p, SamplingParams(), n) for p, n in zip(ps, (15, 6, 12, 9))]
    engine = BatchDecoder(model)
    out: dict[int, list[int]] = {}
    rows = {}
    rows[0] = engine.add(Request(ps[0], 15))[0]
    schedule = {3: 1, 5: 2, 8: 3}  # after that many steps, request i joins
    cancelled = None
    steps = 0
    capacities = set()
    while engine.rows:
        if steps in schedule:
            i = schedule[steps]
            rows[i] = engine.add(Request(ps[i], (15, 6, 12, 9)[i]))[0]
        for row, tok in engine.step():
            out.setdefault(id(row), []).append(tok.token)
        if engine.rows:
            capacities.add(engine.cache[0].capacity)
        steps += 1
        if steps == 10:  # a client goes away mid-stream: its row leaves the batch
            cancelled = rows[2]
            engine.cancel(cancelled)
    for i, row in rows.items():
        got = out[id(row)]
        if row is cancelled:
            assert got == want[i][:len(got)] and len(got) < len(want[i])
        else:
            assert got == want[i], i
    assert engine.cache[0].keys is None  # every row gone: the cache is empty
    assert len(capacities) > 1 and all(c % 16 == 0 for c in capacities), capacities


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_rows_that_end_stay_in_the_cache_until_it_is_compacted(arch):
    """A row that ends leaves the batch, but its cache row stays (reading token 0) until rows
    that left are an eighth of the cache or new rows join: the other rows' tokens must not
    change, whichever rows the cache holds."""
    model = arch_model(arch)
    ps = prompts((5, 9, 3, 14, 7, 11, 4, 8), seed=2)
    budgets = (4, 20, 6, 20, 8, 20, 20, 10)
    sp = SamplingParams(temp=1.0, top_p=0.9, seed=5)
    want = [alone(model, p, replace(sp, seed=5 + i), n) for i, (p, n) in enumerate(zip(ps, budgets))]
    engine = BatchDecoder(model)
    rows = [engine.add(Request(p, n, replace(sp, seed=5 + i)))[0] for i, (p, n) in enumerate(zip(ps, budgets))]
    out: dict[int, list[int]] = {}
    widths = []
    while engine.rows:
        for row, tok in engine.step():
            out.setdefault(id(row), []).append(tok.token)
        widths.append((len(engine.rows), engine.cache_width()))
    for i, row in enumerate(rows):
        assert out[id(row)] == want[i], i
    assert (7, 8) in widths  # positive control: an ended row kept its cache row
    assert (6, 6) in widths and (5, 5) in widths  # then a quarter of them gone: compacted
    assert engine.cache[0].keys is None


def test_a_cancelled_row_frees_its_cache_row():
    model = arch_model("llama")
    engine = BatchDecoder(model)
    a = engine.add(Request(prompts()[0], 50))[0]
    engine.add(Request(prompts()[1], 50))
    engine.step()
    assert engine.cache[0].keys.shape[0] == 2
    engine.cancel(a)
    engine.step()
    assert len(engine.rows) == 1 and engine.cache[0].keys.shape[0] == 1
    assert int(engine.cache[0].starts[0]) == 0  # the other row's padding went with it


def test_a_group_prefills_its_prompt_once():
    model = arch_model("llama")
    engine = BatchDecoder(model)
    engine.add(Request(prompts()[1], 4, SamplingParams(temp=1.0, seed=0)), copies=8)
    assert engine.prompt_tokens == len(prompts()[1]) and len(engine.rows) == 8


def _padded_columns(lengths: list[int], step: int) -> int:
    """Columns that greedy groups of at most `step` padded tokens take, the prompts in this order."""
    total, group = 0, []
    for n in lengths:
        if group and (len(group) + 1) * max(group + [n]) > step:
            total += len(group) * max(group)
            group = []
        group.append(n)
    return total + len(group) * max(group)


def test_prompts_prefilled_together_are_grouped_by_length():
    """Prompts of mixed lengths arriving together are grouped shortest first, so a group pads to
    a like length: fewer padded columns than in arrival order (computed here), and each row gets
    what it gets alone."""
    model = arch_model("llama")
    lengths = [40, 3, 38, 2, 41, 4, 39, 5]
    ps = prompts(lengths, seed=4)
    engine = BatchDecoder(model, prefill_step=90)
    rows = engine.add_many([(Request(p, 6, SamplingParams(temp=0.0)), 1) for p in ps])
    assert engine.prompt_tokens == sum(lengths)
    assert engine.padded_tokens == _padded_columns(sorted(lengths), 90) == 180
    assert _padded_columns(lengths, 90) == 316  # arrival order (the control): 1.8x as many
    out = {id(r[0]): [] for r in rows}
    while engine.rows:
        for row, tok in engine.step():
            out[id(row)].append(tok.token)
    for p, r in zip(ps, rows):
        assert agree(model, p, out[id(r[0])], alone(model, p, SamplingParams(temp=0.0), 6))


def _adapter(model, seed: int, targets=("q", "v", "down"), rank=4, per_head_q=False, dora=False):
    """A trained-looking adapter for `model`'s shape: (weights, layout) as loading.adapter_weights gives."""
    mx.random.seed(seed)
    m = build_model(model.config)
    apply_lora(m, targets, rank, 2.0 * rank, per_head_q=per_head_q, dora=dora)
    rng = np.random.default_rng(seed)
    weights = {k: mx.array(rng.standard_normal(v.shape).astype(np.float32) * 0.3 + (1.0 if k.endswith("magnitude") else 0.0))
               for k, v in lora_parameters(m).items()}
    return weights, {"scale": 2.0, "method": "dora" if dora else "lora"}


def _merged(model, weights, targets=("q", "v", "down"), rank=4, per_head_q=False, dora=False):
    m = build_model(model.config, dict(tree_flatten(model.parameters())))
    apply_lora(m, targets, rank, 2.0 * rank, per_head_q=per_head_q, dora=dora)
    m.load_weights(list(weights.items()), strict=False)
    return merge_lora(m)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_adapters_of_one_base_share_a_batch(arch):
    """Rows for the base and for three adapters (ranks 4 and 8, a per-head q, a DoRA) in one
    batch: each row samples what the merged model of its adapter samples alone."""
    base = arch_model(arch)
    specs = [dict(rank=4), dict(rank=8, per_head_q=True), dict(rank=4, dora=True)]
    adapters = [_adapter(base, 10 + i, **s) for i, s in enumerate(specs)]
    merged = [base] + [_merged(base, w, **s) for (w, _), s in zip(adapters, specs)]
    served = build_model(base.config, dict(tree_flatten(base.parameters())))
    attach_adapters(served, [(f"a{i}", w, layout) for i, (w, layout) in enumerate(adapters)])
    ps = prompts((6, 13, 9, 17), seed=2)
    engine = BatchDecoder(served)
    order = []
    for slot in (2, 0, 3, 1, 1, 3, 0, 2):  # two rows of each, interleaved
        p = ps[slot]
        order.append((slot, p, engine.add(Request(p, 12, adapter=slot))[0]))
    out: dict[int, list[int]] = {}
    while engine.rows:
        for row, tok in engine.step():
            out.setdefault(id(row), []).append(tok.token)
    wants = {}
    for slot, p, row in order:
        want = wants.setdefault(slot, alone(merged[slot], p, SamplingParams(), 12))
        assert out[id(row)] == want, slot
    # control: the adapters change what is sampled (else the check above says nothing)
    assert len({tuple(alone(m, ps[0], SamplingParams(), 12)) for m in merged}) == 4


@pytest.mark.parametrize("targets", [("q", "v"), ("q", "k", "v", "o", "gate", "up", "down")])
def test_lora_banks_decode_through_the_fused_block(targets, monkeypatch):
    """A served base with adapters on q and v, or on all seven matrices (LoRA of ranks 4 and 8,
    one per-head q, and a DoRA): the banks' per-row updates (and DoRA's rescales) are added
    inside the fused block, so rows of every adapter decode fused, and each row still gets what
    the merged model of its adapter gets alone. Positive controls: the blocks' prefill graph is
    the fused kernel's where the kernels run, and the adapters change what is decoded."""
    base = arch_model("llama")
    specs = [dict(rank=4), dict(rank=8, per_head_q=True), dict(rank=4, dora=True)]
    adapters = [_adapter(base, 20 + i, targets, **s) for i, s in enumerate(specs)]
    merged = [base] + [_merged(base, w, targets, **s) for (w, _), s in zip(adapters, specs)]
    served = build_model(base.config, dict(tree_flatten(base.parameters())))
    attach_adapters(served, [(f"a{i}", w, layout) for i, (w, layout) in enumerate(adapters)])
    assert all(layer.fused_modules() is not None for layer in served.layers)
    ps = prompts((6, 13, 9, 11), seed=3)
    engine = BatchDecoder(served)
    order = [(slot, ps[slot], engine.add(Request(ps[slot], 10, adapter=slot))[0]) for slot in (1, 0, 3, 2, 2, 3, 1)]
    out: dict[int, list[int]] = {}
    while engine.rows:
        for row, tok in engine.step():
            out.setdefault(id(row), []).append(tok.token)
    for slot, p, row in order:
        assert agree(merged[slot], p, out[id(row)], alone(merged[slot], p, SamplingParams(), 10)), slot
    assert len({tuple(tuple(alone(m, p, SamplingParams(), 10)) for p in ps) for m in merged}) == 4
    # the fused block runs for the adapter rows: the prefill of a row of adapter 2 (the fused
    # call taken unmeasured; which is faster is test_routes's)
    monkeypatch.setattr(prefill_module, "PREFILL_UNMEASURED_ROWS", prefill_module.PREFILL_FUSED_ROWS)
    cache = make_cache(served)
    with fastmath.inference(), adapter_rows_set(served, mx.array([2], dtype=mx.int32)):
        h = served.hidden(mx.array([ps[2]]), "causal", cache)
    graph = io.StringIO()
    mx.export_to_dot(graph, h)
    fused = fastmath.kernels_on() and fastmath.FUSED_DECODE  # (the MLX-only path has no fused block)
    assert graph.getvalue().count("MlxtoyDecodeBlock") == (len(served.layers) if fused else 0)


def test_the_prompt_cache_serves_a_shared_prefix():
    model = arch_model("llama")
    cache = PromptCache(max_bytes=10**8)
    engine = BatchDecoder(model, prompt_cache=cache)
    system = prompts((40,), seed=5)[0]
    first, second = system + [1, 2, 3], system + [7, 8]
    engine.add(Request(first, 10))
    while engine.rows:
        engine.step()
    rows = engine.add(Request(second, 10))
    assert engine.cached_tokens == 40 and engine.prompt_tokens == len(first) + 2
    got = []
    while engine.rows:
        got += [t.token for _, t in engine.step()]
    assert got == alone(model, second, SamplingParams(), 10)
    assert rows and cache.nbytes <= 10**8
    tight = PromptCache(max_bytes=cache.nbytes // 2)  # no room: nothing kept
    BatchDecoder(model, prompt_cache=tight).add(Request(first, 1))
    assert tight.nbytes == 0 and not tight.entries


def test_eval_accuracy_answers_are_the_one_at_a_time_answers(tmp_path):
    """`--eval-accuracy` decodes its answers together: each is the greedy answer
    `stream_generate` gives alone (cut with "..." where it stops matching), and the score
    counts the ones that match."""
    tok = byte_tokenizer(tmp_path)
    model = tiny_model(3, vocab_size=tok.vocab_size)
    rows = [{"prompt": p, "completion": "x"} for p in ("12+1=", "a long prompt of some length: ", "q", "99+1=")]
    render = Renderer(tok)
    ids = [(rec := parse_object(r, "row")).format.prompt(rec, render)[0] for r in rows]
    alone_texts = [generate(model, tok, p, max_tokens=8, temp=0.0) for p in ids]
    for r, text in zip(rows[::2], alone_texts[::2]):  # half of them answered right
        r["completion"] = text
    records = [parse_object(r, f"row {i}") for i, r in enumerate(rows)]
    report = accuracy(model, tok, records, max_tokens=8, full_answers=1)
    assert report.correct == 2 and report.total == 4
    for i, (sample, text) in enumerate(zip(report.samples, alone_texts)):
        assert sample["ok"] == (i % 2 == 0)
        if i == 0 or sample["ok"]:
            assert sample["answer"] == text
        else:
            assert sample["answer"].endswith("...") and text.startswith(sample["answer"][:-3])


@pytest.mark.parametrize("arch", list(ARCHS))
def test_prompts_arriving_together_are_prefilled_as_one_batch(arch, monkeypatch):
    """`add_many` prefills prompts of different lengths as one left-padded batch: each row's
    first logits are the model's uncached forward of its prompt alone, and its later tokens
    what it samples alone. Control: padding that real columns may attend to (the mask without
    `starts`) changes the shorter prompts' logits."""
    model = arch_model(arch)
    ps = prompts((5, 23, 11), seed=4)
    engine = BatchDecoder(model)
    calls = []
    monkeypatch.setattr(engine, "prefill", lambda *a: calls.append(a))  # nothing may go alone
    rows = engine.add_many([(Request(p, 6), 1) for p in ps])
    assert not calls and engine.prompt_tokens == sum(map(len, ps)) and len(engine.rows) == 3
    for p, (row,) in zip(ps, rows):
        want = model(mx.array([p]))[0, -1]
        assert mx.allclose(row.logits[0], want, atol=1e-4).item(), arch
    out: dict[int, list[int]] = {}
    while engine.rows:
        for row, tok in engine.step():
            out.setdefault(id(row), []).append(tok.token)
    for p, (row,) in zip(ps, rows):
        assert agree(model, p, out[id(row)], alone(model, p, SamplingParams(), 6)), arch

    monkeypatch.setattr(engine_module, "padded_causal_mask", lambda starts, width: padded_causal_mask(
        mx.zeros_like(starts), width))
    monkeypatch.setattr(prefill_module, "PREFILL_FUSED_ROWS", 0)  # the mask is what the blocks op by op read
    leaky = BatchDecoder(model).add_many([(Request(p, 6), 1) for p in ps])
    short = leaky[0][0].logits[0]
    assert not mx.allclose(short, model(mx.array([ps[0]]))[0, -1], atol=1e-2).item()


def test_a_tokens_logprob_is_reported_where_the_request_asks_for_it():
    """Rows that ask for log-probabilities get each token's, as numpy's log-softmax of the
    uncached forward's logits gives it, whether drawn by the batch's one argmax (greedy) or by
    the row's own sampler; rows that do not ask get none (no logsumexp over the vocabulary)."""
    model = arch_model("llama")
    ps = prompts((5, 9, 7), seed=4)
    engine = BatchDecoder(model)
    asks = [Request(ps[0], 6, SamplingParams(temp=0.0), logprobs=True),
            Request(ps[1], 6, SamplingParams(temp=0.0)),
            Request(ps[2], 6, SamplingParams(temp=0.8, seed=2), logprobs=True)]
    rows = [engine.add(r)[0] for r in asks]
    out: dict[int, list] = {id(r): [] for r in rows}
    while engine.rows:
        for row, tok in engine.step():
            out[id(row)].append(tok)
    for request, row in zip(asks, rows):
        got = out[id(row)]
        assert len(got) == 6
        if not request.logprobs:
            assert all(t.logprob is None for t in got)
            continue
        tokens = list(request.prompt) + [t.token for t in got]
        logits = np.array(model(mx.array([tokens[:-1]]))[0, len(request.prompt) - 1:], dtype=np.float64)
        logp = logits - logits.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        want = logp[np.arange(6), [t.token for t in got]]
        np.testing.assert_allclose([t.logprob for t in got], want, rtol=0, atol=1e-4)


def test_frequency_and_presence_penalties_count_the_row_s_own_tokens():
    """OpenAI's penalties, greedy: each token is the argmax of the uncached forward's logits
    minus frequency x its count among the row's generated tokens, minus presence once it has
    appeared (numpy, step by step), in a batch beside a plain greedy row of the same prompt,
    which is the control: it repeats, the penalized row takes other tokens."""
    model = arch_model("llama")
    prompt = prompts((6,), seed=7)[0]
    pen = SamplingParams(temp=0.0, frequency_penalty=1.5, presence_penalty=0.5)
    engine = BatchDecoder(model)
    plain_row = engine.add(Request(prompt, 24, SamplingParams(temp=0.0)))[0]
    pen_row = engine.add(Request(prompt, 24, pen))[0]
    out: dict[int, list[int]] = {id(plain_row): [], id(pen_row): []}
    while engine.rows:
        for row, tok in engine.step():
            out[id(row)].append(tok.token)
    got = out[id(pen_row)]
    counts = np.zeros(VOCAB)
    # each step against the row's own prefix, a near-tie allowed (a batch's products round apart
    # from one row's)
    for i, t in enumerate(got):
        logits = np.array(model(mx.array([prompt + got[:i]]))[0, -1], dtype=np.float64)
        penalized = logits - 1.5 * counts - 0.5 * (counts > 0)
        assert penalized[t] >= penalized.max() - 1e-3, i
        counts[t] += 1
    plain = out[id(plain_row)]
    assert len(got) == 24 and len(set(plain)) < len(set(got))


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma3"])
def test_prompts_scored_together_score_as_each_alone_and_as_the_forward(arch):
    """`score_many` reads prompts of different lengths left-padded in one batch (each row at
    its own positions: GPT-2's learned table, gemma3's sliding window); each prompt's token
    log-probabilities are what `score` gives it alone, and numpy's log-softmax of the uncached
    forward."""
    model = arch_model(arch)
    ps = prompts((5, 23, 11, 2), seed=5)
    engine = BatchDecoder(model)
    together = engine.score_many(ps, top=3)
    for p, got in zip(ps, together):
        alone_ = engine.score(p, top=3)
        assert [t.token for t in got] == p[1:] == [t.token for t in alone_]
        np.testing.assert_allclose([t.logprob for t in got], [t.logprob for t in alone_], rtol=0, atol=1e-4)
        logits = np.array(model(mx.array([p]))[0, :-1], dtype=np.float64)
        logp = logits - logits.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        np.testing.assert_allclose([t.logprob for t in got], logp[np.arange(len(p) - 1), p[1:]], rtol=0, atol=1e-4)
        for t, row in zip(got, logp):
            assert [a for a, _ in t.top][:1] == [int(np.argmax(row))] or abs(row.max() - t.top[0][1]) < 1e-4
    assert engine.score_many([[7]]) == [[]]  # one token: nothing to score
    # echo with logprobs and tokens to generate: the prefill that joins the rows scores them
    rows = engine.add_many([(Request(p, 6, SamplingParams(temp=0.0), score_prompt=True, top_logprobs=3), 1) for p in ps])
    out: dict[int, list[int]] = {id(r): [] for (r,) in rows}
    for p, (row,) in zip(ps, rows):
        np.testing.assert_allclose([t.logprob for t in row.prompt_scores], [t.logprob for t in engine.score(p)],
                                   rtol=0, atol=1e-4)
    while engine.rows:
        for row, tok in engine.step():
            out[id(row)].append(tok.token)
    for p, (row,) in zip(ps, rows):
        assert agree(model, p, out[id(row)], alone(model, p, SamplingParams(temp=0.0), 6))
    # prompts longer than a prefill group: read in chunks, scored by the one prefill that joins them
    chunked = BatchDecoder(model, prefill_step=8)
    rows = chunked.add_many([(Request(p, 2, SamplingParams(temp=0.0), score_prompt=True, top_logprobs=3), 1) for p in ps])
    for p, want, (row,) in zip(ps, together, rows):
        assert [t.token for t in row.prompt_scores] == p[1:]
        np.testing.assert_allclose([t.logprob for t in row.prompt_scores], [t.logprob for t in want], rtol=0, atol=1e-4)
