"""The Runs screen serves the selected run (`v`): `mlxtoy serve` in a child process, answering
the OpenAI API; `v` again stops it."""

from __future__ import annotations

import asyncio
import os
import time

import httpx

from helpers_train import qa_rows, run_training, write_jsonl, write_tiny_model_folder
from mlxtoy.config import TrainConfig
from tui.app import MlxtoyApp
from tui.runs import RunsScreen


def test_runs_screen_serves_the_selected_run(tmp_path, monkeypatch):
    model = write_tiny_model_folder(str(tmp_path / "model"))
    write_jsonl(str(tmp_path / "data" / "train.jsonl"), qa_rows(32, seed=1))
    run = tmp_path / "runs" / "demo"
    run_training(TrainConfig(model=model, data=str(tmp_path / "data"), out=str(run), method="lora", steps=2,
                             batch_size=2, seq_len=32, eval_every=0, save_every=0, lora_targets=["q", "v"]))
    monkeypatch.chdir(tmp_path)

    async def main():
        app = MlxtoyApp(model=model, data=None, runs_dir="runs")
        async with app.run_test(size=(100, 32)) as pilot:
            await pilot.press("f4")
            await pilot.pause(0.5)
            screen = app.screen
            assert isinstance(screen, RunsScreen) and screen.selected is not None
            await pilot.press("v")
            t0 = time.monotonic()
            while (screen.server is None or screen.server.url is None) and time.monotonic() - t0 < 120:
                await pilot.pause(0.2)
            server = screen.server
            assert server is not None and server.url, list(server.tail) if server else None
            async with httpx.AsyncClient(timeout=60) as client:
                models = (await client.get(server.url + "/v1/models")).json()
                assert [m["id"] for m in models["data"]] == ["model", "demo"]
                r = await client.post(server.url + "/v1/completions",
                                      json={"model": "demo", "prompt": "12+1", "max_tokens": 5, "temperature": 0})
                assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
            await pilot.press("v")
            assert await server.wait(60) == 0 and screen.server is None

    asyncio.run(main())
    assert os.path.isdir(run)
