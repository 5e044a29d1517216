"""Progress and log lines on stderr: the one rich Console the commands print them through.

On a terminal rich draws live progress bars and fits lines to the terminal's width. Anywhere
else (a log file, a pipe, CI) each line is printed whole, never wrapped: rich's default width
there is 80 columns, and a path broken across two lines can be neither copied nor grepped.
Emoji codes are never read from the text (a path may contain `:name:`).
"""

from __future__ import annotations

import sys

from rich.console import Console


def stderr_console() -> Console:
    """A Console on stderr that wraps only on a terminal (see the module's note)."""
    on_terminal = sys.stderr.isatty()
    return Console(stderr=True, highlight=False, emoji=False, soft_wrap=not on_terminal)
