"""`mlxtoy tui [--model MODEL] [--data PATH] [--runs FOLDER]`: the terminal UI.

Textual is imported only here, when the UI actually starts, so `mlxtoy` itself (and every
headless command) works without it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from mlxtoy.errors import UserError


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("tui", help="the terminal UI: set up a run, watch it train, talk to the model")
    p.add_argument("--model", help="a .gguf file, a Hugging Face folder or id (org/name[@rev], "
                                   "org/name/file.gguf), or a built-in name (default: smollm2-135m)")
    p.add_argument("--data", help="training data: a .jsonl/.txt/.parquet/.csv/.arrow file, a folder, "
                                  "or a Hugging Face dataset id")
    p.add_argument("--runs", default="runs", metavar="FOLDER",
                   help="where new runs go and earlier runs are listed (default: ./runs)")
    p.add_argument("--light", action="store_true", help="start with the light theme")
    p.add_argument("--latency-log", metavar="FILE",
                   help="write key-press latency and event-loop lag statistics (JSON) on exit")
    return p


def run(args) -> int:
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise UserError("the terminal UI needs an interactive terminal (use `mlxtoy train` for scripts)")
    try:
        from tui.app import MlxtoyApp
    except ImportError as e:
        raise UserError(f"the terminal UI needs Textual ({e}); install it with "
                        f"`pip install textual textual-plotext`") from None
    if args.data and not os.path.exists(args.data):
        raise UserError(f"{args.data}: no such file or folder")
    app = MlxtoyApp(model=args.model, data=args.data, runs_dir=args.runs,
                    theme="textual-light" if args.light else "textual-dark")
    app.run()
    if args.latency_log:
        with open(args.latency_log, "w") as f:
            json.dump(app.latency.report(), f, indent=1)
    return int(app.return_code or 0)
