"""`mlxtoy serve` in a subprocess on a free localhost port, with the real `openai` client."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai

from helpers_train import REPO


class Server:
    """`mlxtoy serve ...` in a subprocess on a free port."""

    def __init__(self, *args: str):
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "mlxtoy", "serve", *args, "--port", "0"],
                                     cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
        self.log: list[str] = []
        self.url = None
        deadline = time.time() + 120
        while self.url is None:
            line = self.proc.stderr.readline()
            if not line:
                raise RuntimeError("the server ended: " + "".join(self.log))
            self.log.append(line)
            if line.startswith("serving on "):
                self.url = line.split()[-1]
            if time.time() > deadline:
                raise RuntimeError("the server did not start: " + "".join(self.log))
        threading.Thread(target=lambda: self.log.extend(self.proc.stderr), daemon=True).start()
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=120)

    def health(self) -> dict:
        return httpx.get(self.url + "/health").json()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        return self.proc.wait(60)
