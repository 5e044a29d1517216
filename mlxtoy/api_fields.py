"""A request's fields for the OpenAI-compatible API (`mlxtoy.api`), checked: a bad one is an
APIError naming it (`param`), which the API answers with OpenAI's error shape."""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

from mlxtoy.errors import UserError
from mlxtoy.train.formats import check_tools

MAX_PROMPTS = 64  # prompts in one completions request
# OpenAI takes 4; an evaluation harness's task may stop at more (its own and the model's end)
MAX_STOPS = 16


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def response(self) -> JSONResponse:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return JSONResponse({"error": {"message": self.message, "type": kind, "param": self.param,
                                       "code": self.code}}, status_code=self.status)


def number(body: dict, name: str, default, lo=None, hi=None, integer=False):
    v = body.get(name, default)
    if v is None:
        return default
    ok = isinstance(v, int) if integer else isinstance(v, (int, float))
    if not ok or isinstance(v, bool):
        raise APIError(400, f"{name} must be {'an integer' if integer else 'a number'}, got {v!r}", name)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        bounds = f">= {lo}" if hi is None else f"in {lo}..{hi}"
        raise APIError(400, f"{name} must be {bounds}, got {v!r}", name)
    return v


def stops(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > MAX_STOPS:
        raise APIError(400, f"stop must be a string or a list of up to {MAX_STOPS} strings", "stop")
    return [s for s in stop if s]


def text_content(content: Any) -> Any:
    """A message's content: a string, or OpenAI's list of parts (the text parts joined); else
    as it is (None beside tool calls; `check_messages` judges the rest)."""
    if not isinstance(content, list):
        return content
    parts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise APIError(400, "messages: only text content parts are supported", "messages")
        parts.append(part["text"])
    return "".join(parts)


def parse_logit_bias(raw: Any, vocab_size: int) -> dict[int, float] | None:
    """OpenAI's logit_bias: {"token id": bias in -100..100}."""
    if raw is None or raw == {}:
        return None
    if not isinstance(raw, dict) or len(raw) > 300:
        raise APIError(400, "logit_bias must be an object of at most 300 {token id: bias}", "logit_bias")
    out = {}
    for key, value in raw.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            token = -1
        if not 0 <= token < vocab_size:
            raise APIError(400, f"logit_bias: {key!r} is not a token id in 0..{vocab_size - 1}", "logit_bias")
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not -100 <= value <= 100:
            raise APIError(400, f"logit_bias: the bias of {key} must be a number in -100..100", "logit_bias")
        out[token] = float(value)
    return out


def parse_tools(body: dict) -> tuple[list[dict] | None, bool | str | None]:
    """-> (the request's tools for the chat template: None for none or tool_choice "none";
    the call forced by tool_choice: True for "required", a function's name, None for "auto")."""
    try:
        tools = check_tools(body, "tools")
    except UserError as e:
        raise APIError(400, str(e), "tools") from None
    for i, t in enumerate(tools or []):
        fn = t.get("function")
        if t.get("type", "function") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise APIError(400, f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\", ...}}}}",
                           "tools")
    choice = body.get("tool_choice", "auto")
    if choice == "none":
        return None, None
    if choice == "auto":
        return tools, None
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if choice != "required" and not isinstance(name, str):
        raise APIError(400, "tool_choice must be \"auto\", \"none\", \"required\" or "
                            "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
    if not tools or (name is not None and name not in [t["function"]["name"] for t in tools]):
        raise APIError(400, f"tool_choice names {name or 'a tool'}, which tools does not hold", "tool_choice")
    return tools, True if choice == "required" else name


def parse_prompts(raw: Any, tok: Any, vocab_size: int) -> tuple[list[list[int]], list[str]]:
    """A completions request's prompt (a string, token ids, or a list of either) -> (each
    prompt's tokens, its text)."""

    def ids(v: Any) -> list[int] | None:
        if not (isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) for t in v)):
            return None
        if not all(0 <= t < vocab_size for t in v):
            raise APIError(400, f"prompt: token ids must be in 0..{vocab_size - 1}", "prompt")
        return list(v)

    if isinstance(raw, str):
        return [tok.encode(raw)], [raw]
    if ids(raw) is not None:
        return [raw], [tok.decode(raw)]
    if isinstance(raw, list) and 0 < len(raw) <= MAX_PROMPTS:
        out = []
        for v in raw:
            if isinstance(v, str):
                out.append((tok.encode(v), v))
            elif ids(v) is not None:
                out.append((list(v), tok.decode(v)))
            else:
                break
        else:
            return [t for t, _ in out], [e for _, e in out]
    raise APIError(400, f"prompt must be a string, a list of token ids, or a list of up to {MAX_PROMPTS} "
                        f"of either", "prompt")
