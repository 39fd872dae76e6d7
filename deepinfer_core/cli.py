"""The `deepinfer` command: every tool of the engine behind one entry point, as `vllm` has.

    deepinfer serve | generate | chat | bench {throughput,serve,sweep,latency} | plugins | env

A command's flags belong to the module that runs it: `deepinfer generate ARGS` is
`python -m deepinfer_core.generate ARGS` (its `main(ARGS)`), and so are `serve`
(deepinfer_core.serve), `plugins` (deepinfer_core.plugins), `chat` (chat_cli.py), `env`
(env_report.py) and `bench latency` (bench_latency.py). `bench throughput|serve|sweep` run the
scripts of the source repository's benchmarks/ folder (found beside this package in a checkout or
an editable install; an installed wheel has none).
"""
from __future__ import annotations

import argparse
import runpy
import sys
from collections.abc import Callable, Sequence

from . import __version__

PROG = "deepinfer"
BENCH_SCRIPTS = {"throughput": "throughput.py", "serve": "serve_bench.py", "sweep": "sweep.py"}


# ---- the commands: each takes the arguments after its name and returns the exit status ---------
def _serve(argv: list[str]) -> int:
    from .serve.__main__ import main
    return main(argv, prog=f"{PROG} serve")


def _generate(argv: list[str]) -> int:
    from .generate import main
    return main(argv, prog=f"{PROG} generate")


def _chat(argv: list[str]) -> int:
    from .chat_cli import main
    return main(argv)


def _plugins(argv: list[str]) -> int:
    from .plugins import main
    return main(argv, prog=f"{PROG} plugins")


def _env(argv: list[str]) -> int:
    from .env_report import main
    return main(argv)


def _bench_latency(argv: list[str]) -> int:
    from .bench_latency import main
    return main(argv)


def run_bench_script(name: str, argv: list[str]) -> int:
    """Run benchmarks/<script> of the source checkout as `python benchmarks/<script> ARGS` would
    (as __main__, with its folder first on sys.path); 2 with one line when there is no checkout."""
    from .env_report import source_checkout
    root = source_checkout()
    if root is None:
        print(f"{PROG} bench {name}: the benchmark scripts ship with the source repository, not "
              f"with the installed package: run it from a clone (pip install -e . there), or use "
              f"`{PROG} bench latency`, which the package includes", file=sys.stderr)
        return 2
    script = root / "benchmarks" / BENCH_SCRIPTS[name]
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [str(script), *argv]
    sys.path.insert(0, str(script.parent))
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exc:         # --help, argparse errors, the script's own exit
        code = exc.code
        if code is None or isinstance(code, int):
            return code or 0
        print(code, file=sys.stderr)
        return 1
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    return 0


def _bench_script(name: str) -> Callable[[list[str]], int]:
    return lambda argv: run_bench_script(name, argv)


# (name, one-line help, runner); bench's runners are its benchmarks'
COMMANDS: tuple[tuple[str, str, Callable[[list[str]], int] | None], ...] = (
    ("serve", "serve a model over an OpenAI-compatible HTTP API", _serve),
    ("generate", "generate completions offline (prompts as flags or in a file)", _generate),
    ("chat", "chat in the terminal with a local model or a server (--url)", _chat),
    ("bench", "benchmarks: throughput, serve, sweep, latency", None),
    ("plugins", "list the plugins (backends, features) and the active backend", _plugins),
    ("env", "print what a bug report needs (versions, GPUs, plugins, ...)", _env),
)
BENCHMARKS: tuple[tuple[str, str, Callable[[list[str]], int]], ...] = (
    ("throughput", "offline throughput (benchmarks/throughput.py)", _bench_script("throughput")),
    ("serve", "online serving over HTTP (benchmarks/serve_bench.py)", _bench_script("serve")),
    ("sweep", "prefill / decode step sweep (benchmarks/sweep.py)", _bench_script("sweep")),
    ("latency", "end-to-end latency of one batch through LLM.generate", _bench_latency),
)


class _Formatter(argparse.HelpFormatter):
    """One line per command: the help column leaves room for the longest name ("throughput"), which
    argparse does not measure (the commands are added after their group)."""

    def __init__(self, prog: str):
        super().__init__(prog)
        self._action_max_length = 16


def build_parser() -> argparse.ArgumentParser:
    """The command tree. A leaf parses nothing itself (no -h of its own): whatever follows its name
    goes to its runner, whose parser owns --help and the flags."""
    parser = argparse.ArgumentParser(prog=PROG, allow_abbrev=False, formatter_class=_Formatter,
                                     description="DeepInfer: an inference engine for the "
                                                 "DeepSeek-V4 model family.",
                                     epilog=f"`{PROG} COMMAND --help` lists a command's flags.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)
    for name, help_text, runner in COMMANDS:
        if runner is not None:
            commands.add_parser(name, help=help_text, add_help=False).set_defaults(runner=runner)
            continue
        bench = commands.add_parser(name, help=help_text, formatter_class=_Formatter,
                                    description="Benchmarks (like `vllm bench`).",
                                    epilog=f"`{PROG} bench BENCHMARK --help` lists a benchmark's "
                                           "flags.")
        benchmarks = bench.add_subparsers(title="benchmarks", metavar="BENCHMARK", required=True)
        for b_name, b_help, b_runner in BENCHMARKS:
            benchmarks.add_parser(b_name, help=b_help, add_help=False).set_defaults(runner=b_runner)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args, rest = parser.parse_known_args(argv)
        if rest != argv[len(argv) - len(rest):]:     # an unknown flag before the command's name
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
    except SystemExit as exc:      # --help / --version (0), a missing or unknown command (2)
        return exc.code if isinstance(exc.code, int) else 2
    return args.runner(rest)


if __name__ == "__main__":
    sys.exit(main())
