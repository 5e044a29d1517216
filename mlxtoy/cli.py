"""`mlxtoy ...`: the headless entry point.

Exit 0 on success, 2 on bad input (one line `error: ...` on stderr, no traceback), 1 on an
internal error. Stdout carries only the product; progress and stats go to stderr.
Each subcommand lives in `mlxtoy/commands/<name>.py` with `add_parser(sub)` and `run(args)`.
"""

from __future__ import annotations

import argparse
import sys
import traceback

from mlxtoy.commands import chat, export, generate, inspect, taps, train, tui
from mlxtoy.errors import UserError

COMMANDS = (inspect, generate, chat, train, export, taps, tui)  # in `mlxtoy --help` order


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's own errors follow our contract too
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="mlxtoy", description="On-device LLM fine-tuning on MLX.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for module in COMMANDS:
        p = module.add_parser(sub)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args._run(args) or 0)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except Exception:
        traceback.print_exc()
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
