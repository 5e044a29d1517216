#!/usr/bin/env python3
"""Screenshots of the terminal UI for the docs (SVG, docs/images/tui-*.svg), taken headless the
way tests/test_tui.py drives the app (Textual's Pilot; no terminal needed).

    .venv/bin/python scripts/tui_screenshots.py --run runs/quickstart-...   # a real run's events
    .venv/bin/python scripts/tui_screenshots.py                            # a simulated run

The Train screen renders a run's metrics.jsonl as the app does when it reopens a run; without
--run it renders the simulated events of tests/fake_trainer.py. The Setup screen shows the form
for the run's model and data; the Runs screen lists the runs under --runs, and the export
dialog opens on the first of them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "tests")]

from textual.widgets import Input  # noqa: E402

from tui.app import MlxtoyApp  # noqa: E402
from tui.state import DONE, RunState  # noqa: E402

SIZE = (120, 36)


def run_events(run: str | None) -> tuple[list[dict], str]:
    """(events, run directory): the run's metrics.jsonl, or the simulated run's."""
    if run is None:
        from fake_trainer import fake_events

        return list(fake_events(steps=40, n_layers=30, run_dir="runs/demo")), "runs/demo"
    with open(os.path.join(run, "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()], run


async def _steady(pilot) -> None:
    """No blinking cursor in a screenshot."""
    for inp in pilot.app.screen.query(Input):
        inp.cursor_blink = False
    await pilot.pause(0.3)


async def shoot(args: argparse.Namespace) -> list[str]:
    events, run_dir = run_events(args.run)
    config = next((e.get("config") or {} for e in events if e.get("event") == "start"), {})
    written = []

    async def screen(name: str, keys: tuple[str, ...], prepare=None) -> None:
        app = MlxtoyApp(model=config.get("model"), data=config.get("data") or args.data, runs_dir=args.runs)
        async with app.run_test(size=SIZE) as pilot:
            if prepare is not None:
                prepare(app)
            for key in keys:
                await pilot.press(key)
                await pilot.pause(args.settle)
            await _steady(pilot)
            path = app.save_screenshot(f"tui-{name}.svg", args.out)
            written.append(path)

    def with_run(app: MlxtoyApp) -> None:
        state = RunState.from_events(events, run_dir=run_dir)
        state.status = DONE
        app.run_state = state

    await screen("setup", ())
    await screen("train", ("f2",), with_run)
    await screen("runs", ("f4",))
    await screen("export", ("f4", "e"))
    return written


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    ap.add_argument("--run", help="a run directory whose metrics.jsonl the Train screen shows")
    ap.add_argument("--data", default="assets/demo", help="the Setup screen's data when the run names none")
    ap.add_argument("--runs", default="runs", help="the folder the Runs screen lists (default: runs)")
    ap.add_argument("--out", default=os.path.join(REPO, "docs", "images"), help="where the SVGs go")
    ap.add_argument("--settle", type=float, default=2.0, help="seconds to let a screen load (default: 2)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for path in asyncio.run(shoot(args)):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
