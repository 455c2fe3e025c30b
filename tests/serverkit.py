"""A real sfi server on 127.0.0.1 in a thread, for the server tests."""

from __future__ import annotations

import socket
import threading
import time

import openai
import uvicorn

from sfi import SFIConfig
from sfi.server.app import create_app
from sfi.server.engine import Engine

CONFIG = SFIConfig(sink=2, recent=8, k_head=8, force_sparse=True, min_refresh_gap=2)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model, tokenizer, name="tiny", max_batch=4, max_queue=8,
                 request_timeout=None, prefill_chunk=128, max_stall=0.4, max_kv_tokens=None,
                 config=CONFIG, **app_options):
        self.engine = Engine(model, tokenizer, config, max_batch=max_batch, max_queue=max_queue,
                             request_timeout=request_timeout, prefill_chunk=prefill_chunk,
                             max_stall=max_stall, max_kv_tokens=max_kv_tokens)
        self.port = _free_port()
        app = create_app(self.engine, name, 2048, **app_options)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.engine.start()
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started and time.time() < deadline:
            time.sleep(0.05)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.engine.stop()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, api_key: str = "none") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0)
