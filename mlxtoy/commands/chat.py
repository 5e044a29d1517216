"""`mlxtoy chat --model MODEL`: an interactive chat on the model's chat template.

Reads one user message per line from stdin (a terminal or a pipe) and streams each reply to
stdout, followed by a newline. The KV cache is kept between turns, so a turn reads only the
new message. Commands: `/reset` starts a new conversation, `/quit` (or end of input) leaves.
When the conversation outgrows the model's context, the oldest turns are dropped with a
warning on stderr. Per-turn stats (and how many tokens came from the cache) go to stderr.
"""

from __future__ import annotations

import argparse
import sys

from mlxtoy import backend
from mlxtoy.commands.generate import add_sampling_args, sampling_from_args
from mlxtoy.errors import UserError
from mlxtoy.generate import ChatSession
from mlxtoy.inference import GENERATE_FIXES, load_for_inference


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("chat", help="interactive chat with the model's chat template",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sampling_args(p, max_tokens=512)
    p.add_argument("--quiet", action="store_true", help="no per-turn stats on stderr")
    return p


def _drop_oldest_turn(session) -> bool:
    """Forget the oldest user/assistant exchange (the system message stays)."""
    msgs = session.messages
    first = 1 if msgs and msgs[0]["role"] == "system" else 0
    if len(msgs) - first < 2:
        return False
    del msgs[first:first + 2]
    return True


def run(args) -> int:
    sampling = sampling_from_args(args)
    model, tokenizer = load_for_inference(args.model, args.adapter, args.quantized)
    if not tokenizer.chat_template:
        raise UserError(f"{args.model}: the model has no chat template; use `mlxtoy generate`")
    session = ChatSession(model, tokenizer, system=args.system, sampling=sampling,
                          max_tokens=args.max_tokens, stop=args.stop)
    interactive = sys.stdin.isatty()
    if interactive:
        print("chat: /reset for a new conversation, /quit to leave", file=sys.stderr)
    ctx = model.config.context_length
    refused = 0  # messages that could not be answered: the exit code says so
    while True:
        if interactive:
            print(">>> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line:
            break
        message = line.strip()
        if not message:
            continue
        if message in ("/quit", "/exit"):
            break
        if message == "/reset":
            session.reset()
            print("(conversation reset)", file=sys.stderr)
            continue
        if message.startswith("/") and " " not in message:
            print(f"unknown command {message} (try /reset or /quit)", file=sys.stderr)
            continue
        # Keep prompt + a useful reply inside the context: drop the oldest turns if needed.
        while len(session.prompt_tokens(message)) + min(args.max_tokens, 64) > ctx:
            if not _drop_oldest_turn(session):
                break
            print("warning: the conversation is longer than the context; dropped the oldest turn",
                  file=sys.stderr)
        max_tokens = min(args.max_tokens, ctx - len(session.prompt_tokens(message)))
        if max_tokens <= 0:
            print(f"error: that message alone does not fit the model's context ({ctx} tokens)",
                  file=sys.stderr)
            refused += 1
            continue
        with backend.model_memory(model, "generating", GENERATE_FIXES):
            for chunk in session.send(message, max_tokens=max_tokens):
                if chunk.text:
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
        sys.stdout.write("\n")
        sys.stdout.flush()
        if not args.quiet and session.last_stats is not None:
            print(f"[{session.last_stats.describe()} | reused {session.last_reused} cached tokens]",
                  file=sys.stderr)
    return 2 if refused else 0
