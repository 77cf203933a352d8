"""Fixtures for the server tests.

* ``tiny_dir`` / ``tiny``: a tiny random qwen3_moe model written once per session and loaded once.
* ``make_engine`` / ``live_app``: the real app (``create_app``) around that model, served by
  uvicorn in a thread on a free port (fast: no model reload per test).
* ``server``: one real subprocess server (``python -m ktransformers.server``) for the session.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
MODEL_NAME = "tiny-qwen3-moe"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    from ktransformers.util.tiny_models import write_tiny_model

    d = tmp_path_factory.mktemp("models") / MODEL_NAME
    write_tiny_model("qwen3_moe", d, max_position_embeddings=2048)
    return d


@pytest.fixture(scope="session")
def tiny(tiny_dir):
    from transformers import AutoTokenizer

    from ktransformers import load_model

    model = load_model(tiny_dir / "model.safetensors", tiny_dir, device="cpu")
    tok = AutoTokenizer.from_pretrained(str(tiny_dir))
    return model, tok


@pytest.fixture
def make_engine(tiny):
    from ktransformers.generation import Generator
    from ktransformers.server.engine import Engine, SamplingDefaults

    def make(generator=None, *, max_context=2048, max_queue=4, max_new_tokens=16, **kw):
        model, tok = tiny
        gen = generator if generator is not None else Generator(model, tok, max_cache_len=max_context)
        return Engine(gen, tok, model_name=MODEL_NAME, max_context=max_context, max_queue=max_queue,
                      defaults=SamplingDefaults(max_new_tokens=max_new_tokens, **kw),
                      model_info={"family": "qwen3_moe", "format": "safetensors", "size": 1,
                                  "parameter_count": 1, "parameter_size": "0.0M", "quantization": "F32"})

    return make


class LiveServer:
    """A uvicorn server in a thread, for apps built in-process."""

    def __init__(self, app):
        import uvicorn

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("in-process server did not start")
            time.sleep(0.02)

    def close(self):
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture
def live_app(tmp_path, make_engine):
    """``with live_app(engine=None, **settings) as srv:`` → a running in-process server."""
    from ktransformers.server import Settings, create_app

    @contextmanager
    def run(engine=None, **settings):
        engine = engine or make_engine()
        settings.setdefault("data_dir", str(tmp_path / "data"))
        app = create_app(engine, Settings(**settings))
        srv = LiveServer(app)
        srv.engine = engine
        srv.app = app
        try:
            yield srv
        finally:
            srv.close()

    return run


def start_server(model_dir: Path, data_dir: Path, log: Path, *extra: str, port: int | None = None):
    port = port or free_port()
    cmd = [sys.executable, "-m", "ktransformers.server", "--model_path", str(model_dir), "--port", str(port),
           "--data_dir", str(data_dir), "--max_new_tokens", "16", "--cpu_infer", "1", *extra]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(log, "ab") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.time() > deadline:
            proc.kill()
            raise RuntimeError(f"server did not come up:\n{log.read_text()[-3000:]}")
        time.sleep(0.25)
    return proc, url


def stop_server(proc) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


class ServerInfo:
    def __init__(self, proc, url, data_dir, log):
        self.proc, self.url, self.data_dir, self.log = proc, url, data_dir, log
        self.port = int(url.rsplit(":", 1)[1])


@pytest.fixture(scope="session")
def server(tiny_dir, tmp_path_factory):
    """One subprocess server for the session (web page on, no API key)."""
    base = tmp_path_factory.mktemp("server")
    log = base / "server.log"
    proc, url = start_server(tiny_dir, base / "data", log, "--web", "--model_name", MODEL_NAME)
    yield ServerInfo(proc, url, base / "data", log)
    stop_server(proc)


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c
