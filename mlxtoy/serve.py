"""Serving: the engine thread that runs the batched decoder (`mlxtoy.engine`) for the HTTP
front end (`mlxtoy.api`), and the jobs that carry a request's tokens back to it.

One thread owns the model and the decoder. Handlers (on the asyncio loop) `submit` a `Job`;
between decode steps the thread moves waiting jobs into the batch (up to `max_batch` rows),
runs one step and hands each row's token to its job, which passes it to the handler's loop
(`call_soon_threadsafe`). A handler that no longer wants a choice (a stop string seen, the
client gone) cancels it: the row leaves the batch at the next step, freeing its place.
`close()` lets the rows in flight finish, then ends the thread (uvicorn drains the open
requests on Ctrl-C before the app's shutdown calls it).
"""

from __future__ import annotations

import asyncio
import sys
import threading
import traceback
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from mlxtoy import backend
from mlxtoy.engine import BatchDecoder, Request, Row, Token
from mlxtoy.prompt_cache import PromptCache


@dataclass
class Job:
    """One API request: `n` choices of each of its prompts (`requests`, one each), each a row;
    choice k * n + j is prompt k's j-th, as OpenAI numbers them. Events go to `queue` on `loop`
    as (choice index, Token), (None, error message) on an internal failure."""

    requests: list[Request]
    n: int
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    make_constraint: Callable[[], Any] | None = None  # a fresh constraint per choice
    rows: list[Row] = field(default_factory=list)
    cancelled: set[int] = field(default_factory=set)

    @property
    def choices(self) -> int:
        return len(self.requests) * self.n

    @property
    def score(self) -> bool:
        """Each prompt's own tokens are scored by the prefill that reads them (its requests'
        `score_prompt`) and sent as a PromptLogprobs; with max_tokens 0 that is all the job does
        (`BatchDecoder.score_many`): OpenAI's echo with logprobs."""
        return self.requests[0].score_prompt

    @property
    def rows_wanted(self) -> int:
        """The places it takes in the batch: none for a job that only scores its prompts."""
        return self.choices if self.requests[0].max_tokens > 0 else 0

    def send(self, item: tuple) -> None:
        deliver(self.loop, [(self, item)])

    def cancel(self, index: int | None = None) -> None:
        """Stop choice `index` (every choice: None). Safe from any thread: rows read the flag
        on the engine thread before each step."""
        self.cancelled.update(range(self.choices) if index is None else [index])
        for i, row in enumerate(self.rows):
            if i in self.cancelled:
                row.cancelled = True


@dataclass
class PromptLogprobs:
    """Prompt `prompt`'s tokens after the first, each with its log-probability (`Job.score`)."""

    prompt: int
    tokens: list[Token]


def deliver(loop: asyncio.AbstractEventLoop, items: list[tuple[Job, tuple]]) -> None:
    """Put each (job, event) into its job's queue, on `loop` (its thread): one wakeup of the
    loop for all of them (a decode step's tokens for every stream), where one each would wake
    it once per stream and take that much more CPU from the decoding threads."""
    def put() -> None:
        for job, item in items:
            job.queue.put_nowait(item)
    try:
        loop.call_soon_threadsafe(put)
    except RuntimeError:  # the loop is closed: nobody is listening any more
        pass


class EngineThread:
    def __init__(self, model, *, max_batch: int = 32, prompt_cache_bytes: int = 0):
        cache = PromptCache(prompt_cache_bytes) if prompt_cache_bytes > 0 else None
        self.decoder = BatchDecoder(model, prompt_cache=cache)
        self.max_batch = max_batch
        self.waiting: list[Job] = []
        self.owner: dict[int, tuple[Job, int]] = {}  # id(row) -> (job, choice index)
        self.wake = threading.Condition()
        self.stopping = False
        self.cancelled_rows = 0  # rows that left before their end (a stop string, a client gone)
        self.peak_rows = 0  # the most rows decoded together so far
        # its own MLX stream: a stream belongs to the thread that made it (backend.thread_stream)
        self.thread = threading.Thread(target=backend.with_thread_stream(self.run), name="mlxtoy-engine",
                                       daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> None:
        with self.wake:
            self.waiting.append(job)
            self.wake.notify()

    def close(self, timeout: float | None = None) -> None:
        with self.wake:
            self.stopping = True
            self.wake.notify()
        self.thread.join(timeout)

    @property
    def active_rows(self) -> int:
        return len(self.decoder.rows)

    def run(self) -> None:
        try:
            self.serve()
        finally:
            self.decoder.release()

    def serve(self) -> None:
        while True:
            with self.wake:
                while not self.waiting and not self.decoder.rows and not self.stopping:
                    self.wake.wait()
                if self.stopping and not self.waiting and not self.decoder.rows:
                    return
                room = self.max_batch - len(self.decoder.rows)
                start = []
                while self.waiting and (room >= self.waiting[0].rows_wanted or not self.decoder.rows):
                    job = self.waiting.pop(0)
                    room -= job.rows_wanted
                    start.append(job)
            try:
                self.start(start)
                if self.decoder.rows:
                    self.step()
            except Exception:  # an internal error: fail what is in flight, keep serving
                traceback.print_exc(file=sys.stderr)
                for job, _ in {id(j): (j, 0) for j, _ in self.owner.values()}.values():
                    job.send((None, "internal error while decoding"))
                for job in start:
                    job.send((None, "internal error while decoding"))
                self.owner.clear()
                self.decoder.remove([])

    def start(self, jobs: list[Job]) -> None:
        """Every choice of these jobs joins the batch, their prompts prefilled together."""
        items, owners = [], []  # (request, copies) for the decoder; (job, first choice) of each
        for job in jobs:
            if len(job.cancelled) == job.choices:
                continue
            if not job.rows_wanted:  # max_tokens 0: the prompts echoed, scored where asked, only
                shared = job.requests[0]  # (a job's prompts share the adapter and the top count)
                if job.score:
                    scores = self.decoder.score_many([r.prompt for r in job.requests], shared.adapter,
                                                     shared.top_logprobs)
                    for k, tokens in enumerate(scores):
                        job.send(PromptLogprobs(k, tokens))
                continue
            try:
                for request in job.requests:
                    self.decoder.budget(request)
            except ValueError as e:  # checked before submitting; a last guard
                job.send((None, str(e)))
                continue
            for k, request in enumerate(job.requests):
                if job.make_constraint is None:
                    items.append((request, job.n))
                    owners.append((job, k * job.n))
                    continue
                seed = request.sampling.seed
                for j in range(job.n):  # each choice matches on its own
                    items.append((replace(request, constraint=job.make_constraint(),
                                          sampling=replace(request.sampling, seed=None if seed is None else seed + j)), 1))
                    owners.append((job, k * job.n + j))
        for (job, first), rows in zip(owners, self.decoder.add_many(items)):
            job.rows += rows
            for i, row in enumerate(rows, start=first):
                self.owner[id(row)] = (job, i)
                row.cancelled = i in job.cancelled
            if job.score and first % job.n == 0:  # the prompt's scores, read by its prefill
                job.send(PromptLogprobs(first // job.n, rows[0].prompt_scores or []))

    def step(self) -> None:
        self.cancelled_rows += sum(r.cancelled for r in self.decoder.rows)
        self.peak_rows = max(self.peak_rows, sum(not r.cancelled for r in self.decoder.rows))
        events: list[tuple[Row, Token]] = self.decoder.step()
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Job, tuple]]] = {}
        for row, token in events:
            job, i = self.owner[id(row)]
            by_loop.setdefault(job.loop, []).append((job, (i, token)))
        for loop, items in by_loop.items():
            deliver(loop, items)
        live = {id(r) for r in self.decoder.rows}
        for key in [k for k in self.owner if k not in live]:
            del self.owner[key]
