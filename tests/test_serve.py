"""`mlxtoy serve` driven by the real `openai` client: a tiny model and two LoRA runs made by
`train`, served on a free localhost port by the CLI in a subprocess."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import jsonschema
import numpy as np
import openai
import pytest
import torch
import transformers

from helpers_serve import Server
from helpers_train import qa_rows, run_cli, run_training, write_jsonl, write_tiny_model_folder
from mlxtoy.config import TrainConfig
from mlxtoy.engine import generate_batch
from mlxtoy.generate import generate_tokens
from mlxtoy.inference import load_for_inference, load_for_serving
from mlxtoy.models.adapters import AdapterBank
from mlxtoy.models.quant import QUANTIZED_TYPES

PROMPTS = ["12+1", "the keeper of the lighthouse", "47+1", "abc", "Once upon", "88+1", "x", "q: 3+1"]


def _train(root, model, data, name, seed, targets):
    cfg = TrainConfig(model=model, data=data, out=str(root / name), method="lora", steps=30, batch_size=4,
                      seq_len=64, lr=3e-2, eval_every=0, save_every=0, lora_targets=targets, seed=seed)
    run_training(cfg)
    return str(root / name)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    model = write_tiny_model_folder(str(root / "model"))
    data = root / "data"
    write_jsonl(str(data / "train.jsonl"), qa_rows(64, seed=1))
    write_jsonl(str(data / "valid.jsonl"), qa_rows(8, seed=2))
    a = _train(root, model, str(data), "run_a", 1, ["q", "v"])
    b = _train(root, model, str(data), "run_b", 2, ["o", "down"])
    return {"model": model, "a": a, "b": b}


@pytest.fixture(scope="module")
def server(work):
    s = Server(work["model"], "--adapter", "a=" + work["a"], "--adapter", "b=" + work["b"])
    yield s
    assert s.stop() == 0, "".join(s.log)


def generate_cli(work, prompt, adapter=None, chat=False, n=24) -> str:
    args = ["generate", "--model", work["model"], "--prompt", prompt, "--max-tokens", str(n)]
    args += ["--adapter", work[adapter]] if adapter else []
    args += ["--chat"] if chat else []
    r = run_cli(*args)
    assert r.returncode == 0, r.stderr
    return r.stdout


def complete(server, model, prompt, n=24, stream=False) -> str:
    c = server.client.completions.create(model=model, prompt=prompt, max_tokens=n, temperature=0, stream=stream)
    if stream:
        return "".join(chunk.choices[0].text for chunk in c if chunk.choices)
    return c.choices[0].text


def test_models_and_health(server):
    assert [m.id for m in server.client.models.list()] == ["model", "a", "b"]
    assert server.client.models.retrieve("b").id == "b"
    with pytest.raises(openai.NotFoundError):
        server.client.models.retrieve("nope")
    assert server.health()["status"] == "ok"


@pytest.mark.core
@pytest.mark.parametrize("model", ["model", "a", "b"])
def test_greedy_tokens_match_mlxtoy_generate(server, work, model):
    """Streamed and whole, completions and chat: the text `mlxtoy generate` prints. (In the
    MLX-only pass too: the server then exits cleanly, which a trace of a module-level compiled
    function outliving the engine thread's stream used to abort, `mlxtoy.models.compiled`.)"""
    adapter = None if model == "model" else model
    want = generate_cli(work, PROMPTS[0], adapter)
    assert complete(server, model, PROMPTS[0]) == want
    assert complete(server, model, PROMPTS[0], stream=True) == want
    want_chat = generate_cli(work, PROMPTS[1], adapter, chat=True)
    msgs = [{"role": "user", "content": PROMPTS[1]}]
    got = server.client.chat.completions.create(model=model, messages=msgs, max_tokens=24, temperature=0)
    assert got.choices[0].message.content == want_chat
    assert got.usage.completion_tokens > 0 and got.usage.prompt_tokens > len(PROMPTS[1])
    chunks = server.client.chat.completions.create(model=model, messages=msgs, max_tokens=24, temperature=0,
                                                   stream=True, stream_options={"include_usage": True})
    text, usage = "", None
    for chunk in chunks:
        text += "".join(c.delta.content or "" for c in chunk.choices)
        usage = chunk.usage or usage
    assert text == want_chat and usage.completion_tokens == got.usage.completion_tokens


def test_adapters_change_the_output(server):
    """Control for the batching test: the three models answer differently."""
    outs = {m: tuple(complete(server, m, p) for p in PROMPTS[:4]) for m in ("model", "a", "b")}
    assert len(set(outs.values())) == 3


def test_concurrent_clients_get_what_they_get_alone(server):
    """8 clients at once, base and both adapters mixed in the batch, half streaming."""
    jobs = [(("model", "a", "b")[i % 3], PROMPTS[i], i % 2 == 1) for i in range(8)]
    alone = [complete(server, m, p, n=40) for m, p, _ in jobs]
    got = [None] * 8
    assert server.health()["peak_rows"] == 1  # so far one request at a time
    barrier = threading.Barrier(8)

    def client(i):
        m, p, stream = jobs[i]
        barrier.wait()
        got[i] = complete(server, m, p, n=40, stream=stream)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == alone
    assert server.health()["peak_rows"] > 1  # they did share the batch


def test_sampling_fields_n_seed_and_logprobs(server, work):
    msgs = [{"role": "user", "content": "hi"}]
    r = server.client.chat.completions.create(model="a", messages=msgs, max_tokens=12, temperature=1.0, seed=5,
                                              n=3, logprobs=True, top_logprobs=3)
    again = server.client.chat.completions.create(model="a", messages=msgs, max_tokens=12, temperature=1.0,
                                                  seed=5, n=3, logprobs=True, top_logprobs=3)
    assert [c.message.content for c in r.choices] == [c.message.content for c in again.choices]
    assert len({c.message.content for c in r.choices}) > 1  # n choices draw differently
    for c in r.choices:
        for lp in c.logprobs.content:
            assert lp.logprob <= 0 and len(lp.top_logprobs) == 3
            assert lp.top_logprobs[0].logprob >= lp.logprob - 1e-5
    c = server.client.completions.create(model="model", prompt="abc", max_tokens=6, temperature=0, logprobs=2)
    assert len(c.choices[0].logprobs.token_logprobs) == c.usage.completion_tokens
    stop = complete(server, "model", PROMPTS[1], n=40)[5:8]
    s = server.client.completions.create(model="model", prompt=PROMPTS[1], max_tokens=40, temperature=0, stop=[stop])
    assert stop not in s.choices[0].text and s.choices[0].finish_reason == "stop"
    greedy = complete(server, "a", PROMPTS[1], n=24)
    top1 = server.client.completions.create(model="a", prompt=PROMPTS[1], max_tokens=24, temperature=1.0, seed=9,
                                            extra_body={"top_k": 1})
    assert top1.choices[0].text == greedy  # top_k 1 (beyond OpenAI's fields) leaves the argmax only
    pen = server.client.completions.create(model="a", prompt=PROMPTS[1], max_tokens=24, temperature=0,
                                           frequency_penalty=2.0, presence_penalty=1.0)
    assert pen.choices[0].text != greedy  # the penalties reach the sampler (the engine's test checks their values)
    tok = load_for_inference(work["model"])[1]
    z = tok.encode("Z")[0]
    forced = server.client.completions.create(model="a", prompt=PROMPTS[1], max_tokens=5, temperature=0,
                                              logit_bias={str(z): 100})
    assert forced.choices[0].text == "ZZZZZ"
    # the greedy first token, by its bytes (its text may be U+FFFD, which many tokens read as)
    msgs1 = [{"role": "user", "content": PROMPTS[1]}]
    first = server.client.chat.completions.create(model="a", messages=msgs1, max_tokens=1, temperature=0,
                                                  logprobs=True).choices[0].logprobs.content[0].bytes
    first_id = next(i for i in range(tok.vocab_size) if list(tok.decode_token_bytes(i)) == first)
    banned = server.client.chat.completions.create(model="a", messages=msgs1, max_tokens=1, temperature=0,
                                                   logprobs=True, logit_bias={str(first_id): -100})
    assert banned.choices[0].logprobs.content[0].bytes != first
    many = ["\x00never", "\x01never", "\x02never", "\x03never", "\x04never", stop]  # past OpenAI's 4
    s6 = server.client.completions.create(model="model", prompt=PROMPTS[1], max_tokens=40, temperature=0, stop=many)
    assert s6.choices[0].text == s.choices[0].text


def test_a_list_of_prompts_gets_each_prompt_s_choices_in_order(server, work):
    """OpenAI numbers prompt k's choice j k * n + j; each is what its prompt gets alone,
    whole and streamed, strings and token ids mixed."""
    tok = load_for_inference(work["model"])[1]
    prompts = [PROMPTS[0], tok.encode(PROMPTS[2]), PROMPTS[3]]
    alone = [complete(server, "a", p) for p in (PROMPTS[0], PROMPTS[2], PROMPTS[3])]
    assert len(set(alone)) == 3  # control: the prompts answer differently
    r = server.client.completions.create(model="a", prompt=prompts, n=2, max_tokens=24, temperature=0)
    assert [c.index for c in r.choices] == list(range(6))
    assert [c.text for c in r.choices] == [a for a in alone for _ in range(2)]
    assert r.usage.prompt_tokens == sum(len(tok.encode(p)) for p in (PROMPTS[0], PROMPTS[2], PROMPTS[3]))
    texts = [""] * 6
    for chunk in server.client.completions.create(model="a", prompt=prompts, n=2, max_tokens=24, temperature=0,
                                                  stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in r.choices]


def test_echo_with_logprobs_scores_the_prompt_as_transformers_does(server, work):
    """max_tokens 0, echo and logprobs (how lm-evaluation-harness asks for a log-likelihood):
    the prompt's text back, and each of its tokens' log-probability given the ones before it,
    as transformers computes them from the same folder."""
    tok = load_for_inference(work["model"])[1]
    text = PROMPTS[1] * 3
    ids = tok.encode(text)
    r = server.client.completions.create(model="model", prompt=text, max_tokens=0, echo=True, logprobs=2)
    c = r.choices[0]
    assert c.text == text and c.finish_reason == "length" and r.usage.completion_tokens == 0
    assert c.logprobs.token_logprobs[0] is None and len(c.logprobs.token_logprobs) == len(ids)
    ref = transformers.AutoModelForCausalLM.from_pretrained(work["model"], torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logp = torch.log_softmax(ref(torch.tensor([ids])).logits[0], dim=-1).numpy()
    want = [float(logp[t - 1, ids[t]]) for t in range(1, len(ids))]
    assert c.logprobs.token_logprobs[1:] == pytest.approx(want, abs=1e-4)
    # echo without logprobs: the prompt's text before the completion's, or alone with max_tokens 0
    bare = server.client.completions.create(model="model", prompt=text, max_tokens=0, echo=True)
    assert bare.choices[0].text == text and bare.choices[0].logprobs is None and bare.usage.completion_tokens == 0
    echoed = server.client.completions.create(model="model", prompt=PROMPTS[0], max_tokens=24, echo=True, temperature=0)
    assert echoed.choices[0].text == PROMPTS[0] + complete(server, "model", PROMPTS[0])
    # a harness's batch: several prompts in one request, read together, each as transformers scores it
    texts = [PROMPTS[0], text, PROMPTS[2] * 2]
    many = server.client.completions.create(model="model", prompt=texts, max_tokens=0, echo=True, logprobs=1)
    for t, choice in zip(texts, many.choices):
        ids_t = tok.encode(t)
        with torch.no_grad():
            lp_t = torch.log_softmax(ref(torch.tensor([ids_t])).logits[0], dim=-1).numpy()
        assert choice.text == t
        assert choice.logprobs.token_logprobs[1:] == pytest.approx(
            [float(lp_t[i - 1, ids_t[i]]) for i in range(1, len(ids_t))], abs=1e-4)
    # the two most likely at each place (fewer keys where both tokens' text is the same: a
    # byte-level tokenizer's invalid UTF-8 bytes all read "\ufffd")
    best = np.sort(logp[:-1], axis=-1)[:, -2:]
    for top, ref_best in zip(c.logprobs.top_logprobs[1:], best):
        assert 0 < len(top) <= 2 and all(np.abs(ref_best - v).min() < 1e-4 for v in top.values())


def test_echo_scores_an_adapter_s_continuation_as_it_decodes_it(server, work):
    """The scored prompt reads the adapter: its greedy continuation, generated with logprobs,
    scores the same when sent back as the prompt, each token the most likely there."""
    tok = load_for_inference(work["model"])[1]
    ids = tok.encode(PROMPTS[4])
    gen = server.client.completions.create(model="b", prompt=ids, max_tokens=10, temperature=0, logprobs=1, echo=True)
    g = gen.choices[0].logprobs
    assert g.token_logprobs[0] is None and len(g.token_logprobs) == len(ids) + 10
    model_b, _ = load_for_inference(None, work["b"])
    cont = [t for t, _ in generate_tokens(model_b, ids, max_tokens=10)]
    scored = server.client.completions.create(model="b", prompt=ids + cont, max_tokens=0, echo=True, logprobs=1)
    s = scored.choices[0].logprobs
    assert s.token_logprobs == pytest.approx(g.token_logprobs, abs=1e-4)
    for lp, top in zip(s.token_logprobs[len(ids):], s.top_logprobs[len(ids):]):
        assert max(top.values()) == pytest.approx(lp, abs=1e-6)
    base = server.client.completions.create(model="model", prompt=ids + cont, max_tokens=0, echo=True, logprobs=1)
    assert base.choices[0].logprobs.token_logprobs[len(ids):] != pytest.approx(s.token_logprobs[len(ids):], abs=1e-3)


def _error(fn):
    with pytest.raises(openai.APIStatusError) as e:
        fn()
    return e.value


def test_bad_requests_get_4xx_and_the_server_goes_on(server):
    c = server.client
    msgs = [{"role": "user", "content": "hi"}]
    e = _error(lambda: c.chat.completions.create(model="nope", messages=msgs))
    assert e.status_code == 404 and "nope" in e.message
    e = _error(lambda: c.completions.create(model="a", prompt="x", max_tokens=-3))
    assert e.status_code == 400 and e.body["param"] == "max_tokens"
    e = _error(lambda: c.completions.create(model="a", prompt="word " * 600, max_tokens=4))
    assert e.status_code == 400 and e.body["code"] == "context_length_exceeded" and "context" in e.message
    e = _error(lambda: c.completions.create(model="a", prompt=["x", "word " * 600], max_tokens=4))
    assert e.status_code == 400 and e.body["code"] == "context_length_exceeded" and "prompt[1]" in e.message
    e = _error(lambda: c.completions.create(model="a", prompt=["x", 3], max_tokens=4))
    assert e.status_code == 400 and e.body["param"] == "prompt"
    e = _error(lambda: c.completions.create(model="a", prompt="x", max_tokens=0))  # only with echo
    assert e.status_code == 400 and e.body["param"] == "max_tokens"
    e = _error(lambda: c.completions.create(model="a", prompt="x", max_tokens=4, stop=[str(i) for i in range(17)]))
    assert e.status_code == 400 and e.body["param"] == "stop"
    e = _error(lambda: c.completions.create(model="a", prompt="x", max_tokens=4, frequency_penalty=3))
    assert e.status_code == 400 and e.body["param"] == "frequency_penalty"
    e = _error(lambda: c.completions.create(model="a", prompt="x", max_tokens=4, logit_bias={"99999": 5}))
    assert e.status_code == 400 and e.body["param"] == "logit_bias"
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
        "n": {"$ref": "#/definitions/missing"}}}}}
    e = _error(lambda: c.chat.completions.create(model="a", messages=msgs, response_format=bad_schema))
    assert e.status_code == 400 and e.body["param"] == "response_format" and "schema" in e.message
    r = httpx.post(server.url + "/v1/completions", content=b'{"model": "a", "prompt": ', timeout=30)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    assert complete(server, "b", PROMPTS[2]) == complete(server, "b", PROMPTS[2])  # still serving


# a request that runs long whatever the weights: a JSON string of 480+ characters, one token each
LONG = {"type": "json_schema", "json_schema": {"name": "long", "schema": {"type": "string", "minLength": 480}}}


def test_a_client_that_disconnects_frees_its_row(server):
    before = server.health()["cancelled_rows"]
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={"model": "a", "prompt": "abc", "max_tokens": 500, "response_format": LONG,
                            "stream": True}) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(4)]
        assert any(line.startswith("data: ") for line in got)
        assert server.health()["rows"] == 1
    deadline = time.time() + 30
    while server.health()["rows"] and time.time() < deadline:
        time.sleep(0.01)
    h = server.health()
    assert h["rows"] == 0 and h["cancelled_rows"] == before + 1
    # a client waiting for the whole answer (16 choices) that gives up
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", timeout=httpx.Timeout(30, read=0.2),
                   json={"model": "b", "prompt": "abc", "max_tokens": 500, "response_format": LONG, "n": 16})
    deadline = time.time() + 30
    while server.health()["rows"] and time.time() < deadline:
        time.sleep(0.01)
    h = server.health()
    assert h["rows"] == 0 and h["cancelled_rows"] == before + 17


def test_response_format_output_validates(server):
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99}, "tags": {"type": "array", "items": {"enum": ["x", "y"]},
                                                                        "maxItems": 3}},
        "required": ["name", "ok", "n", "tags"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema, "strict": True}}
    for model, seed in (("model", 1), ("a", 2), ("b", 3)):
        r = server.client.chat.completions.create(model=model, messages=[{"role": "user", "content": "a thing"}],
                                                  response_format=fmt, max_tokens=200, temperature=1.0, seed=seed)
        value = json.loads(r.choices[0].message.content)
        jsonschema.validate(value, schema)
        assert r.choices[0].finish_reason == "stop"
    # control: the same requests without the format are not such JSON
    r = server.client.chat.completions.create(model="model", messages=[{"role": "user", "content": "a thing"}],
                                              max_tokens=60, temperature=1.0, seed=1)
    with pytest.raises((json.JSONDecodeError, jsonschema.ValidationError)):
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_ctrl_c_drains_the_requests_in_flight_and_exits(work):
    def long_stream(server) -> str:
        chunks = server.client.completions.create(model="model", prompt="abc", max_tokens=500, temperature=0,
                                                  stream=True, extra_body={"response_format": LONG})
        return "".join(c.choices[0].text for c in chunks if c.choices)

    s = Server(work["model"])
    out = {}
    t = threading.Thread(target=lambda: out.update(text=long_stream(s)))
    t.start()
    deadline = time.time() + 30
    while s.health()["rows"] == 0 and time.time() < deadline:
        time.sleep(0.002)
    assert s.health()["rows"] == 1  # in flight when Ctrl-C comes
    s.proc.send_signal(signal.SIGINT)
    t.join(60)
    assert s.proc.wait(60) == 0, "".join(s.log)
    with pytest.raises(httpx.ConnectError):  # no longer listening
        httpx.get(s.url + "/health")
    alone = Server(work["model"])
    try:
        assert len(out["text"]) > 480 and out["text"] == long_stream(alone)  # the whole answer
    finally:
        alone.stop()


def test_a_qlora_runs_base_stays_quantized_when_served(work, tmp_path):
    """The base of a QLoRA run is served as it trained (4-bit, adapters unmerged on top) and
    a row reading the run samples what `generate --adapter RUN` samples."""
    run = str(tmp_path / "q")
    run_training(TrainConfig(model=work["model"], data=os.path.join(os.path.dirname(work["a"]), "data"),
                             out=run, method="lora", qlora="on", steps=6, batch_size=4, seq_len=64, lr=3e-2,
                             eval_every=0, save_every=0, lora_targets=["q", "v", "down"], seed=3))
    model, tok, names = load_for_serving(work["model"], ["q=" + run])
    assert names == ["model", "q"]
    banks = [m for _, m in model.named_modules() if isinstance(m, AdapterBank)]
    assert banks and all(isinstance(b.base, QUANTIZED_TYPES) for b in banks)
    assert all(isinstance(layer.attn.k, QUANTIZED_TYPES) for layer in model.layers)  # untargeted: 4-bit too
    alone, tok2 = load_for_inference(None, run)
    prompt = tok.encode("12+1")
    want = [t for t, _ in generate_tokens(alone, prompt, max_tokens=16)]
    assert generate_batch(model, [prompt], max_tokens=16, adapter=1)[0] == want
    assert generate_batch(model, [prompt], max_tokens=16, adapter=0)[0] != want  # control: the base alone


def test_a_shared_prefix_is_read_from_the_prompt_cache(server, work):
    system = "You keep the lighthouse and answer with one number only."
    msgs = [{"role": "system", "content": system}]
    first = server.client.chat.completions.create(model="a", messages=msgs + [{"role": "user", "content": "12+1"}],
                                                  max_tokens=12, temperature=0)
    second = server.client.chat.completions.create(model="a", messages=msgs + [{"role": "user", "content": "47+1"}],
                                                   max_tokens=12, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens < 16
    assert second.usage.prompt_tokens_details.cached_tokens >= len(system)  # a byte-level tokenizer
    r = run_cli("generate", "--model", work["model"], "--adapter", work["a"], "--chat", "--system", system,
                "--prompt", "47+1", "--max-tokens", "12")
    assert r.returncode == 0 and second.choices[0].message.content == r.stdout
    other = server.client.chat.completions.create(model="b", messages=msgs + [{"role": "user", "content": "47+1"}],
                                                  max_tokens=12, temperature=0)
    assert other.usage.prompt_tokens_details.cached_tokens < 16  # another adapter's K/V differ: not shared
