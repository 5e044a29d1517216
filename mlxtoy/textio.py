"""Reading untrusted text: the one place that decodes files and parses JSON and YAML from them.

Everything a user hands us (data files, --config, an HF config.json, a run's metrics.jsonl)
is read here, so every failure is a `UserError` naming the file and line instead of a
traceback: bytes that are not UTF-8 (a UTF-8 BOM is accepted), JSON nested deeper than any
real record, integers too long to convert, and strings holding lone surrogates (which JSON's
\\ud800 escapes can produce and which no tokenizer can encode).
"""

from __future__ import annotations

import json
from typing import Any, Iterator

import numpy as np
import yaml

from mlxtoy.errors import UserError

MAX_JSON_DEPTH = 64  # far beyond any real record; Python's parser recurses per level
MAX_LINE_BYTES = 64 * 1024 * 1024  # one JSON line; a longer one is refused, not parsed


def _decode(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise UserError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def read_text(path: str) -> str:
    """A whole text file (UTF-8, BOM accepted)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:  # name the line, not just the byte offset
        line = data.count(b"\n", 0, e.start) + 1
        raise UserError(f"{path}:{line}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def iter_lines(path: str) -> Iterator[tuple[int, str]]:
    """(line number, decoded line) for each line; a line that is not UTF-8 is an error
    naming `path:line`."""
    try:
        f = open(path, "rb")
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror or e})") from None
    with f:
        for lineno, raw in enumerate(f, 1):
            if len(raw) > MAX_LINE_BYTES:
                raise UserError(f"{path}:{lineno}: line longer than {MAX_LINE_BYTES // 2**20} MiB")
            if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]
            yield lineno, _decode(raw, f"{path}:{lineno}")


def _depth(text: str) -> int:
    """Upper bound of the nesting depth of a JSON text (brackets outside strings), in numpy
    (a tokenizer.json is megabytes: too long for a loop over its characters)."""
    b = np.frombuffer(text.encode("utf-8", "surrogatepass"), np.uint8)
    if b.size == 0:
        return 0
    at = np.arange(b.size, dtype=np.int32 if b.size < 2**31 else np.int64)
    # a character is escaped when an odd run of backslashes ends just before it
    run = at - np.maximum.accumulate(np.where(b == 92, -1, at))
    escaped = np.zeros(b.size, dtype=bool)
    escaped[1:] = (run[:-1] & 1).astype(bool)
    del at, run
    quote = (b == 34) & ~escaped
    inside = np.bitwise_xor.accumulate(quote.view(np.uint8)).view(bool)  # after an odd count of quotes
    opens = ((b == 91) | (b == 123)) & ~inside
    closes = ((b == 93) | (b == 125)) & ~inside
    return max(int(np.cumsum(opens.view(np.int8) - closes.view(np.int8), dtype=np.int64).max()), 0)


def parse_json(text: str, where: str) -> Any:
    """json.loads with every failure as one UserError naming `where`."""
    # counting brackets is fast (C); the exact walk runs only when it could matter
    if text.count("[") + text.count("{") > MAX_JSON_DEPTH and _depth(text) > MAX_JSON_DEPTH:
        raise UserError(f"{where}: JSON nested deeper than {MAX_JSON_DEPTH} levels")
    try:
        obj = json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        raise UserError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
    except ValueError as e:  # e.g. an integer longer than Python converts
        raise UserError(f"{where}: invalid JSON ({e})") from None
    except RecursionError:
        raise UserError(f"{where}: JSON nested too deeply") from None
    return obj


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def read_json(path: str) -> Any:
    return parse_json(read_text(path), path)


def load_yaml(path: str) -> dict[str, Any]:
    """A YAML file of config keys (--config, a run's config.yaml) -> its mapping, {} when empty."""
    text = read_text(path)
    try:
        data = yaml.safe_load(text)
    except RecursionError:
        raise UserError(f"{path}: YAML nested too deeply") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else path
        raise UserError(f"{where}: invalid YAML ({getattr(e, 'problem', None) or e})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a mapping of config keys, got {type(data).__name__}")
    return data


def check_string(s: str, where: str) -> str:
    """`s` unless it holds a lone surrogate (text no tokenizer can encode)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UserError(f"{where}: invalid text (a lone surrogate {s[e.start]!r} at character "
                        f"{e.start})") from None
    return s
