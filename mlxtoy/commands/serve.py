"""`mlxtoy serve MODEL [--adapter RUN ...]`: an OpenAI-compatible server on localhost.

POST /v1/chat/completions and /v1/completions (streamed with "stream": true), GET /v1/models
(the base and each adapter by name: a request's "model" picks one) and GET /health. Requests
join and leave one running batch between decode steps; requests for different adapters of the
base share it (the base's products computed once). MODEL is anything `generate` takes (a run
directory too: served as it trained); --adapter takes LoRA / DoRA runs of that base, RUN or
NAME=RUN (named after the folder by default), as many as wanted. Ctrl-C stops taking new
requests, lets the ones in flight finish (--drain-timeout) and exits; a second Ctrl-C exits at
once. Prints `serving on http://HOST:PORT` on stderr once it listens.

    mlxtoy serve runs/demo --port 8080
    curl localhost:8080/v1/completions -d '{"model": "demo", "prompt": "Hi", "max_tokens": 32}'
"""

from __future__ import annotations

import argparse
import sys

import uvicorn

from mlxtoy import backend
from mlxtoy.api import ServedModel, build_app
from mlxtoy.errors import UserError
from mlxtoy.inference import QUANTIZED_FLAG, load_for_serving


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("serve", help="an OpenAI-compatible server (continuous batching, many adapters)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default=None, metavar="MODEL",
                   help="a .gguf file, a Hugging Face folder or id, a built-in name or a run directory "
                        "(default: the first adapter's base)")
    p.add_argument("--adapter", action="append", default=[], metavar="RUN",
                   help="a LoRA/DoRA run of MODEL to serve alongside it, RUN or NAME=RUN (repeatable)")
    p.add_argument("--quantized", **QUANTIZED_FLAG)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8080, help="port to listen on (0: any free port)")
    p.add_argument("--max-tokens", type=int, default=512, metavar="N",
                   help="tokens generated when a request gives no max_tokens")
    p.add_argument("--max-batch", type=int, default=32, metavar="N", help="most rows decoded at once")
    p.add_argument("--prompt-cache-mb", type=int, default=256, metavar="MB",
                   help="memory for the K/V of prompts already read, reused by requests sharing a prefix (0: off)")
    p.add_argument("--drain-timeout", type=float, default=120.0, metavar="S",
                   help="on Ctrl-C, how long the requests in flight may take to finish")
    return p


class _Server(uvicorn.Server):
    """uvicorn's server, saying where it listens once it does (the port may be 0: any)."""

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        for server in self.servers:
            for sock in server.sockets:
                host, port = sock.getsockname()[:2]
                print(f"serving on http://{host}:{port}", file=sys.stderr, flush=True)


def run(args) -> int:
    for name, value, low in (("--port", args.port, 0), ("--max-tokens", args.max_tokens, 1),
                             ("--max-batch", args.max_batch, 1), ("--prompt-cache-mb", args.prompt_cache_mb, 0)):
        if value < low:
            raise UserError(f"{name} must be >= {low}, got {value}")
    if args.port > 65535:
        raise UserError(f"--port must be <= 65535, got {args.port}")
    if not args.model and not args.adapter:
        raise UserError("give a MODEL to serve, or --adapter RUN (its base is served)")
    model, tokenizer, names = load_for_serving(args.model, args.adapter, args.quantized)
    served = ServedModel(model, tokenizer, names, max_tokens=args.max_tokens, max_batch=args.max_batch,
                         prompt_cache_bytes=args.prompt_cache_mb * 2**20)
    print(f"models: {', '.join(names)}", file=sys.stderr)
    config = uvicorn.Config(build_app(served), host=args.host, port=args.port, log_level="warning",
                            timeout_graceful_shutdown=args.drain_timeout, lifespan="on")
    with backend.wired_limit(model):  # the weights stay resident while they serve
        try:
            _Server(config).run()
        except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it drained on: a clean stop
            pass
    print("stopped", file=sys.stderr)
    return 0
