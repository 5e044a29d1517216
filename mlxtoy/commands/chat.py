"""`mlxtoy chat --model MODEL`: an interactive chat on the model's chat template.

Reads one user message per line from stdin (a terminal or a pipe) and streams each reply to
stdout, followed by a newline. The KV cache is kept between turns, so a turn reads only the
new message. Commands: `/reset` starts a new conversation, `/quit` (or end of input) leaves.
When the conversation outgrows the model's context, the oldest turns are dropped with a
warning on stderr; a message too long for the context even alone is refused with an `error:`
line, and the conversation goes on as it was. Per-turn stats (and how many tokens came from the
cache) go to stderr. Exit 0 when the input ends or on /quit, whatever was refused on the way.
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
        try:  # keep prompt + a useful reply inside the context: drop the oldest turns if needed
            max_tokens, dropped = session.make_room(message, args.max_tokens)
        except UserError as e:  # refused; the conversation so far is kept
            print(f"error: {e}", file=sys.stderr)
            continue
        for _ in range(dropped):
            print("warning: the conversation is longer than the context; dropped the oldest turn",
                  file=sys.stderr)
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
    return 0
