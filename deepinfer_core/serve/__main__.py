"""python -m deepinfer_core.serve [--model PATH] [engine flags] [--host 127.0.0.1 --port 8000 --api-key KEY]

Serves `/v1/models`, `/v1/completions`, `/v1/chat/completions`, `/tokenize`, `/detokenize`, `/health`,
`/metrics` and `/reset_prefix_cache` over the engine,
which steps in a thread of its own (engine_loop.py). Without --model: DEEPINFER_HF_MODEL_DIR, else the
bundled tiny model, as `LLM()`. `--data-parallel-size N [--enable-expert-parallel]`: N engine processes
(CPU ranks over gloo, parallel/dp_engine.py), requests placed on the least-loaded rank; with
`--launcher torchrun` one per torchrun process (the same command on every rank): global rank 0 serves,
the others run their engines and exit 0 once it stops them.
The engine runs in one child process on a CUDA device (`--no-engine-process`: a thread here
instead): there the engine's host path is the bottleneck, and HTTP work in the same process would
share its GIL (docs/serving.md; 0.91 against 0.80 of offline throughput at concurrency 256 on the
H200). On a CPU the thread is the default (the model's own compute, not the GIL, bounds it; one
process starts faster).
"""
from __future__ import annotations

import argparse
import contextlib
import signal
import sys

from ..generate import _add_engine_flags, engine_options_from_args
from ..plugin_context import PluginError

PROG = "python -m deepinfer_core.serve"


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    srv = ap.add_argument_group("server")
    srv.add_argument("--model", default=None, help="checkpoint directory (default: as LLM())")
    srv.add_argument("--served-model-name", default=None, help="the name clients pass as `model` (default: --model)")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on every route but /health")
    srv.add_argument("--max-requests", type=int, default=1024,
                     help="requests admitted at once (running + waiting); more get 503 with Retry-After")
    srv.add_argument("--shutdown-timeout", type=float, default=30.0,
                     help="on SIGTERM / Ctrl-C: stop admitting, let running requests finish for this many "
                          "seconds, then abort the rest and exit 0")
    _add_engine_flags(ap)
    return ap


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            """SIGINT / SIGTERM start uvicorn's graceful shutdown, after which the process exits 0
            (uvicorn itself re-raises the signal once it has shut down)."""
            previous = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for s, handler in previous.items():
                    signal.signal(s, handler)

    return Server


def server_engine_options(args: argparse.Namespace) -> dict:
    """The engine flags given, and the server's default for the one not given: `engine_process` on
    when the engine's device is CUDA (the module docstring says why)."""
    options = engine_options_from_args(args)
    if "engine_process" not in options:
        from ..plugins import get_plugin_manager
        device = options.get("device") or get_plugin_manager().detect_platform().device_type
        options["engine_process"] = str(device).startswith("cuda") or None
    return options


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    """`prog`: the command's name in the help and the messages (`deepinfer serve` from the CLI)."""
    args = build_parser(prog).parse_args(argv)
    try:
        import uvicorn

        from .app import build_app
    except ImportError as exc:
        print(f"{prog}: {exc.name} is missing; pip install 'deepinfer-core[server]'",
              file=sys.stderr)
        return 2
    from ..api.llm import LLM
    from .engine_loop import EngineLoop
    # --data-parallel-size N: the ranks start here (spawned); the engine thread drives their front end
    try:
        llm = LLM(model=args.model, **server_engine_options(args))
    except (ValueError, PluginError) as exc:   # refused options (e.g. DP with speculation), no platform
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    loop = EngineLoop(llm.serving_engine(), max_requests=args.max_requests)
    loop.start()
    name = args.served_model_name or args.model or str(llm.model_dir)
    try:
        server_class = _server_class()
        config = uvicorn.Config(build_app(llm, loop, name, args.api_key), host=args.host, port=args.port,
                                log_level="info", timeout_graceful_shutdown=args.shutdown_timeout)
        server_class(config).run()
    finally:
        loop.stop(timeout=30)
        llm.close()               # under data parallelism: the ranks leave (killed if they do not in time)
    return 0


if __name__ == "__main__":
    sys.exit(main())
