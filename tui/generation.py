"""Generation in the UI process: one thread owns every MLX call.

MLX streams belong to a thread (since 0.31.2): a stream made in one thread cannot run work
queued from another. So model loading, token generation and exports all run on a single
executor thread, every job on that thread's own stream (`backend.with_thread_stream`, the one
helper every thread that runs MLX work uses). The event loop only awaits futures and receives
text through `loop.call_soon_threadsafe`, so it never blocks.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import mlxtoy  # noqa: F401  (fast BLAS before mlx.core)

from mlxtoy import backend
from mlxtoy.generate import ChatSession, stream_generate
from mlxtoy.inference import GENERATE_FIXES, load_for_inference
from mlxtoy.models.quant import describe_quantized
from mlxtoy.sampling import SamplingParams


class MLXThread:
    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlx")

    def submit(self, fn: Callable[..., Any], *args, **kw) -> Future:
        return self._pool.submit(backend.with_thread_stream(fn), *args, **kw)

    async def run(self, fn: Callable[..., Any], *args, **kw) -> Any:
        return await asyncio.wrap_future(self.submit(fn, *args, **kw))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


@dataclass
class Source:
    """What to talk to: a base model, or a run (its final weights or newest checkpoint),
    or one checkpoint folder of a run."""

    label: str
    model: str  # the base model (or tokenizer source)
    adapter: str | None = None  # a run folder or a checkpoints/step_N folder

    @property
    def key(self) -> tuple[str, str | None]:
        return (self.model, self.adapter)


class Generator:
    """The loaded model and a chat session; every method runs on the MLX thread."""

    def __init__(self) -> None:
        self.key: tuple[str, str | None] | None = None
        self.model = None
        self.tokenizer = None
        self.session = None
        self.description = ""

    def load(self, source: Source) -> str:
        if self.key == source.key and self.model is not None:
            return self.description
        self.model = self.tokenizer = self.session = None
        # the decision `mlxtoy generate` takes: a QLoRA run's base stays quantized, adapters unmerged
        model, tokenizer = load_for_inference(source.model, source.adapter)
        self.model, self.tokenizer, self.key = model, tokenizer, source.key
        self.description = describe(source, model)
        return self.description

    @property
    def has_chat_template(self) -> bool:
        return self.tokenizer is not None and bool(self.tokenizer.chat_template)

    def reset(self) -> None:
        self.session = None

    def generate(self, prompt: str, chat: bool, params: dict[str, Any], on_text: Callable[[str], None],
                 cancel: threading.Event) -> str:
        """Stream a reply (chat) or a continuation; -> a one-line stats summary."""
        sampling = SamplingParams(temp=params["temp"], top_p=params["top_p"])
        max_tokens = params["max_tokens"]
        if chat and self.has_chat_template:
            if self.session is None:
                self.session = ChatSession(self.model, self.tokenizer, sampling=sampling, max_tokens=max_tokens)
            chunks = self.session.send(prompt, max_tokens=max_tokens, sampling=sampling)
        else:
            chunks = stream_generate(self.model, self.tokenizer, self.tokenizer.encode(prompt),
                                     max_tokens=max_tokens, sampling=sampling)
        stats = ""
        warnings: list[str] = []  # the wired limit's, shown with the stats (stderr is the screen)
        try:
            with backend.model_memory(self.model, "generating", GENERATE_FIXES, warn=warnings.append):
                for chunk in chunks:
                    if chunk.text:
                        on_text(chunk.text)
                    if chunk.stats is not None:
                        stats = chunk.stats.describe() + f" ({chunk.finish_reason})"
                    if cancel.is_set():
                        stats = stats or "stopped"
                        break
        finally:
            close = getattr(chunks, "close", None)
            if close:
                close()  # ends the generator so ChatSession records the partial reply
        return "; ".join(warnings + [stats]) if warnings else stats


def describe(source: Source, model) -> str:
    """One line for the status bar: what is loaded, and how its base is kept."""
    cfg = model.config
    where = getattr(model, "run_source", None) or source.model
    kept = ", ".join(f"{n} {layout}" for layout, n in describe_quantized(model).items())
    base = f", quantized base ({kept})" if kept else ""
    return f"{source.label}: {cfg.arch}, {cfg.n_layers} layers, d_model {cfg.d_model}{base} ({where})"
