"""Shared fixtures of the live-server tests: the bundled model's directory, free ports, and servers
started in this process (uvicorn in a thread, the engine loop in its own) and stopped with the module."""
from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator

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
