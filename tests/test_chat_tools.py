"""Tool-calling chat data and chat-template arguments, checked against transformers.

The reference is transformers' `apply_chat_template(..., tools=..., return_assistant_tokens_mask=
True)`, TRL's `assistant_only_loss`: a template whose assistant output is wrapped in
`{% generation %}` blocks marks the tokens the model writes. Our mask comes from rendering the
conversation turn by turn (mlxtoy.train.formats.Renderer) with the template as the model ships
it; both must give the same text, the same token ids and the same trained tokens.

Templates: SmolLM2's own (from its GGUF; no tools block, so a structured tool call is an error)
and a Qwen3-style template with a tools block, tool calls, tool responses and thinking, written
here (generation markers placed after the generation prompt, the end of turn inside).
"""

from __future__ import annotations

import json
import os

import pytest
from transformers import AutoTokenizer

from mlxtoy.config import TrainConfig, parse_text
from mlxtoy.errors import UserError
from mlxtoy.io.tokenizer import Tokenizer
from mlxtoy.loading import load_tokenizer
from mlxtoy.train.formats import Renderer, parse_object, with_template_kwargs

pytestmark = pytest.mark.real  # SmolLM2's tokenizer (its GGUF)

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}

# A Qwen3-style template: a tools block in the system turn, <tool_call> blocks for the assistant's
# calls, tool results as <tool_response> inside a user turn, a <think> block on every assistant
# turn (prefix-preserving), and enable_thinking: false putting the empty think block into the
# generation prompt. `{% generation %}` marks what the model writes after the generation prompt.
QWEN3_STYLE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou may call functions. Their signatures, within <tools></tools>:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\n\\nReturn each call as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>.<|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set no_think = enable_thinking is defined and enable_thinking is false %}
{%- for message in messages %}
{%- set content = message.content if message.content is string else '' %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{%- set reasoning = message.reasoning_content if message.reasoning_content is string else '' %}
{{- '<|im_start|>assistant\\n' }}
{%- if no_think %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- generation %}
{%- if not no_think %}{{- '<think>\\n' + reasoning.strip() + '\\n</think>\\n\\n' }}{%- endif %}
{{- content }}
{%- for call in message.tool_calls or [] %}
{%- set fn = call.function if call.function is defined else call %}
{%- if content or not loop.first %}{{- '\\n' }}{%- endif %}
{{- '<tool_call>\\n{\"name\": \"' + fn.name + '\", \"arguments\": ' }}
{{- fn.arguments if fn.arguments is string else (fn.arguments | tojson) }}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- endgeneration %}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if no_think %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}"""

# SmolLM2's own template with generation markers around what the assistant writes (its
# content and end of turn), the rest unchanged: the reference for the assistant mask.
SMOLLM2_MARKED = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\\n'}}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endgeneration %}{% else %}{{ message['content'] + '<|im_end|>' + '\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def tool_rows() -> list[dict]:
    """Two tool-calling conversations: calls as OpenAI objects (arguments an object and JSON
    text), parallel calls, tool results, a reply after them, and a second user turn."""
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    return [
        {"messages": [{"role": "user", "content": "What is the weather in Paris?"},
                      {"role": "assistant", "content": None, "tool_calls": [call]},
                      {"role": "tool", "name": "get_weather", "tool_call_id": "c1", "content": "{\"temp\": 22}"},
                      {"role": "assistant", "content": "It is 22 degrees in Paris."}],
         "tools": [WEATHER_TOOL, TIME_TOOL]},
        {"messages": [{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": "Weather and time in Oslo?"},
                      {"role": "assistant", "content": "Checking both.", "tool_calls": [
                          {"type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}},
                          {"function": {"name": "get_time", "arguments": {"city": "Oslo"}}}]},
                      {"role": "tool", "name": "get_weather", "content": "rain"},
                      {"role": "tool", "name": "get_time", "content": "09:15"},
                      {"role": "assistant", "content": "Rain, and it is 09:15."},
                      {"role": "user", "content": "Thanks!"},
                      {"role": "assistant", "content": "You are welcome."}],
         "tools": json.dumps([WEATHER_TOOL, TIME_TOOL])},  # tables often hold the tools as JSON text
    ]


def model_folder(tmp_path, smollm2_path, template: str) -> str:
    """SmolLM2's tokenizer as a Hugging Face folder with `template` as its chat template, which
    both mlxtoy and transformers load."""
    tok = load_tokenizer(smollm2_path)
    folder = tmp_path / "tok"
    folder.mkdir(exist_ok=True)
    (folder / "tokenizer.json").write_text(tok.to_hf_tokenizer_json(), encoding="utf-8")
    config = dict(tok.to_hf_tokenizer_config(), chat_template=template)
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return str(folder)


def row_tools(row: dict) -> list[dict] | None:
    tools = row.get("tools")
    return json.loads(tools) if isinstance(tools, str) else tools


def hf_text(hf_tok, row: dict, template: str, **kwargs) -> str:
    return hf_tok.apply_chat_template(row["messages"], tools=row_tools(row), chat_template=template,
                                      tokenize=False, **kwargs)


def reference(hf_tok, row: dict, template: str, **kwargs) -> tuple[str, list[int], list[bool]]:
    """transformers' text, token ids and assistant mask of a row (tools as TRL passes them)."""
    tools = row_tools(row)
    text = hf_text(hf_tok, row, template, **kwargs)
    out = hf_tok.apply_chat_template(row["messages"], tools=tools, chat_template=template, tokenize=True,
                                     return_dict=True, return_assistant_tokens_mask=True, **kwargs)
    return text, list(out["input_ids"]), [bool(m) for m in out["assistant_masks"]]


def ours(tok, row: dict) -> tuple[str, list[int], list[bool]]:
    rec = parse_object(row, "rows.jsonl:1")
    [(ids, loss)] = rec.format.sequences(rec, Renderer(tok))
    return tok.decode(ids), ids, loss


def trained_text(tok, ids: list[int], mask: list[bool]) -> list[str]:
    """The trained runs of tokens as text: what a failure message shows."""
    runs, cur = [], []
    for t, m in zip(ids + [None], mask + [False]):
        if m:
            cur.append(t)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    return runs


@pytest.mark.parametrize("thinking", [True, False], ids=["thinking", "no-thinking"])
def test_qwen3_style_tool_rows_match_transformers(tmp_path, smollm2_path, thinking):
    folder = model_folder(tmp_path, smollm2_path, QWEN3_STYLE)
    hf_tok = AutoTokenizer.from_pretrained(folder)
    kwargs = {} if thinking else {"enable_thinking": False}
    tok = with_template_kwargs(Tokenizer.from_hf_folder(folder), kwargs)
    for row in tool_rows():
        want_text, want_ids, want_mask = reference(hf_tok, row, QWEN3_STYLE, **kwargs)
        text, ids, mask = ours(tok, row)
        assert text == want_text
        assert ids == want_ids
        assert mask == want_mask, (trained_text(tok, ids, mask), trained_text(tok, ids, want_mask))
        runs = trained_text(tok, ids, mask)
        # not vacuous: every assistant turn trains, with its tool calls; no tool result does
        n_assistant = sum(m["role"] == "assistant" for m in row["messages"])
        assert len(runs) == n_assistant and all(r.endswith("<|im_end|>\n") for r in runs)
        assert any("<tool_call>" in r and "get_weather" in r for r in runs)
        assert not any("<tool_response>" in r for r in runs)
        assert ("<think>" in runs[0]) == thinking  # thinking off: the empty block is the prompt's
        assert "get_time" in text and "# Tools" in text  # the tools reached the template


def test_qwen3_style_positive_control(tmp_path, smollm2_path):
    """The comparison can fail: rendered with thinking on, the masks of a thinking-off reference
    differ (the empty think block moves from the prompt to the reply), and so does the text of a
    row whose tools were not given to the template."""
    folder = model_folder(tmp_path, smollm2_path, QWEN3_STYLE)
    hf_tok = AutoTokenizer.from_pretrained(folder)
    tok = Tokenizer.from_hf_folder(folder)
    row = tool_rows()[0]
    _, _, off_mask = reference(hf_tok, row, QWEN3_STYLE, enable_thinking=False)
    _, ids, mask = ours(tok, row)
    off_text, off_ids, _ = reference(hf_tok, row, QWEN3_STYLE, enable_thinking=False)
    assert ids != off_ids or mask != off_mask
    no_tools = dict(row)
    no_tools.pop("tools")
    assert ours(tok, no_tools)[0] != hf_text(hf_tok, row, QWEN3_STYLE)


def test_smollm2_tool_rows_match_transformers(tmp_path, smollm2_path):
    """SmolLM2's template has no tools block: the tools go to it and are not shown (as in
    transformers), tool results are turns of their own role, untrained, and a call written into
    the assistant's content trains as that turn."""
    tok = load_tokenizer(smollm2_path)
    folder = model_folder(tmp_path, smollm2_path, tok.chat_template)
    hf_tok = AutoTokenizer.from_pretrained(folder)
    for row in tool_rows():
        row = {**row, "messages": [{k: v for k, v in m.items() if k != "tool_calls"} for m in row["messages"]]}
        for m, given in zip(row["messages"], tool_rows()[0 if len(row["messages"]) == 4 else 1]["messages"]):
            if given.get("tool_calls"):  # the calls as text, the way this model writes them
                m["content"] = (m["content"] or "") + "<tool_call>" + json.dumps(given["tool_calls"]) + "</tool_call>"
        # the marked copy renders what SmolLM2's own template renders
        assert hf_text(hf_tok, row, SMOLLM2_MARKED) == hf_text(hf_tok, row, tok.chat_template)
        want_text, want_ids, want_mask = reference(hf_tok, row, SMOLLM2_MARKED)
        text, ids, mask = ours(tok, row)
        assert (text, ids) == (want_text, want_ids)
        assert mask == want_mask, (trained_text(tok, ids, mask), trained_text(tok, ids, want_mask))
        runs = trained_text(tok, ids, mask)
        assert len(runs) == sum(m["role"] == "assistant" for m in row["messages"])
        assert any("get_weather" in r for r in runs) and not any("<|im_start|>tool" in r for r in runs)


def test_smollm2_drops_structured_tool_calls_so_they_are_an_error(smollm2_path):
    """transformers renders SmolLM2's template with the tool call silently left out (the turn
    would train an empty reply); we refuse the row, naming it and the call."""
    tok = load_tokenizer(smollm2_path)
    row = tool_rows()[0]
    row["messages"][1]["content"] = ""
    hf_text = tok.apply_chat_template(row["messages"], add_generation_prompt=False, tools=row["tools"])
    assert "get_weather" not in hf_text  # what the template does with the call
    with pytest.raises(UserError, match=r"rows.jsonl:1: .*leaves out the tool call 'get_weather' of message 1"):
        ours(tok, row)


def test_bad_tool_rows_are_one_line_errors():
    base = tool_rows()[0]
    cases = [
        ({"tools": "[not json"}, "field 'tools' is text but not JSON"),
        ({"tools": [1, 2]}, "field 'tools' must be a list of tool definitions"),
        ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [{"function": {}}]}]},
         "message 1 tool call 0 needs a function 'name'"),
        ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": "x"}]},
         "message 1 'tool_calls' must be a list"),
        ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]},
         "message 1 needs 'role' and 'content'"),
        ({"messages": [{"role": "tool", "content": "x", "tool_call_id": 3}]}, "message 0 'tool_call_id' must be a string"),
    ]
    for change, message in cases:
        with pytest.raises(UserError, match="^f.jsonl:3: " + message):
            parse_object({**base, **change}, "f.jsonl:3")


def test_chat_template_kwargs_from_the_cli_yaml_and_form(tmp_path, smollm2_path):
    from mlxtoy.cli import build_parser
    from mlxtoy.commands.train import build_config

    args = build_parser().parse_args(["train", "--data", "d.jsonl", "--out", str(tmp_path / "r"),
                                      "--chat-template-kwargs", '{"enable_thinking": false}'])
    cfg, _ = build_config(args)
    assert cfg.chat_template_kwargs == {"enable_thinking": False}
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("chat_template_kwargs:\n  enable_thinking: false\n  effort: 2\n")
    assert TrainConfig.from_yaml(str(yaml_file)).chat_template_kwargs == {"enable_thinking": False, "effort": 2}
    assert parse_text("chat_template_kwargs", "{enable_thinking: false}") == ({"enable_thinking": False}, None)
    assert parse_text("chat_template_kwargs", "") == ({}, None)
    assert parse_text("chat_template_kwargs", "enable_thinking=false")[0] is None
    with pytest.raises(UserError, match="chat_template_kwargs must be a mapping"):
        TrainConfig(chat_template_kwargs="[1, 2]")
    with pytest.raises(UserError, match="chat_template_kwargs may not set 'tools'"):
        TrainConfig(chat_template_kwargs={"tools": []}).validate()
    # a variable the model's template never reads is an error, not a silent no-op
    with pytest.raises(UserError, match="does not read 'enable_thinking'"):
        with_template_kwargs(load_tokenizer(smollm2_path), {"enable_thinking": False})


def test_the_preview_shows_tool_calls_as_trained(tmp_path, smollm2_path):
    """What the TUI's data preview shows of a tool-calling row: the call in the first lines, and
    in the rendering the call among the trained (green) pieces, the tool result not."""
    from tui.setup import show_rendered

    tok = Tokenizer.from_hf_folder(model_folder(tmp_path, smollm2_path, QWEN3_STYLE))
    rec = parse_object(tool_rows()[0], "x:1")
    assert ("assistant:", "→ get_weather(…)") in rec.format.preview(rec)
    [(ids, loss)] = rec.format.sequences(rec, Renderer(tok))
    shown = show_rendered(Renderer(tok).pieces(ids, loss), limit=10_000)
    assert '[green]<think>\n\n</think>\n\n<tool_call>\n{"name": "get_weather"' in shown
    assert "[dim]<|im_start|>user\n<tool_response>" in shown
