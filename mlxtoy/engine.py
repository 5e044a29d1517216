"""The batched decoder: many sequences in one KV cache, each at its own positions, joining and
leaving between decode steps (continuous batching). Serving (`mlxtoy.serve`), GRPO's rollouts
and the greedy evaluations (`generate_batch`) all decode through it.

- Requests that arrive together (`add_many`: the server's arrivals between two steps, GRPO's
  prompts, an evaluation's answers) are prefilled together, left-padded, in groups of at most
  `prefill_step` padded tokens, shortest prompts first (so a group's prompts are of like
  lengths and pad little): one product of many rows instead of one of a few rows per prompt.
  A request the prompt cache holds a prefix of (`PromptCache`), or whose prompt is
  longer than a group, is prefilled alone from that prefix. Either way its rows then join the
  batch cache left-padded (`mlxtoy.models.cache.join_rows`). `copies` > 1 prefills the prompt
  once and joins its cache that many times (GRPO's group, OpenAI's `n`).
- A request with `score_prompt` (OpenAI's echo with logprobs) has its prompt's own tokens
  scored by the prefill that joins it (`score_together`: the logits of every column kept);
  `score_many` scores prompts without joining them (`max_tokens` 0).
- Each row has its own positions: column c of row b is position c - starts[b], which is
  what a learned position table reads (GPT-2, the tiny model); RoPE sees relative positions
  only. So a row samples what it would sample alone.
- Each row has its own sampling parameters, random key (drawn as `generate_tokens` draws:
  split before each non-greedy token), repetition window, counts of its own tokens (OpenAI's
  frequency and presence penalties), adapter slot (a model serving
  several adapters of one base, `mlxtoy.models.adapters`) and an optional constraint
  (`response_format`): a row's tokens do not depend on which other rows share its batch.
- One `step()` samples a token for every row from its pending logits, drops the rows that
  ended (end-of-sequence, max_tokens, the context, or `cancel`), and runs one forward for the
  rest, compiled on a CPU as `generate_tokens`'s decode is (`mlxtoy.generate.decoder_for`).

Rows end at the model's context (the tiny model's window does not slide here, unlike
`generate_tokens`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Callable, Protocol, Sequence

import mlx.core as mx

from mlxtoy import backend
from mlxtoy.generate import PREFILL_STEP, decoder_for, forget_decoder, has_dropout, no_dropout
from mlxtoy.models import fastmath
from mlxtoy.models.adapters import adapter_rows_set, adapter_slots
from mlxtoy.models.cache import KVCache, join_rows, keep_rows, make_cache, row_cache
from mlxtoy.models.compiled import forget_compiled
from mlxtoy.prompt_cache import PromptCache
from mlxtoy.sampling import SamplingParams, apply_frequency_presence, make_sampler


class Constraint(Protocol):
    """What a row's output must match (e.g. a JSON schema, `mlxtoy.constrain`)."""

    def allowed(self) -> mx.array | None:
        """(vocab,) bool: the tokens that may come next; None: any."""

    def advance(self, token: int) -> None:
        """The row took `token`."""


@dataclass
class Request:
    prompt: Sequence[int]
    max_tokens: int = 256
    sampling: SamplingParams = field(default_factory=SamplingParams)
    eos: frozenset[int] = frozenset()
    adapter: int = 0  # the slot of the model's adapter this row reads (0: the base)
    top_logprobs: int = 0  # how many of the most likely tokens to report with each token
    constraint: Constraint | None = None
    # report each token's log-probability (a logsumexp over the vocabulary for every token: a
    # few percent of a step, so only for a request that asks; top_logprobs asks too)
    logprobs: bool = False
    logit_bias: dict[int, float] | None = None  # OpenAI's: added to these tokens' logits before sampling
    # its prompt's own tokens scored too, by the prefill that reads them (`Row.prompt_scores`,
    # `BatchDecoder.score`): OpenAI's echo with logprobs
    score_prompt: bool = False

    @property
    def wants_logprob(self) -> bool:
        return self.logprobs or self.top_logprobs > 0


@dataclass
class Token:
    token: int
    logprob: float | None  # the model's (raw logits, temperature 1), where the request asked
    top: list[tuple[int, float]] | None = None  # (token, logprob) of the most likely, best first
    finish: str | None = None  # "stop" (an end-of-sequence token, included), "length"


class Row:
    """One sequence being decoded: its request, sampler state and pending logits."""

    def __init__(self, request: Request, seed: int, budget: int, logits: mx.array):
        self.request = request
        self.sampler = make_sampler(request.sampling)
        self.key = mx.random.key(seed)
        window = request.sampling.repetition_window if request.sampling.repetition_penalty != 1.0 else 0
        self.window = window
        self.recent = mx.array(list(request.prompt[-window:]) if window else [], dtype=mx.uint32)
        self.budget = budget  # tokens it may still generate (max_tokens clipped to the context)
        self.logits = logits  # (1, V): where its next token is drawn from
        # how often each token was generated so far, where the frequency / presence penalty reads it
        self.counts = mx.zeros((logits.shape[-1],), mx.float32) if request.sampling.counts_tokens else None
        self.bias = None
        if request.logit_bias:
            ids = list(request.logit_bias)
            self.bias = mx.zeros((logits.shape[-1],), mx.float32).at[mx.array(ids)].add(
                mx.array([request.logit_bias[t] for t in ids], dtype=mx.float32))
        self.prompt_scores: list[Token] | None = None  # where the request has score_prompt
        self.generated = 0
        self.cancelled = False
        self.cached_tokens = 0  # prompt tokens its prefill took from the prompt cache

    def draw(self) -> tuple[mx.array, mx.array | None]:
        """-> (token (1,), logprob () where the request wants it) from the pending logits, lazily."""
        logits = self.logits
        allowed = self.request.constraint.allowed() if self.request.constraint is not None else None
        masked = logits if allowed is None else mx.where(allowed, logits, -mx.inf)
        if self.bias is not None:
            masked = masked + self.bias
        if self.counts is not None:
            s = self.request.sampling
            masked = apply_frequency_presence(masked, self.counts, s.frequency_penalty, s.presence_penalty)
        sub = None
        if not self.request.sampling.greedy:
            self.key, sub = mx.random.split(self.key)
        token = self.sampler(masked, self.recent, sub)
        if not self.request.wants_logprob:
            return token, None
        return token, logits[0, token[0]] - fastmath.logsumexp(logits[0])


DEAD_ROWS = 0.125  # the share of the batch cache that rows which left may hold before it is compacted


class BatchDecoder:
    """A batch of rows decoded together; `add` between `step`s. Not thread-safe: one thread
    (the server's engine thread, or the trainer's) drives it."""

    def __init__(self, model, *, compile_decode: bool = True, prompt_cache: PromptCache | None = None,
                 prefill_step: int = PREFILL_STEP):
        self.model = model
        self.cache: list[KVCache] = make_cache(model)
        self.rows: list[Row] = []
        # row i's row of the batch cache; the cache may hold rows that ended, until `remove`
        # compacts it (see there)
        self.cache_rows: list[int] = []
        # the tiny model's cache holds its window's tokens too, which a prompt cache does not keep
        self.prompt_cache = None if getattr(model, "sliding_window", False) else prompt_cache
        self.prefill_step = prefill_step
        self.dropout = has_dropout(model)
        self.compiled = compile_decode and backend.INFO.compiled_decode and hasattr(model, "hidden")
        self.decode = None  # the compiled one-token step, once fetched
        self.slots = adapter_slots(model)
        cfg = getattr(model, "config", None)
        self.context = getattr(cfg, "context_length", None)
        self.logits: mx.array | None = None  # the last forward's (B, V), while its rows are the rows
        self.prompt_tokens = 0  # tokens prefilled (prompt cache hits excluded)
        self.cached_tokens = 0  # prompt tokens served from the prompt cache
        self.padded_tokens = 0  # columns of the prompts prefilled together, padding included

    def add(self, request: Request, copies: int = 1) -> list[Row]:
        """Prefill `request.prompt` once and add `copies` rows reading it; copy j draws from
        seed + j (a fresh random seed when the request has none). The prompt must leave at
        least one position of the context (see `generate.check_prompt`)."""
        return self.add_many([(request, copies)])[0]

    def budget(self, request: Request) -> int:
        """The tokens `request` may generate: max_tokens clipped to the context; ValueError for
        an empty prompt or one that leaves no room."""
        if len(request.prompt) == 0:
            raise ValueError("empty prompt")
        budget = request.max_tokens
        if self.context:
            budget = min(budget, self.context - len(request.prompt))
        if budget <= 0:
            raise ValueError(f"the prompt ({len(request.prompt)} tokens) leaves no room in the context ({self.context})")
        return budget

    def add_many(self, items: Sequence[tuple[Request, int]]) -> list[list[Row]]:
        """`add` of each (request, copies), their prompts prefilled together where they can
        be (see the module docstring); -> each item's rows. Every request is checked
        (`budget`) before anything is prefilled."""
        budgets = [self.budget(r) for r, _ in items]
        prompts = [[int(t) for t in r.prompt] for r, _ in items]
        out: list[list[Row]] = [[] for _ in items]
        short, scoring = [], []  # the items prefilled together: grouped by length, so that a group pads little
        for i, ((request, copies), prompt) in enumerate(zip(items, prompts)):
            # (a prompt to score is read whole: the prompt cache keeps no logits)
            hit_cache, hit = (self.prompt_cache.fetch(prompt, request.adapter)
                              if self.prompt_cache is not None and not request.score_prompt else (None, 0))
            if hit or len(prompt) > self.prefill_step:
                cache, logits, hit, scores = self.prefill(prompt, request.adapter, (hit_cache, hit),
                                                          request.top_logprobs if request.score_prompt else None)
                self.join(cache, logits, [(i, hit)], items, budgets, out, [scores])
                continue
            (scoring if request.score_prompt else short).append(i)
        lengths = [len(p) for p in prompts]
        for group in length_groups(short, lengths, self.prefill_step):
            cache, logits = self.prefill_together([prompts[i] for i in group], [items[i][0].adapter for i in group])
            self.join(cache, logits, [(i, 0) for i in group], items, budgets, out)
        for top in sorted({items[i][0].top_logprobs for i in scoring}):  # (a group reports one count of alternatives)
            for group in length_groups([i for i in scoring if items[i][0].top_logprobs == top], lengths,
                                       self.prefill_step):
                cache, logits, scores = self.score_together([prompts[i] for i in group],
                                                            [items[i][0].adapter for i in group], top)
                self.join(cache, logits, [(i, 0) for i in group], items, budgets, out, scores)
        return out

    def join(self, cache: list[KVCache], logits: mx.array, which: list[tuple[int, int]],
             items: Sequence[tuple[Request, int]], budgets: list[int], out: list[list[Row]],
             scores: Sequence[list[Token] | None] | None = None) -> None:
        """Row b of the prefilled `cache` (and of `logits`) is item which[b][0], of which
        which[b][1] prompt tokens came from the prompt cache: its copies join the batch, with
        its prompt's scores[b] where scored."""
        self.compact()  # the join copies the cache anyway
        join_rows(self.cache, cache, [items[i][1] for i, _ in which])
        self.logits = None
        for b, (i, hit) in enumerate(which):
            request, copies = items[i]
            seed = request.sampling.seed
            if seed is None:
                seed = int.from_bytes(os.urandom(4), "little")
            rows = [Row(request, seed + j, budgets[i], logits[b:b + 1]) for j in range(copies)]
            for r in rows:
                r.cached_tokens = hit
                r.prompt_scores = scores[b] if scores else None
            out[i] = rows
            self.cache_rows += range(len(self.rows), len(self.rows) + len(rows))
            self.rows += rows

    def prefill(self, prompt: list[int], adapter: int, hit: tuple[list[KVCache] | None, int] = (None, 0),
                top: int | None = None) -> tuple[list[KVCache], mx.array, int, list[Token] | None]:
        """-> (a B = 1 cache holding `prompt`, the logits (1, V) after its last token, how many
        of its tokens came from the prompt cache: `hit`, its prefix found there, or nothing;
        the rest is read in `prefill_step` chunks; with `top` (not None), the prompt's own
        tokens scored as `score` scores them, else None). Scoring reads the whole prompt: a
        chunk's logits are kept for every column, so at most a chunk's are held."""
        cache, n_hit = hit
        assert top is None or n_hit == 0, "a scored prompt is read whole"
        cache = cache if cache is not None else make_cache(self.model)
        self.cached_tokens += n_hit
        self.prompt_tokens += len(prompt) - n_hit
        todo = [int(t) for t in prompt[n_hit:]]
        scores: list[Token] | None = None if top is None else []
        with no_dropout(self.model, self.dropout), fastmath.inference(), \
                adapter_rows_set(self.model, mx.array([adapter], dtype=mx.int32) if self.slots else None):
            for s in range(0, len(todo), self.prefill_step):
                chunk = todo[s:s + self.prefill_step]
                h = self.hidden(mx.array(chunk, dtype=mx.uint32)[None], None, cache)
                if scores is not None:
                    logits = self.model.logits(h[0])  # every column's
                    targets = todo[s + 1:s + 1 + len(chunk)]  # the prompt's last token has none
                    scores += scored(logits[:len(targets)], targets, top, [c.state for c in cache])
                    logits = logits[-1:]
                elif s + self.prefill_step >= len(todo):
                    logits = self.model.logits(h[:, -1, :])
                else:
                    mx.eval([c.state for c in cache])
        mx.eval(logits, [c.state for c in cache])
        if self.prompt_cache is not None:
            self.prompt_cache.store(prompt, adapter, cache)
        return cache, logits, n_hit, scores

    def prefill_together(self, prompts: list[list[int]], adapters: list[int]) -> tuple[list[KVCache], mx.array]:
        """-> (a cache of len(prompts) rows, each prompt left-padded to the longest, `starts`
        set; the logits (rows, V) after each prompt's last token)."""
        cache, logits = self.read_together(prompts, adapters, lambda h: self.model.logits(h[:, -1, :]))
        mx.eval(logits, [c.state for c in cache])
        self.remember(prompts, adapters, cache)
        return cache, logits

    def remember(self, prompts: list[list[int]], adapters: list[int], cache: list[KVCache]) -> None:
        """Keep each row of a cache of prompts read together in the prompt cache."""
        if self.prompt_cache is not None:
            for b, (p, a) in enumerate(zip(prompts, adapters)):
                self.prompt_cache.store(p, a, row_cache(cache, b))

    def read_together(self, prompts: list[list[int]], adapters: list[int],
                      head: Callable[[mx.array], mx.array]) -> tuple[list[KVCache], mx.array]:
        """-> (a cache of len(prompts) rows, each prompt left-padded to the longest, `starts`
        set; `head` of the hidden states (rows, width, d_model)), lazily. A padding column reads
        token 0 and attends to itself only, so every value stays finite; real columns never
        see it."""
        width = max(len(p) for p in prompts)
        pads = [width - len(p) for p in prompts]
        self.prompt_tokens += sum(len(p) for p in prompts)
        self.padded_tokens += width * len(prompts)
        tokens = mx.array([[0] * n + p for n, p in zip(pads, prompts)], dtype=mx.uint32)
        starts = mx.array(pads, dtype=mx.int32)
        cache = make_cache(self.model)
        for c in cache:  # room for the prompts only: the rows join the batch's cache right after
            c.starts, c.step = starts, width
        with no_dropout(self.model, self.dropout), fastmath.inference(), \
                adapter_rows_set(self.model, mx.array(adapters, dtype=mx.int32) if self.slots else None):
            return cache, head(self.hidden(tokens, padded_causal_mask(starts, width), cache))

    def score_many(self, prompts: Sequence[Sequence[int]], adapter: int = 0, top: int = 0) -> list[list[Token]]:
        """`score` of each prompt. Prompts of like lengths are read together, left-padded, in
        groups of at most `prefill_step` padded tokens (as `add_many` prefills them): one
        product of many rows instead of one of a few rows per prompt (an evaluation harness
        sends a question's every answer at once)."""
        prompts = [[int(t) for t in p] for p in prompts]
        out: list[list[Token]] = [[] for _ in prompts]
        short = []
        for i, p in enumerate(prompts):
            if len(p) > self.prefill_step:
                out[i] = self.score(p, adapter, top)
            elif len(p) > 1:
                short.append(i)
        for group in length_groups(short, [len(p) for p in prompts], self.prefill_step):
            for i, scores in zip(group, self.score_together([prompts[i] for i in group], [adapter] * len(group), top)[2]):
                out[i] = scores
        return out

    def score_together(self, prompts: list[list[int]], adapters: list[int], top: int
                       ) -> tuple[list[KVCache], mx.array, list[list[Token]]]:
        """`prefill_together` that scores the prompts' own tokens too: -> (the cache, the logits
        (rows, V) after each prompt's last token, each prompt's scored tokens)."""
        width = max(len(p) for p in prompts)
        n = sum(len(p) - 1 for p in prompts)

        def head(h: mx.array) -> mx.array:  # each row's columns that predict its next token, then its last
            return self.model.logits(mx.concatenate([h[b, width - len(p):width - 1] for b, p in enumerate(prompts)]
                                                    + [h[:, -1, :]]))

        cache, logits = self.read_together(prompts, adapters, head)
        tokens = scored(logits[:n], [t for p in prompts for t in p[1:]], top, [logits, [c.state for c in cache]])
        out = []
        for p in prompts:
            out.append(tokens[:len(p) - 1])
            tokens = tokens[len(p) - 1:]
        self.remember(prompts, adapters, cache)
        return cache, logits[n:], out

    def score(self, prompt: Sequence[int], adapter: int = 0, top: int = 0) -> list[Token]:
        """The prompt's own tokens as the model reads them: for each token after the first, its
        log-probability given the ones before it (and the `top` most likely there), read as
        `prefill` reads a prompt, in `prefill_step` chunks (OpenAI's echo with logprobs: how an
        evaluation harness scores a continuation). Takes no place in the batch."""
        return self.prefill([int(t) for t in prompt], adapter, top=top)[3]

    def hidden(self, tokens: mx.array, mask, cache: list) -> mx.array:
        return self.model.hidden(tokens, mask=mask, cache=cache)

    def cancel(self, row: Row) -> None:
        """Drop `row` at the next step (a client that went away)."""
        row.cancelled = True

    def step(self) -> list[tuple[Row, Token]]:
        """One token for every row; rows that ended (or were cancelled) leave the batch."""
        live = [i for i, r in enumerate(self.rows) if not r.cancelled]
        if len(live) < len(self.rows):
            self.remove(live)
        if not self.rows:
            return []
        drawn = self.draw()
        tops = []
        for r in self.rows:
            k = r.request.top_logprobs
            if k:
                logp = r.logits[0] - fastmath.logsumexp(r.logits[0])
                ids, values = most_likely(logp[None], k)
                tops.append((ids[0], values[0]))
            else:
                tops.append(None)
        mx.eval([d for pair in drawn for d in pair if d is not None], [t for t in tops if t is not None])
        out, keep = [], []
        for i, (r, (tok, logprob), top) in enumerate(zip(self.rows, drawn, tops)):
            t = int(tok.item())
            r.generated += 1
            if r.request.constraint is not None:
                r.request.constraint.advance(t)
            finish = "stop" if t in r.request.eos else "length" if r.generated >= r.budget else None
            top_list = list(zip(top[0].tolist(), top[1].tolist())) if top is not None else None
            out.append((r, Token(t, None if logprob is None else float(logprob.item()), top_list, finish)))
            if finish is None:
                keep.append(i)
                if r.window:
                    r.recent = mx.concatenate([r.recent, tok.astype(mx.uint32)])[-r.window:]
                if r.counts is not None:
                    r.counts = r.counts.at[tok].add(1.0)
        tokens = mx.concatenate([drawn[i][0] for i in keep]) if keep else None
        if len(keep) < len(self.rows):
            self.remove(keep)
        if self.rows:
            self.forward(tokens.astype(mx.int32)[:, None])
        return out

    def draw(self) -> list[tuple[mx.array, mx.array | None]]:
        """Every row's (token (1,), logprob () where its request wants it), lazily: the plain
        greedy rows (no constraint, penalty or top logprobs) by one argmax over the batch's
        logits, the others each by its own sampler."""
        plain = [r.request.sampling.greedy and not r.window and r.request.constraint is None
                 and not r.request.top_logprobs and r.counts is None and r.bias is None for r in self.rows]
        if sum(plain) < 2:
            return [r.draw() for r in self.rows]
        logits = self.logits if self.logits is not None else mx.concatenate([r.logits for r in self.rows])
        tokens = fastmath.argmax(logits)
        wanted = [i for i, (r, p) in enumerate(zip(self.rows, plain)) if p and r.request.wants_logprob]
        logprob = {}
        if wanted:
            idx = mx.array(wanted)
            some = logits[idx]
            chosen = mx.take_along_axis(some, tokens[idx][:, None], axis=-1)[:, 0]
            logprob = dict(zip(wanted, chosen - fastmath.logsumexp(some)))
        return [(tokens[i:i + 1], logprob.get(i)) if p else r.draw() for i, (r, p) in enumerate(zip(self.rows, plain))]

    def remove(self, keep: list[int]) -> None:
        """Keep only the rows at these indices. Their cache rows stay where they are while
        those of rows that left are at most DEAD_ROWS of the cache: compacting it copies every
        row's keys and values (~120 ms for 32 rows of SmolLM2 with room for 256 tokens, more than
        a step) and changes the decode's shapes (a new trace), while a row that left only costs
        its share of each step until the next join or the next compaction."""
        self.rows = [self.rows[i] for i in keep]
        self.cache_rows = [self.cache_rows[i] for i in keep]
        self.logits = None
        if len(self.cache_rows) < (1 - DEAD_ROWS) * self.cache_width():
            self.compact()

    def cache_width(self) -> int:
        """The rows the batch cache holds, those of rows that left included."""
        starts = self.cache[0].starts if self.cache else None
        return 0 if starts is None else starts.shape[0]

    def compact(self) -> None:
        """Drop the cache rows of rows that left."""
        if self.cache_rows != list(range(self.cache_width())):
            keep_rows(self.cache, self.cache_rows)
            self.cache_rows = list(range(len(self.rows)))

    def release(self) -> None:
        """Free every array this decoder made (rows, the prompt cache, the compiled decode) and
        wait for its work: a thread that decoded calls it before it ends (MLX arrays and traces
        outliving their thread's stream abort the process at exit)."""
        self.remove([])
        if self.prompt_cache is not None:
            self.prompt_cache.clear()
        self.decode = None
        forget_decoder(self.model)
        forget_compiled()
        mx.synchronize()
        mx.clear_cache()

    def forward(self, tokens: mx.array) -> None:
        """Every row reads its token (B, 1); its pending logits become the result's row."""
        starts = self.cache[0].starts
        width = self.cache_width()
        adapters = None
        if self.slots:  # each cache row's adapter; rows that left read the base's slot
            adapter = [0] * width
            for r, c in zip(self.rows, self.cache_rows):
                adapter[c] = r.request.adapter
            adapters = mx.array(adapter, dtype=mx.int32)
        if len(self.rows) < width:  # rows that left read token 0 in their cache rows
            tokens = mx.zeros((width, 1), dtype=tokens.dtype).at[mx.array(self.cache_rows)].add(tokens)
        with no_dropout(self.model, self.dropout):
            if self.compiled:
                # fetched once: its structure check walks every parameter, too slow for every step
                self.decode = self.decode or decoder_for(self.model)
                logits = self.decode(tokens, self.cache, starts, adapters)
            else:
                cols = mx.arange(self.cache[0].offset + 1)
                mask = (cols[None, :] >= starts[:, None])[:, None, None, :]
                with fastmath.inference(), adapter_rows_set(self.model, adapters):
                    logits = self.model.logits(self.hidden(tokens, mask, self.cache)[:, -1, :])
        if len(self.rows) < width:
            logits = logits[mx.array(self.cache_rows)]
        self.logits = logits  # (B, V): row i's pending logits, until rows join or leave
        for i, r in enumerate(self.rows):
            r.logits = logits[i:i + 1]


def scored(logits: mx.array, targets: list[int], top: int, also: list | None = None) -> list[Token]:
    """logits (n, V) of n places and the token that came at each -> each as a Token with its
    log-probability there (and the `top` most likely); evaluated with `also`."""
    if not targets:
        mx.eval(also or [])
        return []
    logp = logits - fastmath.logsumexp(logits)[:, None]
    picked = mx.take_along_axis(logp, mx.array(targets)[:, None], axis=-1)[:, 0]
    best, best_logp = most_likely(logp, top) if top else (None, None)
    mx.eval(picked, [a for a in (best, best_logp) if a is not None], also or [])
    return [Token(t, lp, list(zip(best[j].tolist(), best_logp[j].tolist())) if top else None)
            for j, (t, lp) in enumerate(zip(targets, picked.tolist()))]


def most_likely(logp: mx.array, k: int) -> tuple[mx.array, mx.array]:
    """The k largest of each row of logp (n, V), best first: (ids (n, k), values (n, k)). A
    partition, then a sort of the k only: sorting every row of a scored prompt's logits over the
    vocabulary was most of a harness's request."""
    k = min(k, logp.shape[-1])
    if k == 1:  # (an evaluation harness's logprobs: 1)
        best = fastmath.argmax(logp)[:, None]
        return best, mx.take_along_axis(logp, best, axis=-1)
    part = mx.argpartition(-logp, kth=k - 1, axis=-1)[:, :k]
    values = mx.take_along_axis(logp, part, axis=-1)
    order = mx.argsort(-values, axis=-1)
    return mx.take_along_axis(part, order, axis=-1), mx.take_along_axis(values, order, axis=-1)


def length_groups(items: list[int], lengths: list[int], budget: int) -> list[list[int]]:
    """`items` in groups of like lengths (shortest first), each at most `budget` once every
    member is padded to the group's longest: prompts read together pad little."""
    groups: list[list[int]] = [[]]
    for i in sorted(items, key=lambda j: lengths[j]):
        if groups[-1] and (len(groups[-1]) + 1) * lengths[i] > budget:  # (the longest so far)
            groups.append([])
        groups[-1].append(i)
    return [g for g in groups if g]


def padded_causal_mask(starts: mx.array, width: int) -> mx.array:
    """(rows, 1, width, width) bool: causal, and row b's real columns (from starts[b]) see no
    padding; a padding column sees itself only (attending to nothing would make NaNs, which
    the padding's keys and values would then carry into every later layer)."""
    cols = mx.arange(width)
    query, key = cols[None, :, None], cols[None, None, :]
    return ((key <= query) & (key >= mx.minimum(starts[:, None, None], query)))[:, None]


def generate_batch(model, prompts: Sequence[Sequence[int]], *, repeats: int = 1,
                   sampling: SamplingParams | None = None, max_tokens: int = 256,
                   eos_ids=(), seed: int = 0, adapter: int = 0) -> list[list[int]]:
    """`repeats` continuations of each prompt (prompt-major) decoded together through the
    batched decoder; each ends at its first token in `eos_ids` (kept) or after `max_tokens`
    (clipped to the context). Each prompt is prefilled once and its cache shared by its
    `repeats` rows. Deterministic in `seed`: row r draws from seed * 2**20 + r, so each row
    samples what `generate_tokens` would with that seed (repetition penalty included).
    GRPO's rollouts, its greedy eval and `--eval-accuracy`."""
    sampling = (sampling or SamplingParams()).validate()
    eos = frozenset(int(t) for t in eos_ids)
    engine = BatchDecoder(model)
    items = [(Request(p, max_tokens, replace(sampling, seed=seed * 2**20 + i * repeats), eos, adapter), repeats)
             for i, p in enumerate(prompts)]
    fits = [max_tokens > 0 and (not engine.context or len(p) < engine.context) for p in prompts]
    added = iter(engine.add_many([item for item, ok in zip(items, fits) if ok]))
    per_prompt = [next(added) if ok else [None] * repeats for ok in fits]
    out: dict[int, list[int]] = {id(r): [] for rows in per_prompt for r in rows if r is not None}
    while engine.rows:
        for row, tok in engine.step():
            out[id(row)].append(tok.token)
    return [out[id(r)] if r is not None else [] for rows in per_prompt for r in rows]
