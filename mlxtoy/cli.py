"""`mlxtoy ...`: the headless entry point.

Exit 0 on success, 2 on bad input (one line `error: ...` on stderr, no traceback), 1 on an
internal error. Stdout carries only the product; progress and stats go to stderr.
Each subcommand lives in `mlxtoy/commands/<name>.py` with `add_parser(sub)` and `run(args)`.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import sys
import traceback

from mlxtoy import __version__, backend, settings
from mlxtoy.commands import chat, doctor, export, generate, inspect, serve, taps, train, tui
from mlxtoy.errors import UserError

COMMANDS = (inspect, generate, chat, serve, train, export, taps, tui, doctor)  # in `mlxtoy --help` order


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's own errors follow our contract too
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(2)


class ReferenceHelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every command's --help as a reference: descriptions keep their line breaks, and an
    option's default is shown unless its help already says it (or there is none to show)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if ("default" in text or not action.option_strings or default is None or isinstance(default, bool)
                or default in ("", []) or default is argparse.SUPPRESS):
            return text
        return text + " (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="mlxtoy", description="On-device LLM fine-tuning on MLX.")
    parser.add_argument("--version", action="version", version=f"mlxtoy {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for module in COMMANDS:
        p = module.add_parser(sub)
        p.formatter_class = ReferenceHelpFormatter
        add_device_argument(p)
        p.set_defaults(_run=module.run)
    return parser


def add_device_argument(p: argparse.ArgumentParser) -> None:
    """`--device cpu|gpu`, which every command takes; `main` applies it before the command runs."""
    p.add_argument("--device", choices=("cpu", "gpu"), default=None,
                   help="compute on the CPU or the GPU (Metal or CUDA); default: the GPU where there "
                        "is one (MLXTOY_DEVICE sets it for every command)")


def _guard_streams() -> bool:
    """Closed standard streams (`<&-`, `>&-`, `2>&-`) become /dev/null: at the fd level, or the
    next file we open would get fd 0-2 (C code writing to "stdout" would then write into a
    checkpoint, and MLX refuses to read from fd 0), and at the Python level, so nothing (least
    of all a traceback) lands on the other stream. True when stdout was closed."""
    closed = False
    for fd, name in ((0, "stdin"), (1, "stdout"), (2, "stderr")):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
            setattr(sys, name, open(fd, "r" if fd == 0 else "w", closefd=False))
            closed = closed or fd == 1
    return closed


def _flush_quietly() -> bool:
    """Flush stdout and stderr; False when one of them cannot take the output (a full disk,
    a closed pipe). Either way Python's own flush at exit will find nothing left to fail on."""
    ok = True
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            ok = False
            with contextlib.suppress(OSError, ValueError):
                os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())
    return ok


def main(argv: list[str] | None = None) -> int:
    stdout_closed = _guard_streams()
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help(sys.stderr)
        return 2
    try:
        settings.check_all()  # every MLXTOY_* switch: refused or warned about once, before anything runs
        if args.device:
            backend.use_device(args.device)
        code = int(args._run(args) or 0)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        code = 130
    except BrokenPipeError:  # `mlxtoy generate ... | head`: the reader has what it wanted
        _flush_quietly()
        return 0
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EPIPE, errno.EBADF, errno.EIO):
            traceback.print_exc()
            return 1
        code = 1  # an output stream is full or gone: end quietly
    except Exception:
        traceback.print_exc()
        code = 1
    if not _flush_quietly() or stdout_closed:
        return code or 1
    return code


if __name__ == "__main__":
    raise SystemExit(main())
