"""What a user reads from the CLI in a log: `mlxtoy train` with its output in a file prints each
result once and never breaks a line inside a path; `--version`; every command's `--help`
reads as a reference (grouped options, defaults shown)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from helpers_train import REPO, qa_rows, run_cli, write_jsonl, write_tiny_model_folder
from mlxtoy import __version__
from mlxtoy.cli import COMMANDS
from mlxtoy.config import train_sections


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory):
    """A tiny LoRA run with --eval-accuracy into a deep run directory (its paths are longer
    than rich's 80-column default), stdout and stderr both written to one file, as a CI log."""
    root = tmp_path_factory.mktemp("log")
    model = write_tiny_model_folder(str(root / "model"))
    data = root / "data"
    write_jsonl(str(data / "train.jsonl"), qa_rows(40, seed=1))
    write_jsonl(str(data / "valid.jsonl"), qa_rows(8, seed=2))
    write_jsonl(str(data / "test.jsonl"), qa_rows(4, seed=3))
    out = root / "a-run-directory-whose-name-is-long-enough" / "that-its-checkpoint-paths-pass-80-columns"
    log = root / "train.log"
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    with open(log, "w") as f:
        r = subprocess.run([sys.executable, "-m", "mlxtoy", "train", "--model", model, "--data", str(data),
                            "--out", str(out), "--steps", "4", "--batch-size", "2", "--seq-len", "64",
                            "--eval-every", "2", "--save-every", "2", "--eval-batches", "1",
                            "--eval-accuracy", "--seed", "0"],
                           stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=env, timeout=300)
    text = log.read_text()
    assert r.returncode == 0, text
    return {"out": str(out), "lines": text.splitlines()}


def test_log_lines_keep_paths_whole(logged_run):
    """Each line that names a file names it whole: no line ends inside the run's path, and the
    lines that name the checkpoints and the result hold their full paths (longer than 80)."""
    out, lines = logged_run["out"], logged_run["lines"]
    checkpoint_lines = [line for line in lines if ": checkpoint " in line]
    assert [line.split(": checkpoint ", 1)[1] for line in checkpoint_lines] == \
        [os.path.join(out, "checkpoints", "step_2"), os.path.join(out, "checkpoints", "step_4")]
    assert all(len(line) > 80 for line in checkpoint_lines)  # rich's default width would wrap these
    result = [line for line in lines if "; result in " in line]
    assert len(result) == 1 and result[0].split("; result in ", 1)[1].startswith(out), result
    start = [line for line in lines if line.startswith("training lora:")]
    assert len(start) == 1 and start[0].endswith(out)
    for line in lines:  # no line holds only the start or the rest of a path
        assert not (out[:40] in line and out not in line), line


def test_each_result_is_printed_once(logged_run):
    """With stdout and stderr in one file (a terminal shows both), no line is printed twice but
    the per-example sample lines of the accuracy reports (before and after may agree)."""
    lines = [line for line in logged_run["lines"] if line.strip() and not line.startswith("  [")]
    repeated = sorted({line for line in lines if lines.count(line) > 1})
    assert not repeated, repeated
    for label in ("before", "after"):
        assert sum(line.startswith(f"{label}: held-out accuracy") for line in lines) == 1, label
    assert any(line.startswith("step 4/4 loss") for line in lines)  # the progress lines are there


def test_version():
    r = run_cli("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"mlxtoy {__version__}", r


def option_entries(help_text: str) -> dict[str, str]:
    """`--help` text -> {an option's flags as printed: its help text}, whitespace squeezed."""
    entries: dict[str, str] = {}
    flags = None
    for line in help_text.splitlines():
        m = re.match(r"^  (-[^ ].*?)(?:  +(\S.*))?$", line)
        if m:
            flags = m.group(1)
            entries[flags] = m.group(2) or ""
        elif flags and line.startswith("      ") and line.strip():
            entries[flags] = (entries[flags] + " " + line.strip()).strip()
        else:
            flags = None
    return entries


@pytest.mark.parametrize("command", [m.__name__.rsplit(".", 1)[1] for m in COMMANDS])
def test_help_reads_as_a_reference(command):
    """Every option of every command's --help says what it does, and every line fits a terminal
    (argparse wraps the options; a description's own lines must be short too)."""
    r = run_cli(command, "--help", env={"COLUMNS": "80"})
    assert r.returncode == 0 and r.stdout.startswith(f"usage: mlxtoy {command}"), r
    long_lines = [line for line in r.stdout.splitlines() if len(line) > 100]
    assert not long_lines, long_lines
    entries = option_entries(r.stdout)
    assert len(entries) > 1, entries  # -h and the command's own
    empty = [flags for flags, text in entries.items() if not text]
    assert not empty, empty


def test_help_groups_options_and_shows_defaults():
    """Defaults appear where the help text did not already give them; train's and generate's
    options come in groups (train's from the config's sections)."""
    generate = option_entries(run_cli("generate", "--help").stdout)
    assert generate["--top-p P"].endswith("(default: 1.0)")
    assert generate["--temp T"].count("default") == 1  # its help says it already
    assert "--seed S" in generate and "default" not in generate["--seed S"]  # None: nothing to show
    assert option_entries(run_cli("export", "--help").stdout)["--format FORMAT"].count("default") == 1
    text = run_cli("train", "--help").stdout
    headers = [line[:-1] for line in text.splitlines() if line.endswith(":") and not line.startswith(" ")]
    assert headers == ["options"] + [title for title, _ in train_sections()], headers
    lora = text.split("LoRA and DoRA:", 1)[1].split("\n\n", 1)[0]
    assert "--lora-rank" in lora and "--steps" not in lora
    assert "sampling:" in run_cli("chat", "--help").stdout
