"""`mlxtoy generate --model MODEL --prompt TEXT [...]`: stream a continuation to stdout.

Stdout carries only the generated text (a final newline is added only when stdout is a
terminal); load messages and stats (prompt and decode tokens/s) go to stderr. Sampling
defaults to greedy (--temp 0), so the same command prints the same text; with --temp > 0,
--seed makes it reproducible.
"""

from __future__ import annotations

import argparse
import sys

from mlxtoy import backend
from mlxtoy.errors import UserError
from mlxtoy.generate import encode_chat, stream_generate
from mlxtoy.inference import GENERATE_FIXES, QUANTIZED_FLAG, load_for_inference
from mlxtoy.io.registry import DEFAULT_MODEL
from mlxtoy.sampling import SamplingParams


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    """Model and sampling flags shared by `generate` and `chat`, in a group each."""
    model = p.add_argument_group("model")
    model.add_argument("--model",
                       help="a .gguf file, a Hugging Face folder or id (org/name[@rev], org/name/file.gguf), "
                            f"or a built-in name (default: the run's own base with --adapter, else {DEFAULT_MODEL})")
    model.add_argument("--adapter", metavar="RUN", help="a training run directory to apply")
    model.add_argument("--quantized", **QUANTIZED_FLAG)
    model.add_argument("--system", metavar="S", help="system message for the chat template")
    sampling = p.add_argument_group("sampling")
    sampling.add_argument("--max-tokens", type=int, default=max_tokens, metavar="N",
                          help=f"most tokens to generate (default {max_tokens}); clipped to the context")
    sampling.add_argument("--temp", type=float, default=0.0, metavar="T",
                          help="temperature; 0 = greedy (default)")
    sampling.add_argument("--top-k", type=int, default=0, metavar="K", help="keep the K most likely (0 = off)")
    sampling.add_argument("--top-p", type=float, default=1.0, metavar="P",
                          help="nucleus sampling, in (0, 1] (1 = off)")
    sampling.add_argument("--min-p", type=float, default=0.0, metavar="P",
                          help="drop tokens below P x the top probability (0 = off)")
    sampling.add_argument("--repetition-penalty", type=float, default=1.0, metavar="R",
                          help="penalize tokens seen in the last --repetition-window tokens (1 = off)")
    sampling.add_argument("--repetition-window", type=int, default=64, metavar="N",
                          help="how many recent tokens, prompt included, the penalty sees (default 64)")
    sampling.add_argument("--seed", type=int, default=None, metavar="S", help="seed for sampling")
    sampling.add_argument("--stop", nargs="+", action="extend", default=[], metavar="STR",
                          help="stop when the text contains any of these (not printed)")


def sampling_from_args(args):
    if args.max_tokens <= 0:
        raise UserError(f"--max-tokens must be > 0, got {args.max_tokens}")
    return SamplingParams(temp=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                          repetition_penalty=args.repetition_penalty,
                          repetition_window=args.repetition_window, seed=args.seed).validate()


def clip_max_tokens(model, n_prompt: int, max_tokens: int) -> int:
    """Visible truncation: max_tokens beyond the context is clipped, with a warning."""
    ctx = model.config.context_length
    if getattr(model, "sliding_window", False):  # slides past its context (models.tiny)
        return max_tokens
    if n_prompt < ctx and n_prompt + max_tokens > ctx:
        print(f"warning: --max-tokens {max_tokens} clipped to {ctx - n_prompt}: the prompt "
              f"({n_prompt} tokens) and the reply must fit the model's context ({ctx})",
              file=sys.stderr)
        return ctx - n_prompt
    return max_tokens


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("generate", help="continue a prompt (streamed to stdout)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", required=True, metavar="TEXT", help="the text to continue")
    p.add_argument("--chat", action="store_true",
                   help="wrap the prompt as a user message in the model's chat template")
    add_sampling_args(p, max_tokens=256)
    return p


def run(args) -> int:
    if not args.prompt or not args.prompt.strip():
        raise UserError("--prompt is empty: give some text to continue")
    sampling = sampling_from_args(args)
    model, tokenizer = load_for_inference(args.model, args.adapter, args.quantized)
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        tokens = encode_chat(tokenizer, messages + [{"role": "user", "content": args.prompt}])
    else:
        if args.system:
            raise UserError("--system needs --chat")
        tokens = tokenizer.encode(args.prompt)
    if not tokens:
        raise UserError("--prompt encodes to no tokens")
    max_tokens = clip_max_tokens(model, len(tokens), args.max_tokens)
    out = sys.stdout
    last = None
    text = ""
    with backend.model_memory(model, "generating", GENERATE_FIXES):
        for chunk in stream_generate(model, tokenizer, tokens, max_tokens=max_tokens,
                                     sampling=sampling, stop=args.stop):
            if chunk.text:
                out.write(chunk.text)
                out.flush()
                text = chunk.text
            last = chunk
    if out.isatty() and not text.endswith("\n"):
        out.write("\n")
    out.flush()
    if last is not None and last.stats is not None:
        print(f"[{last.stats.describe()} | finish: {last.finish_reason}]", file=sys.stderr)
    return 0
