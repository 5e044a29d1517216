"""Tool calling through `mlxtoy serve`: a tiny model trained (by `train`, on tool-calling chat
data) to answer a weather question with a call, in each form read for calls (<tool_call> blocks
as Qwen-style templates teach; the reply as the call's JSON as Llama 3's do; [TOOL_CALLS] and a
JSON array as Mistral's do), served; the real `openai` client gets the call as OpenAI's
`tool_calls`, whole and streamed."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from helpers_serve import Server
from helpers_train import run_training, write_jsonl, write_tiny_model_folder
from mlxtoy.config import TrainConfig
from mlxtoy.generate import encode_chat
from mlxtoy.inference import load_for_inference

# chat templates with a tools block, tool results, and calls in the three forms read for them, cut
# down to what a byte-level tiny model learns in seconds: <tool_call> blocks (Qwen2.5/Qwen3's),
# a reply that is the call's JSON with "parameters" (Llama 3's), and [TOOL_CALLS] with an array
# of calls, each with its id where the message has one (Mistral v0.3's)
HEAD = """{%- if tools %}<|im_start|>system
<tools>{% for t in tools %}{{ t.function.name }} {% endfor %}</tools><|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' %}<|im_start|>assistant
"""
TAIL = """<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
ARGS = "{{ tool_call.function.arguments if tool_call.function.arguments is string else (tool_call.function.arguments | tojson) }}"
TEMPLATES = {
    "tags": HEAD + """{{ m.content or '' }}{% for tool_call in m.tool_calls or [] %}<tool_call>
{"name": "{{ tool_call.function.name }}", "arguments": """ + ARGS + """}
</tool_call>{% endfor %}""" + TAIL,
    "json": HEAD + """{% if m.tool_calls %}{% for tool_call in m.tool_calls %}{% if not loop.first %}; {% endif %}"""
            """{{ '{"name": "' + tool_call.function.name + '", "parameters": ' }}""" + ARGS + """}{% endfor %}"""
            """{% else %}{{ m.content }}{% endif %}""" + TAIL,
    "list": HEAD + """{% if m.tool_calls %}[TOOL_CALLS] [{% for tool_call in m.tool_calls %}{% if not loop.first %}, {% endif %}"""
            """{{ '{"name": "' + tool_call.function.name + '", "arguments": ' }}""" + ARGS +
            """{% if tool_call.id %}{{ ', "id": "' + tool_call.id + '"' }}{% endif %}}{% endfor %}]"""
            """{% else %}{{ m.content }}{% endif %}""" + TAIL,
}
# what the model writes for "Weather in Rome?" in each form
RAW_CALL = {"tags": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>',
            "json": '{"name": "get_weather", "parameters": {"city": "Rome"}}',
            "list": '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Rome"}}]'}

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CITIES = ["Paris", "Oslo", "Rome", "Lima"]


def ask(city: str) -> list[dict]:
    return [{"role": "user", "content": f"Weather in {city}?"}]


@pytest.fixture(scope="module", params=list(TEMPLATES))
def served(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("tools-" + request.param)
    model = write_tiny_model_folder(str(root / "model"))
    with open(root / "model" / "tokenizer_config.json") as f:
        config = json.load(f)
    with open(root / "model" / "tokenizer_config.json", "w") as f:
        json.dump(dict(config, chat_template=TEMPLATES[request.param]), f)
    call = lambda city: {"type": "function", "function": {"name": "get_weather", "arguments": {"city": city}}}  # noqa: E731
    rows = [{"messages": ask(c) + [{"role": "assistant", "content": None, "tool_calls": [call(c)]}], "tools": [WEATHER]}
            for c in CITIES]
    rows += [{"messages": [{"role": "user", "content": f"Hi {c}"}, {"role": "assistant", "content": f"Hello {c}"}],
              "tools": [WEATHER]} for c in CITIES]
    write_jsonl(str(root / "data" / "train.jsonl"), rows * 8)
    write_jsonl(str(root / "data" / "valid.jsonl"), rows[:2])
    run = str(root / "run")
    run_training(TrainConfig(model=model, data=str(root / "data"), out=run, method="full", steps=300, batch_size=8,
                             seq_len=192, lr=3e-3, eval_every=0, save_every=0, seed=0))
    s = Server(run)
    yield s, run, request.param
    assert s.stop() == 0, "".join(s.log)


def test_a_call_comes_back_as_tool_calls_whole_and_streamed(served):
    server, _, form = served
    r = server.client.chat.completions.create(model="run", messages=ask("Oslo"), tools=[WEATHER],
                                              max_tokens=80, temperature=0)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    [call] = c.message.tool_calls
    assert call.type == "function"
    assert (len(call.id) == 9 and call.id.isalnum()) if form == "list" else call.id.startswith("call_")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Oslo"}
    calls, text, finish = {}, "", None
    for chunk in server.client.chat.completions.create(model="run", messages=ask("Lima"), tools=[WEATHER],
                                                       max_tokens=80, temperature=0, stream=True):
        delta = chunk.choices[0].delta
        text += delta.content or ""
        for tc in delta.tool_calls or []:
            calls[tc.index] = tc
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and not text.strip() and list(calls) == [0]
    assert calls[0].function.name == "get_weather" and json.loads(calls[0].function.arguments) == {"city": "Lima"}


def test_the_call_is_the_model_s_own_text_read_and_plain_replies_stay_text(served):
    """Positive control: the same prompt through /v1/completions (no reading for calls) is
    the <tool_call> block the model wrote; a reply without a call is content."""
    server, run, form = served
    tok = load_for_inference(run)[1]
    raw = server.client.completions.create(model="run", prompt=encode_chat(tok, ask("Rome"), tools=[WEATHER]),
                                           max_tokens=80, temperature=0).choices[0].text
    assert raw.strip() == RAW_CALL[form]
    r = server.client.chat.completions.create(model="run", messages=[{"role": "user", "content": "Hi Rome"}],
                                              tools=[WEATHER], max_tokens=12, temperature=0)
    assert r.choices[0].message.content == "Hello Rome" and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"


def test_an_agent_s_second_turn_sends_the_call_and_its_result_back(served):
    """The assistant's call (content null) and the tool's result render through the template:
    the prompt the server reads is the one the template makes of them."""
    server, run, _ = served
    first = server.client.chat.completions.create(model="run", messages=ask("Paris"), tools=[WEATHER],
                                                  max_tokens=80, temperature=0).choices[0].message
    call = first.tool_calls[0]
    history = ask("Paris") + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "name": "get_weather", "content": "{\"temp\": 22}"}]
    r = server.client.chat.completions.create(model="run", messages=history, tools=[WEATHER], max_tokens=8,
                                              temperature=0)
    tok = load_for_inference(run)[1]
    want = encode_chat(tok, history, tools=[WEATHER])
    assert "<tool_response>\n{\"temp\": 22}\n</tool_response>" in tok.decode(want)
    assert r.usage.prompt_tokens == len(want)


TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]},
                                                                        "hours": {"type": "integer"}},
                                       "required": ["zone", "hours"], "additionalProperties": False}}}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_tool_choice_forces_a_call_whose_arguments_match_the_tool_s_schema(served, choice):
    """"Hi Rome" is answered in text when the model decides (the control, in the test above);
    tool_choice "required" or a named function makes the reply a call (constrained decoding),
    its arguments valid for the tool's parameters."""
    server, _, _ = served
    msgs = [{"role": "user", "content": "Hi Rome"}]
    for stream in (False, True):
        r = server.client.chat.completions.create(model="run", messages=msgs, tools=[WEATHER, TIME], tool_choice=choice,
                                                  max_tokens=120, temperature=0, stream=stream)
        if stream:
            calls, finish = {}, None
            for chunk in r:
                for tc in chunk.choices[0].delta.tool_calls or []:
                    calls[tc.index] = tc
                finish = chunk.choices[0].finish_reason or finish
            calls = [calls[k] for k in sorted(calls)]
        else:
            calls, finish = r.choices[0].message.tool_calls, r.choices[0].finish_reason
        assert finish == "tool_calls" and calls
        for call in calls:
            args = json.loads(call.function.arguments)
            if isinstance(choice, dict):
                assert call.function.name == "get_time"
            if call.function.name == "get_time":
                jsonschema.validate(args, TIME["function"]["parameters"])
            else:
                jsonschema.validate(args, WEATHER["function"]["parameters"])


def test_tools_a_template_cannot_show_and_unsupported_choices_get_400(served, tmp_path):
    server, _, _ = served
    named = {"type": "function", "function": {"name": "nope"}}
    for bad, param in [(dict(tool_choice=named), "tool_choice"), (dict(tool_choice="always"), "tool_choice"),
                       (dict(tools=[{"type": "function"}]), "tools"), (dict(tools="nope"), "tools"),
                       (dict(tool_choice="required", response_format={"type": "json_object"}), "tool_choice")]:
        kw = dict(model="run", messages=ask("Oslo"), max_tokens=4, **{"tools": [WEATHER], **bad})
        with pytest.raises(openai.BadRequestError) as e:
            server.client.chat.completions.create(**kw)
        assert e.value.body["param"] == param, e.value.body
    plain = Server(write_tiny_model_folder(str(tmp_path / "plain")))  # ChatML without a tools block
    try:
        with pytest.raises(openai.BadRequestError) as e:
            plain.client.chat.completions.create(model="plain", messages=ask("Oslo"), tools=[WEATHER], max_tokens=4)
        assert e.value.body["param"] == "tools" and "no tools" in e.value.body["message"]
        r = plain.client.chat.completions.create(model="plain", messages=ask("Oslo"), tools=[WEATHER],
                                                 tool_choice="none", max_tokens=4)
        assert r.choices[0].finish_reason in ("stop", "length")
    finally:
        assert plain.stop() == 0
