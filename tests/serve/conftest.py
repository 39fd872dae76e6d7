"""Shared fixtures of the live-server tests: the bundled model's directory, free ports, servers started
in this process (uvicorn in a thread, the engine loop in its own) and stopped with the module, and the
checks of a `deepinfer serve` subprocess (start-up, SIGTERM in the middle of a stream)."""
from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest
import uvicorn

from deepinfer_core.serve.app import build_app
from deepinfer_core.serve.engine_loop import EngineLoop
from deepinfer_core.tools.bundled_model import bundled_tiny_model_dir


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def free_port() -> Callable[[], int]:
    return _free_port


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(bundled_tiny_model_dir(tmp_path_factory.mktemp("bundled")))


@contextlib.contextmanager
def _running(llm, max_requests: int, model: str, api_key: str) -> Iterator[tuple[str, EngineLoop]]:
    loop = EngineLoop(llm.serving_engine(), max_requests=max_requests)
    loop.start()
    port = _free_port()
    srv = uvicorn.Server(uvicorn.Config(build_app(llm, loop, model, api_key=api_key), host="127.0.0.1",
                                        port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not srv.started:
        assert time.time() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}", loop
    finally:
        srv.should_exit = True
        thread.join(30)
        loop.stop(30)


@pytest.fixture(scope="module")
def start_server() -> Iterator[Callable[..., tuple[str, EngineLoop]]]:
    """start_server(llm, max_requests, model, api_key) -> (url, engine loop), stopped with the module."""
    with contextlib.ExitStack() as stack:
        yield lambda llm, max_requests, model, api_key: stack.enter_context(_running(llm, max_requests, model,
                                                                                     api_key))


class ConsoleServer:
    """Checks of a `deepinfer serve` subprocess."""

    @staticmethod
    def wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float) -> None:
        """Until /health answers 200; a server that exits or takes longer than `timeout_s` fails."""
        deadline = time.time() + timeout_s
        while True:
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.time() < deadline, "the server did not start"
            time.sleep(0.2)

    @staticmethod
    def sigterm_mid_stream(proc: subprocess.Popen, url: str, model: str, prompt: str) -> None:
        """SIGTERM after a stream's first event: the stream still finishes, the server exits 0."""
        body = dict(model=model, prompt=prompt, max_tokens=48, ignore_eos=True, stream=True)
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data:")]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][5:])["choices"][0]["finish_reason"] == "length"
        assert proc.wait(120) == 0


@pytest.fixture(scope="module")
def console_server() -> type[ConsoleServer]:
    return ConsoleServer
