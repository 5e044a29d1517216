"""The OpenAI-compatible HTTP API over the engine thread (`mlxtoy.serve`), on Starlette, with
server-sent events through sse-starlette (uvicorn runs it: `mlxtoy serve`).

    POST /v1/chat/completions   messages, rendered with the model's chat template
    POST /v1/completions        prompt: a string, a list of token ids, or a list of either
    GET  /v1/models             the base and each adapter, by name (/v1/models/NAME: one)
    GET  /health

Request fields: model (the base or an adapter), max_tokens (max_completion_tokens), temperature,
top_p, frequency_penalty, presence_penalty, logit_bias (and top_k, min_p, repetition_penalty, as other
servers take them), stop, seed, n, logprobs / top_logprobs, response_format (json_object, json_schema:
constrained decoding, `mlxtoy.constrain`), stream (+ stream_options.include_usage); for
chat tools and tool_choice (calls read from the reply, or forced, `mlxtoy.tool_calls`); for
completions echo too (with logprobs, the prompt's own tokens scored, and max_tokens 0 allowed:
how an evaluation harness asks for a continuation's log-likelihood). A bad
request gets a 4xx JSON error naming the field, in OpenAI's shape
{"error": {"message", "type", "param", "code"}}; the server goes on. A streaming client that
goes away cancels its rows (the batch frees their places at the next step). The fields are
checked in `mlxtoy.api_fields`.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator

from sse_starlette.sse import AppStatus, EventSourceResponse
from starlette.applications import Starlette
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse
from starlette.routing import Route

from mlxtoy.api_fields import (MAX_PROMPTS, APIError, number, parse_logit_bias, parse_prompts, parse_tools, stops,
                               text_content)
from mlxtoy.constrain import Grammars, schema_of
from mlxtoy.engine import Request, Token
from mlxtoy.errors import UserError
from mlxtoy.generate import StreamingDetokenizer, encode_chat
from mlxtoy.sampling import SamplingParams
from mlxtoy.serve import EngineThread, Job, PromptLogprobs
from mlxtoy.tool_calls import CallFormat, call_format
from mlxtoy.train.formats import check_messages

MAX_N = 16
MAX_TOP_LOGPROBS = 20
DISCONNECT_POLL = 0.25  # seconds between checks that a client waiting for a whole answer is there


@dataclass
class ServedModel:
    """What the API serves: the model and tokenizer, the names (the base first, then each
    adapter; adapter i is slot i + 1) and the defaults for fields a request leaves out."""

    model: Any
    tokenizer: Any
    names: list[str]
    max_tokens: int = 512
    max_batch: int = 32
    prompt_cache_bytes: int = 256 * 2**20


@dataclass
class Parsed:
    prompts: list[list[int]]
    echoes: list[str]  # each prompt's text, for echo
    adapter: int
    model_name: str
    max_tokens: int
    sampling: SamplingParams
    stop: list[str]
    n: int
    top_logprobs: int
    logprobs: bool
    grammar: str | None
    stream: bool
    include_usage: bool
    echo: bool = False
    tool_calls: CallFormat | None = None  # the form the output is read for tool calls in
    logit_bias: dict[int, float] | None = None

    @property
    def choices(self) -> int:
        return len(self.prompts) * self.n

    @property
    def score(self) -> bool:
        """The prompts' own tokens are scored (echo with logprobs)."""
        return self.echo and self.logprobs


@dataclass
class Event:
    """What a choice gets next (`API.events`)."""

    choice: int
    text: str
    tokens: list[Token]
    finish: str | None
    echo: bool = False  # its prompt's text (and tokens, scored), echoed


class API:
    def __init__(self, served: ServedModel):
        self.served = served
        self.engine: EngineThread | None = None
        self.grammars: Grammars | None = None
        self.created = int(time.time())
        vocab = served.model.config.vocab_size
        self.vocab_size = vocab
        self.context = served.model.config.context_length

    # ------------------------------------------------------------------ parsing

    def parse(self, body: Any, chat: bool) -> Parsed:
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        names = self.served.names
        name = body.get("model") or names[0]
        if name not in names:
            raise APIError(404, f"the model {name!r} does not exist here; GET /v1/models lists "
                                f"{', '.join(names)}", "model", "model_not_found")
        tok = self.served.tokenizer
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
                raise APIError(400, "messages must be a non-empty list of {role, content} objects", "messages")
            # (content as text parts joined; then the trainer's check: a string, or null beside tool_calls)
            messages = [dict(m, content=text_content(m.get("content", ""))) for m in messages]
            try:
                messages = check_messages(messages, "messages")
                tools, forced = parse_tools(body)
                prompt = encode_chat(tok, messages, **({"tools": tools} if tools else {}))
            except UserError as e:
                raise APIError(400, str(e), "messages") from None
            if tools and prompt == encode_chat(tok, messages):
                raise APIError(400, "this model's chat template shows the model no tools", "tools")
            calls = call_format(tok.chat_template) if tools else None
            if forced and not calls:
                raise APIError(400, "tool_choice: forcing a call needs a chat template that writes calls in a "
                                    "form read here (<tool_call> blocks, or Llama 3's JSON)", "tool_choice")
            prompts, echoes, where = [prompt], [""], "messages"
            echo = False
        else:
            prompts, echoes = parse_prompts(body.get("prompt"), tok, self.vocab_size)
            where, calls, forced = "prompt", None, None
            echo = body.get("echo") or False
            if not isinstance(echo, bool):
                raise APIError(400, "echo must be true or false", "echo")
        for k, prompt in enumerate(prompts):
            which = where if len(prompts) == 1 else f"{where}[{k}]"
            if not prompt:
                raise APIError(400, f"{which} encodes to no tokens", where)
            if len(prompt) >= self.context:
                raise APIError(400, f"{which} is {len(prompt)} tokens; the model's context is {self.context} "
                                    f"(at least one position must be left to generate)", where,
                               "context_length_exceeded")
        key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        # 0: the prompt echoed (and scored) only
        max_tokens = number(body, key, self.served.max_tokens, lo=0 if echo else 1, integer=True)
        temp = number(body, "temperature", 1.0, lo=0.0, hi=2.0)
        top_p = number(body, "top_p", 1.0, lo=0.0, hi=1.0)
        if top_p == 0:
            raise APIError(400, "top_p must be > 0", "top_p")
        penalties = {name: float(number(body, name, 0.0, lo=-2.0, hi=2.0))
                     for name in ("frequency_penalty", "presence_penalty")}
        # beyond OpenAI's fields, as mlx-lm's, vLLM's and llama.cpp's servers take them
        top_k = number(body, "top_k", 0, lo=0, integer=True)
        min_p = number(body, "min_p", 0.0, lo=0.0, hi=0.999)
        repetition = number(body, "repetition_penalty", 1.0, lo=0.01, hi=10.0)
        bias = parse_logit_bias(body.get("logit_bias"), self.vocab_size)
        seed = number(body, "seed", None, integer=True)
        seed = None if seed is None else seed % 2**32  # any integer, as OpenAI takes
        n = number(body, "n", 1, lo=1, hi=MAX_N, integer=True)
        if len(prompts) * n > MAX_PROMPTS:
            raise APIError(400, f"{len(prompts)} prompts x n {n} make more than {MAX_PROMPTS} choices", "n")
        if chat:
            logprobs = body.get("logprobs") or False
            if not isinstance(logprobs, bool):
                raise APIError(400, "logprobs must be true or false", "logprobs")
            top = number(body, "top_logprobs", 0, lo=0, hi=MAX_TOP_LOGPROBS, integer=True)
            if top and not logprobs:
                raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        else:
            top = number(body, "logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS, integer=True)
            logprobs = top is not None
            top = top or 0
        try:
            schema = schema_of(body.get("response_format"))
        except UserError as e:
            raise APIError(400, str(e), "response_format") from None
        grammar = None
        if schema is not None or forced:
            if schema is not None and forced:
                raise APIError(400, "response_format and a forced tool call cannot both shape the reply", "tool_choice")
            if self.grammars is None:
                self.grammars = Grammars(tok, self.vocab_size)
            try:
                grammar = (self.grammars.json_schema(schema) if schema is not None else
                           self.grammars.lark(calls.grammar(tools, None if forced is True else forced),
                                              "the tools' parameters"))
            except UserError as e:
                raise APIError(400, str(e), "response_format" if schema is not None else "tools") from None
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise APIError(400, "stream must be true or false", "stream")
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise APIError(400, "stream_options must be an object", "stream_options")
        return Parsed(prompts, echoes, names.index(name), name, max_tokens,
                      SamplingParams(temp=float(temp), top_p=float(top_p), top_k=top_k, min_p=float(min_p),
                                     repetition_penalty=float(repetition), seed=seed, **penalties), stops(body), n, top,
                      logprobs, grammar, stream, bool(options.get("include_usage")), echo, calls, bias)

    # ------------------------------------------------------------------ running

    def submit(self, p: Parsed) -> Job:
        tok = self.served.tokenizer
        requests = [Request(prompt, min(p.max_tokens, self.context - len(prompt)), p.sampling,
                            frozenset(tok.eos_ids), p.adapter, p.top_logprobs, logprobs=p.logprobs,
                            logit_bias=p.logit_bias, score_prompt=p.score)
                    for prompt in p.prompts]
        grammars, grammar = self.grammars, p.grammar
        make = (lambda: grammars.constraint(grammar)) if grammar is not None else None
        job = Job(requests, p.n, asyncio.get_running_loop(), asyncio.Queue(), make)
        self.engine.submit(job)
        return job

    async def events(self, job: Job, p: Parsed, client: HTTPRequest | None = None
                     ) -> AsyncIterator[Event]:
        """Each choice's new text and tokens as they arrive, with its finish reason; the stop
        strings and end-of-sequence handled here. With echo, each choice's first event is its
        prompt's text (with its scored tokens, the first without a log-probability, where logprobs
        are asked for). Every row is cancelled if the consumer stops, or if `client` (a request
        answered in one piece) disconnects: it is asked every DISCONNECT_POLL seconds (a
        stream's disconnect cancels its consumer instead)."""
        tok = self.served.tokenizer
        detoks = [StreamingDetokenizer(tok, p.stop) for _ in range(p.choices)]
        open_choices = set(range(p.choices)) if p.max_tokens else set()
        unscored = set(range(len(p.prompts))) if p.score else set()
        if p.echo and not p.score:
            for i in range(p.choices):
                yield Event(i, p.echoes[i // p.n], [], None, echo=True)
        polled = time.monotonic()
        try:
            while open_choices or unscored:
                if client is None:  # (a stream: no polling, no timer a token)
                    item = await job.queue.get()
                else:
                    try:
                        item = await asyncio.wait_for(job.queue.get(), DISCONNECT_POLL)
                    except asyncio.TimeoutError:
                        item = (-1, None)
                if client is not None and time.monotonic() - polled >= DISCONNECT_POLL:
                    polled = time.monotonic()
                    if await client.is_disconnected():
                        return
                if isinstance(item, PromptLogprobs):
                    k = item.prompt
                    unscored.discard(k)
                    tokens = [Token(p.prompts[k][0], None)] + item.tokens
                    for i in range(k * p.n, (k + 1) * p.n):
                        yield Event(i, p.echoes[k], tokens, None if p.max_tokens else "length", echo=True)
                    continue
                i, token = item
                if i == -1:
                    continue
                if i is None:
                    raise APIError(500, token)
                if i not in open_choices:
                    continue
                d = detoks[i]
                finish = token.finish
                if finish == "stop":  # an end-of-sequence token: not part of the text
                    text = d.finish()
                else:
                    text = d.add(token.token)
                    if d.stopped:
                        finish = "stop"
                        job.cancel(i)
                    elif finish == "length":
                        text += d.finish()
                if finish is not None:
                    open_choices.discard(i)
                yield Event(i, text, [token], finish)
        finally:
            if open_choices:
                job.cancel()

    def token_text(self, token: int) -> tuple[str, list[int]]:
        raw = self.served.tokenizer.decode_token_bytes(token)
        return raw.decode("utf-8", errors="replace"), list(raw)

    def chat_logprobs(self, token: Token) -> dict:
        text, raw = self.token_text(token.token)
        top = [dict(zip(("token", "bytes"), self.token_text(t)), logprob=lp) for t, lp in (token.top or [])]
        return {"token": text, "logprob": token.logprob, "bytes": raw, "top_logprobs": top}

    def completion_logprobs(self, tokens: list[Token], offset: int) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t in tokens:
            text = self.token_text(t.token)[0]
            out["tokens"].append(text)
            out["token_logprobs"].append(t.logprob)
            # (a prompt's first token, echoed: no log-probability, no alternatives)
            out["top_logprobs"].append(None if t.logprob is None else {self.token_text(a)[0]: lp for a, lp in (t.top or [])})
            out["text_offset"].append(offset)
            offset += len(text)
        return out

    # ------------------------------------------------------------------ endpoints

    async def completions(self, request: HTTPRequest, chat: bool):
        try:
            try:
                body = await request.json()
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise APIError(400, f"the request body is not valid JSON: {e}") from None
            p = self.parse(body, chat)
        except APIError as e:
            return e.response()
        job = self.submit(p)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": p.model_name}
        if p.stream:
            return EventSourceResponse(self.stream(job, p, chat, head), ping=0, sep="\n")
        try:
            return JSONResponse(await self.whole(job, p, chat, head, request))
        except APIError as e:
            return e.response()

    async def whole(self, job: Job, p: Parsed, chat: bool, head: dict, client: HTTPRequest) -> dict:
        texts, tokens = [""] * p.choices, [[] for _ in range(p.choices)]
        finishes = [None if p.max_tokens else "length"] * p.choices
        generated = 0
        async for e in self.events(job, p, client):
            texts[e.choice] += e.text
            tokens[e.choice] += e.tokens
            generated += 0 if e.echo else len(e.tokens)
            finishes[e.choice] = e.finish or finishes[e.choice]
        choices = []
        for i in range(p.choices):
            if chat:
                message: dict[str, Any] = {"role": "assistant", "content": texts[i]}
                calls = []
                if p.tool_calls:
                    message["content"], calls = p.tool_calls.read(texts[i])
                    if calls:
                        message["tool_calls"] = calls
                c = {"index": i, "message": message,
                     "logprobs": {"content": [self.chat_logprobs(t) for t in tokens[i]]} if p.logprobs else None,
                     "finish_reason": "tool_calls" if calls and finishes[i] == "stop" else finishes[i]}
            else:
                c = {"index": i, "text": texts[i], "finish_reason": finishes[i],
                     "logprobs": self.completion_logprobs(tokens[i], 0) if p.logprobs else None}
            choices.append(c)
        return dict(head, object="chat.completion" if chat else "text_completion", choices=choices,
                    usage=self.usage(p, generated, job))

    def usage(self, p: Parsed, generated: int, job: Job) -> dict:
        # (a prompt's choices all read its one prefill)
        cached = sum(row.cached_tokens for row in job.rows[::p.n])
        prompt = sum(len(t) for t in p.prompts)
        return {"prompt_tokens": prompt, "completion_tokens": generated,
                "total_tokens": prompt + generated, "prompt_tokens_details": {"cached_tokens": cached}}

    async def stream(self, job: Job, p: Parsed, chat: bool, head: dict) -> AsyncIterator[str]:
        generated = 0
        offsets = [0] * p.choices
        try:
            if chat:
                for i in range(p.choices):
                    yield json.dumps(dict(head, choices=[{"index": i, "delta": {"role": "assistant", "content": ""},
                                                          "logprobs": None, "finish_reason": None}]))
            readers = [p.tool_calls.reader() for _ in range(p.choices)] if p.tool_calls else None
            async for e in self.events(job, p):
                generated += 0 if e.echo else len(e.tokens)
                if chat:
                    delta: dict[str, Any] = {"content": e.text} if e.text or e.finish is None else {}
                    finish = e.finish
                    if readers is not None:  # the text outside calls; each call once it is read
                        reader = readers[e.choice]
                        done = len(reader.calls)
                        text = reader.add(e.text)[0] + (reader.finish() if e.finish else "")
                        calls = reader.calls[done:]
                        delta = {"content": text} if text else {}
                        if calls:
                            delta["tool_calls"] = [dict(call, index=done + k) for k, call in enumerate(calls)]
                        if finish == "stop" and reader.calls:
                            finish = "tool_calls"
                    choice = {"index": e.choice, "delta": delta,
                              "logprobs": {"content": [self.chat_logprobs(t) for t in e.tokens]} if p.logprobs else None,
                              "finish_reason": finish}
                else:
                    choice = {"index": e.choice, "text": e.text, "finish_reason": e.finish,
                              "logprobs": self.completion_logprobs(e.tokens, offsets[e.choice]) if p.logprobs else None}
                    offsets[e.choice] += len(e.text)
                chunk = dict(head, choices=[choice])
                if p.include_usage:
                    chunk["usage"] = None
                yield json.dumps(chunk)
            if p.include_usage:
                yield json.dumps(dict(head, choices=[], usage=self.usage(p, generated, job)))
        except APIError as e:
            yield json.dumps({"error": {"message": e.message, "type": "server_error", "param": None, "code": None}})
        yield "[DONE]"

    def model_card(self, name: str) -> dict:
        names = self.served.names
        return {"id": name, "object": "model", "created": self.created, "owned_by": "mlxtoy",
                "parent": None if name == names[0] else names[0]}

    async def models(self, request: HTTPRequest):
        return JSONResponse({"object": "list", "data": [self.model_card(n) for n in self.served.names]})

    async def model(self, request: HTTPRequest):
        name = request.path_params["name"]
        if name not in self.served.names:
            return APIError(404, f"the model {name!r} does not exist here; GET /v1/models lists "
                                 f"{', '.join(self.served.names)}", "model", "model_not_found").response()
        return JSONResponse(self.model_card(name))

    async def health(self, request: HTTPRequest):
        engine = self.engine
        return JSONResponse({"status": "ok", "rows": engine.active_rows if engine else 0,
                             "peak_rows": engine.peak_rows if engine else 0,
                             "cancelled_rows": engine.cancelled_rows if engine else 0})


def build_app(served: ServedModel) -> Starlette:
    """The ASGI app; its lifespan starts the engine thread and, on shutdown (after uvicorn has
    drained the open requests), lets it finish and stop."""
    api = API(served)

    @asynccontextmanager
    async def lifespan(app):
        # streams are drained by uvicorn's graceful shutdown, not cut by sse-starlette
        AppStatus.disable_automatic_graceful_drain()
        api.engine = EngineThread(served.model, max_batch=served.max_batch,
                                  prompt_cache_bytes=served.prompt_cache_bytes)
        try:
            yield
        finally:
            api.engine.close()

    async def chat(request):
        return await api.completions(request, chat=True)

    async def completions(request):
        return await api.completions(request, chat=False)

    app = Starlette(routes=[
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/chat/completions", chat, methods=["POST"]),
        Route("/completions", completions, methods=["POST"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/v1/models/{name:path}", api.model, methods=["GET"]),
        Route("/health", api.health, methods=["GET"]),
    ], lifespan=lifespan)
    app.state.api = api
    return app
