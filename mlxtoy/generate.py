"""Generation: KV-cache decoding, streaming detokenization and chat.

The pieces, smallest first (sampling, pure functions on logits, is `mlxtoy.sampling`):
- `generate_tokens`: chunked prefill into a KV cache, then one-token decode steps, each one
  compiled graph (`_compiled_decode`), pipelined with `mx.async_eval` (the next step is
  queued before the current token is read back, as mlx-lm does), yielding (token, logprob);
- `StreamingDetokenizer`: token bytes -> text that never ends inside a UTF-8 character and
  never shows the start of a user stop string before it is known not to be one;
- `stream_generate` / `generate`: the Python API; `ChatSession`: a conversation that keeps its
  KV cache between turns and prefills only the tokens that changed.

It needs only a model (anything with `layers`, and `hidden`/`logits` or `__call__` taking a
cache) and a tokenizer, so the trainer can call it mid-run for sample generations.
"""

from __future__ import annotations

import codecs
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlxtoy import backend
from mlxtoy.errors import UserError
from mlxtoy.models import fastmath
from mlxtoy.models.adapters import adapter_rows_set
from mlxtoy.models.cache import KVCache, SlotCache, cache_offset, make_cache, trim_cache
from mlxtoy.models.fused_weights import choose_row_passes
from mlxtoy.models.lora import dora_adapters, rescales_fixed
from mlxtoy.sampling import SamplingParams, make_sampler

if TYPE_CHECKING:  # annotations only: importing generate must not pull in HF `tokenizers`, jinja2
    from mlxtoy.io.tokenizer import TokenizerLike

PREFILL_STEP = 512  # prompt tokens per forward pass; bounds the attention scores' memory

# --------------------------------------------------------------------------- decoding


def has_dropout(model) -> bool:
    if not isinstance(model, nn.Module):
        return False
    return any(isinstance(m, nn.Dropout) for _, m in model.named_modules())


@contextmanager
def no_dropout(model, dropout: bool):
    """Eval mode while a step's graph is built (MLX draws dropout masks then), restored right
    after: sampling mid-training never sees dropout and never leaves the trainer in eval mode."""
    switch = dropout and model.training
    if switch:
        model.eval()
    try:
        yield
    finally:
        if switch:
            model.train()


def _forward_last(model, tokens: mx.array, cache: list) -> mx.array:
    """Logits (B, V) of the last position only: the vocabulary projection is the largest
    matmul of a small model, so prefill must not pay it for every prompt token."""
    with fastmath.inference():
        if hasattr(model, "hidden") and hasattr(model, "logits"):
            h = model.hidden(tokens, cache=cache)
            return model.logits(h[:, -1, :])
        return model(tokens, cache=cache)[:, -1, :]


def _compiled_decode(model) -> Callable[[mx.array, list, list, list, mx.array], mx.array]:
    """-> step(tokens (B, 1), cache, packs, head, start (B,), rows, rescales) -> logits (B, V): the
    one-token forward as one compiled graph, with the position a traced input so the graph is
    reused token after token; packs: per layer, the packed matrices its fused block reads;
    head: [] or [the packed output matrix] (inputs, like the weights); start: each row's first
    cached column that it may see (left-padded rows of a batch, `mlxtoy.engine`; zeros
    otherwise), its own positions counted from there; rows: [] or [each row's adapter slot]
    for a model serving several adapters at once (`mlxtoy.models.adapters`); rescales: each DoRA
    adapter's rescale (`lora.dora_adapters`), made once for the generation.

    The graph's shapes depend only on the cache buffers' capacity, which grows every
    `KVCache.step` tokens, and on the number of rows (a new trace then, ~50 ms). Building the
    eager graph costs ~6 ms of Python per token on a 2-core CPU, taken from the cores the
    matmuls need; the compiled call ~2 ms. The model's own modules are traced (LoRA included), with its parameters as
    inputs, so weights updated by training are picked up; `decoder_for` makes a new compiled
    function when the model's structure changes, so it is never served a stale trace.
    """

    dora = dora_adapters(model)

    def forward(tokens, offset, keys, values, packs, head, start, rows, rescales):
        slots = [SlotCache(k, v, offset, p, start) for k, v, p in zip(keys, values, packs)]
        positions = mx.arange(keys[0].shape[2])
        mask = ((positions <= offset)[None, :] & (positions[None, :] >= start[:, None]))[:, None, None, :]
        with adapter_rows_set(model, rows[0] if rows else None), rescales_fixed(dora, rescales):
            h = model.hidden(tokens, mask=mask, cache=slots)[:, -1, :]
            logits = fastmath.linear_packed(h, head[0]) if head else model.logits(h)
        return logits, [s.keys for s in slots], [s.values for s in slots]

    compiled = mx.compile(forward, inputs=model.state)

    traced: set[tuple] = set()  # the input shapes traced for (MLX traces again for new ones)

    def step(tokens: mx.array, cache: list, packs: list[dict], head: list, start: mx.array,
             rows: list, rescales: list) -> mx.array:
        for c in cache:
            c.reserve(1)
        offset = mx.array([cache[0].offset], dtype=mx.int32)
        with fastmath.inference():  # (traced here, on the first call and when shapes change)
            logits, keys, values = compiled(tokens, offset, [c.keys for c in cache],
                                            [c.values for c in cache], packs, head, start, rows, rescales)
        # a trace (a new capacity, or rows joining or leaving): the model holds new objects for
        # its weights, which the fused blocks' kept packs are then pinned to
        shapes = (tokens.shape, cache[0].keys.shape, start.shape, tuple(r.shape for r in rows))
        if shapes not in traced:
            traced.add(shapes)
            if hasattr(model, "repin_packs"):
                model.repin_packs()
        for c, k, v in zip(cache, keys, values):
            c.keys, c.values = k, v
            c.offset += 1
        return logits

    return step


def _structure(model) -> tuple:
    """What a decode trace depends on besides the weights' values: the parameters' names,
    shapes and dtypes, and the classes of the modules (an adapter added, merged or removed, a
    layer swapped, all change it)."""
    return (tuple((k, v.shape, v.dtype) for k, v in tree_flatten(model.parameters())),
            tuple(type(m) for _, m in model.named_modules()))


def decoder_for(model) -> Callable[..., mx.array]:
    """`_compiled_decode(model)`, kept on the model for its next generation while its structure
    is the same: a chat or a trainer's sample generations then reuse the trace instead of
    paying it before every first token. (Kept as a plain attribute, not a module child: the
    model -> trace -> model cycle is then one the garbage collector frees.)"""
    # the layers' matrices packed for decoding (made once, then kept while the weights are the
    # same arrays); which ones are packed is part of the trace's structure
    packs = [layer.decode_packs() if hasattr(layer, "decode_packs") else {} for layer in getattr(model, "layers", [])]
    head = model.decode_head_pack() if hasattr(model, "decode_head_pack") else None
    head = [head] if head is not None and fastmath.FUSED_DECODE else []
    structure = (_structure(model), tuple(tuple(sorted(p)) for p in packs), len(head))
    # DoRA's rescales, constant while a generation's weights are, made once for its tokens (made
    # again every token, a 4-bit base's DoRA dequantizes each adapted matrix for its norm)
    with fastmath.inference():
        rescales = [m.dora_scale() for m in dora_adapters(model)]
    mx.eval(rescales)
    kept = vars(model).get("mlxtoy_decoder")
    if kept is not None and kept[0] == structure and not rescales and all(a is b for a, b in zip(head, kept[3])) and all(
            p.keys() == q.keys() and all(p[k] is q[k] for k in p) for p, q in zip(packs, kept[2])):
        return kept[4]
    step = kept[1] if kept is not None and kept[0] == structure else _compiled_decode(model)
    choose_row_passes(getattr(model, "layers", []), packs)

    first = mx.zeros((1,), dtype=mx.int32)

    def decode(tokens: mx.array, cache: list, start: mx.array | None = None,
               adapter_rows: mx.array | None = None) -> mx.array:
        return step(tokens, cache, packs, head, first if start is None else start,
                    [] if adapter_rows is None else [adapter_rows], rescales)

    object.__setattr__(model, "mlxtoy_decoder", (structure, step, packs, head, decode))
    return decode


def forget_decoder(model) -> None:
    """Drop the compiled decode kept on `model` (`decoder_for`), with the arrays its traces hold:
    what a thread that decoded must do before it ends, while its stream is still there."""
    if "mlxtoy_decoder" in vars(model):
        object.__setattr__(model, "mlxtoy_decoder", None)


def _prefill_only(model, tokens: mx.array, cache: list) -> None:
    with fastmath.inference():
        if hasattr(model, "hidden"):
            model.hidden(tokens, cache=cache)
        else:
            model(tokens, cache=cache)
    mx.eval([c.state for c in cache])


@dataclass
class DecodeTimes:
    prompt_tokens: int = 0  # tokens actually run through the model (cache hits excluded)
    prompt_time: float = 0.0  # seconds until the first new token was known
    decode_tokens: int = 0
    decode_time: float = 0.0


def generate_tokens(model, prompt_tokens: Sequence[int], cache: list | None = None, *,
                    sampling: SamplingParams | None = None, max_tokens: int = 256,
                    prefill_step: int = PREFILL_STEP, times: DecodeTimes | None = None,
                    compile_decode: bool = True) -> Iterator[tuple[int, float]]:
    """Yield (token, logprob) for up to `max_tokens` new tokens after `prompt_tokens`.

    `cache` may already hold the K/V of a prefix of `prompt_tokens` (its offset says how many);
    only the rest is prefilled. The logprob is the model's (raw logits, temperature 1).
    Before a token is yielded its own decode step is already queued (pipelining), so once the
    caller stops the cache may also hold the last yielded token: use `cache_offset(cache)`.
    compile_decode: run the one-token steps through `_compiled_decode` (models with
    `hidden`/`logits` and KVCache caches, where `backend.INFO.compiled_decode`); False builds
    each step eagerly.
    """
    sampling = (sampling or SamplingParams()).validate()
    sampler = make_sampler(sampling)
    cache = cache if cache is not None else make_cache(model)
    times = times if times is not None else DecodeTimes()
    start = cache_offset(cache)
    if start >= len(prompt_tokens):
        raise ValueError(f"the cache holds {start} tokens but the prompt has only "
                         f"{len(prompt_tokens)}: at least one must be left to read")
    if max_tokens <= 0:
        return
    dropout = has_dropout(model)
    seed = sampling.seed if sampling.seed is not None else int.from_bytes(os.urandom(4), "little")
    key = mx.random.key(seed)
    window = sampling.repetition_window if sampling.repetition_penalty != 1.0 else 0
    recent = mx.array(list(prompt_tokens[-window:]) if window else [], dtype=mx.uint32)

    compiled = compile_decode and backend.INFO.compiled_decode and hasattr(model, "hidden") \
        and all(isinstance(c, KVCache) for c in cache) \
        and not getattr(model, "sliding_window", False)  # models.tiny slides in Python
    decode = None  # fetched after the first token, so its structure check is not in that token's latency

    def step(tokens: mx.array, sampled: bool):
        nonlocal key, recent, decode
        with no_dropout(model, dropout):
            if sampled and compiled:
                decode = decode or decoder_for(model)
                logits = decode(tokens[None], cache)
            else:
                logits = _forward_last(model, tokens[None], cache)
        if window and sampled:  # the prompt's tail is already in `recent`
            recent = mx.concatenate([recent, tokens[-1:].astype(mx.uint32)])[-window:]
        sub = None
        if not sampling.greedy:
            key, sub = mx.random.split(key)
        token = sampler(logits, recent, sub)
        logprob = logits[0, token[0]] - fastmath.logsumexp(logits[0])
        return token, logprob

    t0 = time.perf_counter()
    todo = mx.array(list(prompt_tokens[start:]), dtype=mx.uint32)
    while todo.size > prefill_step:
        with no_dropout(model, dropout):
            _prefill_only(model, todo[None, :prefill_step], cache)
        todo = todo[prefill_step:]
    times.prompt_tokens = len(prompt_tokens) - start
    y, logprob = step(todo, sampled=False)
    # the first token is read before the next step is queued: on the CPU backend async_eval
    # runs most of a queued step before it returns, which would delay the first token by one
    token = y.item()
    t1 = time.perf_counter()
    times.prompt_time = t1 - t0
    n = 0
    while True:
        if n + 1 < max_tokens:
            next_y, next_logprob = step(y, sampled=True)
            mx.async_eval(next_y, next_logprob)
        if n > 0:
            token = y.item()
            times.decode_tokens = n
            times.decode_time = time.perf_counter() - t1
        yield token, logprob.item()
        n += 1
        if n >= max_tokens:
            break
        if n % 256 == 0:
            mx.clear_cache()
        y, logprob = next_y, next_logprob


# --------------------------------------------------------------------------- detokenizing


class StreamingDetokenizer:
    """Token ids -> text increments that are always whole characters.

    Bytes go through an incremental UTF-8 decoder: a character split across tokens (emoji,
    accents in byte-level BPE) is held until its last byte arrives; invalid bytes become U+FFFD.
    With stop strings, text that could still be the start of one is held back too, and the
    stop string itself is never emitted.
    """

    def __init__(self, tokenizer: TokenizerLike, stop: Iterable[str] = ()):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""  # everything decoded so far (whole characters)
        self.emitted = 0  # len of the prefix of `text` already handed out
        self.stopped = False

    def add(self, token: int) -> str:
        """Feed one token; return the new text that is safe to show ("" if none yet)."""
        self.text += self._decoder.decode(self.tokenizer.decode_token_bytes(token))
        return self._release(final=False)

    def finish(self) -> str:
        """No more tokens: flush held-back text (an incomplete character becomes U+FFFD)."""
        if not self.stopped:
            self.text += self._decoder.decode(b"", final=True)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stopped:
            return ""
        pending = self.text[self.emitted:]
        if self.stop:
            hits = [(i, s) for s in self.stop if (i := pending.find(s)) >= 0]
            if hits:
                i = min(hits)[0]
                self.stopped = True
                self.emitted = len(self.text)
                return pending[:i]
            if not final:
                pending = pending[:len(pending) - held_back(pending, self.stop)]
        self.emitted += len(pending)
        return pending


def held_back(pending: str, markers: Iterable[str]) -> int:
    """Length of the longest suffix of `pending` that is a proper prefix of one of `markers`:
    text to hold until it is known whether a marker (a stop string) begins there."""
    best = 0
    for s in markers:
        for k in range(min(len(s) - 1, len(pending)), best, -1):
            if pending.endswith(s[:k]):
                best = k
                break
    return best


# --------------------------------------------------------------------------- public API


@dataclass
class GenerationStats:
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float  # decode steps after the first token

    def describe(self) -> str:
        return (f"prompt: {self.prompt_tokens} tokens, {self.prompt_tps:.1f} tokens/s | "
                f"generation: {self.generation_tokens} tokens, {self.generation_tps:.1f} tokens/s")


@dataclass
class GenerationChunk:
    """One generated token and the text it made visible.

    `text` may be "" (half a character, or possibly the start of a stop string). The last chunk
    has `finish_reason`: "stop" (an end-of-sequence token or a stop string; neither is in the
    text), "length" (max_tokens or the model's context) ; it also carries `stats`.
    """

    token: int
    text: str
    logprob: float | None = None
    finish_reason: str | None = None
    stats: GenerationStats | None = None


def check_prompt(model, prompt_tokens: Sequence[int], max_tokens: int) -> int:
    """Validate prompt and max_tokens against the context; -> max_tokens that fit."""
    if len(prompt_tokens) == 0:
        raise UserError("the prompt is empty: give at least one token of text")
    if max_tokens <= 0:
        raise UserError(f"max-tokens must be > 0, got {max_tokens}")
    ctx = getattr(getattr(model, "config", None), "context_length", None)
    if getattr(model, "sliding_window", False):  # slides past its context (models.tiny)
        ctx = None
    if ctx and len(prompt_tokens) >= ctx:
        raise UserError(f"the prompt is {len(prompt_tokens)} tokens but the model's context is "
                        f"{ctx}: shorten it (at least one position must be left to generate)")
    return min(max_tokens, ctx - len(prompt_tokens)) if ctx else max_tokens


def stream_generate(model, tokenizer: TokenizerLike, prompt_tokens: Sequence[int] | str, *,
                    max_tokens: int = 256, sampling: SamplingParams | None = None,
                    stop: Sequence[str] = (), cache: list | None = None,
                    prefill_step: int = PREFILL_STEP, **sampling_kw) -> Iterator[GenerationChunk]:
    """Yield a GenerationChunk per new token; the last one has `finish_reason` and `stats`.

    prompt_tokens: token ids (or a string, encoded with the tokenizer's defaults).
    sampling: a SamplingParams, or its fields as keywords (temp=, top_k=, top_p=, min_p=,
    repetition_penalty=, repetition_window=, seed=). Stops at any of `tokenizer.eos_ids`, at
    any of the `stop` strings, after `max_tokens`, or when the model's context is full.
    cache: a list of KVCache (see `make_cache`) that may already hold a prefix of the prompt.
    """
    if isinstance(prompt_tokens, str):
        prompt_tokens = tokenizer.encode(prompt_tokens)
    if sampling is None:
        sampling = SamplingParams(**sampling_kw)
    elif sampling_kw:
        raise TypeError("pass either sampling= or sampling keywords, not both")
    sampling.validate()
    budget = check_prompt(model, prompt_tokens, max_tokens)
    eos = set(tokenizer.eos_ids)
    detok = StreamingDetokenizer(tokenizer, stop)
    times = DecodeTimes()

    def stats(n: int) -> GenerationStats:
        return GenerationStats(
            prompt_tokens=times.prompt_tokens,
            prompt_tps=times.prompt_tokens / times.prompt_time if times.prompt_time else 0.0,
            generation_tokens=n,
            generation_tps=times.decode_tokens / times.decode_time if times.decode_time else 0.0)

    n = 0
    for token, logprob in generate_tokens(model, prompt_tokens, cache, sampling=sampling,
                                          max_tokens=budget, prefill_step=prefill_step,
                                          times=times):
        n += 1
        if token in eos:
            yield GenerationChunk(token, detok.finish(), logprob, "stop", stats(n))
            return
        text = detok.add(token)
        if detok.stopped:
            yield GenerationChunk(token, text, logprob, "stop", stats(n))
            return
        if n >= budget:
            yield GenerationChunk(token, text + detok.finish(), logprob, "length", stats(n))
            return
        yield GenerationChunk(token, text, logprob)


def generate(model, tokenizer: TokenizerLike, prompt_tokens: Sequence[int] | str, **kw) -> str:
    """The whole continuation as one string (same arguments as `stream_generate`)."""
    return "".join(chunk.text for chunk in stream_generate(model, tokenizer, prompt_tokens, **kw))


def encode_chat(tokenizer: TokenizerLike, messages: list[dict],
                add_generation_prompt: bool = True, **template_vars: Any) -> list[int]:
    """Render messages with the chat template (`template_vars` its further variables, e.g.
    `tools`) and tokenize (special tokens parsed)."""
    if not tokenizer.chat_template:
        raise UserError("this model has no chat template; use a plain prompt (without --chat)")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **template_vars)
    ids = tokenizer.encode(text, parse_special=True)
    bos = tokenizer.bos_id
    if bos is not None and len(ids) > 1 and ids[0] == bos and ids[1] == bos:
        ids = ids[1:]  # the template wrote BOS and the tokenizer added one too
    return ids


class ChatSession:
    """A conversation that keeps its KV cache between turns.

    Each turn renders the whole conversation with the chat template, finds the longest common
    token prefix with what the cache holds, trims the cache to it and prefills only the rest:
    the reply costs the new user message, not the history. Matching on token ids (not text)
    keeps it exact even when the reply re-tokenizes differently inside the template.
    """

    def __init__(self, model, tokenizer: TokenizerLike, system: str | None = None, *,
                 sampling: SamplingParams | None = None, max_tokens: int = 512,
                 stop: Sequence[str] = ()):
        self.model, self.tokenizer = model, tokenizer
        self.system = system
        self.sampling = (sampling or SamplingParams()).validate()
        self.max_tokens = max_tokens
        self.stop = list(stop)
        self.reset()

    def reset(self) -> None:
        self.messages: list[dict] = []
        if self.system:
            self.messages.append({"role": "system", "content": self.system})
        self.cache: list[KVCache] = make_cache(self.model)
        self._tokens: list[int] = []  # prompt + generated ids; the cache holds a prefix
        self.last_reused = 0  # prompt tokens served from the cache last turn
        self.last_stats: GenerationStats | None = None

    @property
    def cached_tokens(self) -> list[int]:
        return self._tokens[:cache_offset(self.cache)]

    def prompt_tokens(self, user: str) -> list[int]:
        return encode_chat(self.tokenizer, self.messages + [{"role": "user", "content": user}])

    def make_room(self, user: str, max_tokens: int, reserve: int = 64) -> tuple[int, int]:
        """Fit `user` and a reply of at least min(max_tokens, reserve) tokens into the model's
        context by forgetting the oldest user/assistant exchanges (the system message stays):
        -> (the reply's token budget, exchanges forgotten). A message that leaves no room for a
        reply even alone is refused (UserError) before anything is forgotten."""
        ctx = self.model.config.context_length
        first = 1 if self.messages and self.messages[0]["role"] == "system" else 0
        alone = encode_chat(self.tokenizer, self.messages[:first] + [{"role": "user", "content": user}])
        if len(alone) >= ctx:
            raise UserError(f"that message alone does not fit the model's context ({len(alone)} tokens of "
                            f"{ctx}); the conversation is kept")
        dropped = 0
        while len(self.prompt_tokens(user)) + min(max_tokens, reserve) > ctx and len(self.messages) - first >= 2:
            del self.messages[first:first + 2]
            dropped += 1
        return min(max_tokens, ctx - len(self.prompt_tokens(user))), dropped

    def send(self, user: str, **kw) -> Iterator[GenerationChunk]:
        """Stream the assistant's reply to `user`; the history is updated when it ends.

        Keywords override the session's max_tokens / stop / sampling for this turn.
        """
        if not user.strip():
            raise UserError("empty message")
        prompt = self.prompt_tokens(user)
        max_tokens = kw.pop("max_tokens", self.max_tokens)
        stop = kw.pop("stop", self.stop)
        sampling = kw.pop("sampling", None) or self.sampling
        if kw:
            sampling = replace(sampling, **kw)
        check_prompt(self.model, prompt, max_tokens)
        cached = self.cached_tokens
        common = 0
        limit = min(len(cached), len(prompt) - 1)  # at least one token must be read
        while common < limit and cached[common] == prompt[common]:
            common += 1
        trim_cache(self.cache, cache_offset(self.cache) - common)
        self.last_reused = common
        self._tokens = list(prompt)
        reply = []
        self.messages.append({"role": "user", "content": user})
        try:
            for chunk in stream_generate(self.model, self.tokenizer, prompt, max_tokens=max_tokens,
                                         sampling=sampling, stop=stop, cache=self.cache):
                self._tokens.append(chunk.token)
                reply.append(chunk.text)
                if chunk.stats is not None:
                    self.last_stats = chunk.stats
                yield chunk
        finally:
            # Also when the caller stops early: the history keeps what was shown.
            self.messages.append({"role": "assistant", "content": "".join(reply)})

    def say(self, user: str, **kw) -> str:
        return "".join(chunk.text for chunk in self.send(user, **kw))
