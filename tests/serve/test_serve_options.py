"""`python -m deepinfer_core.serve` refuses engine options the engine cannot run, with the engine's
message naming both settings and exit status 2, before any rank starts (what DataParallelLLM does not
build yet: GPU devices with data parallelism; settings that need another one)."""

from __future__ import annotations

import pytest

from deepinfer_core.serve import __main__ as serve_main


@pytest.mark.parametrize(
    "flags,message",
    [
        (
            ["--data-parallel-size", "2", "--num-redundant-experts", "2"],
            "num_redundant_experts=2 needs enable_expert_parallel",
        ),
        (["--data-parallel-size", "2", "--device", "cuda"], "data_parallel_size=2 with device='cuda'"),
    ],
)
def test_unsupported_data_parallel_options_are_refused_at_start(flags, message, capsys, monkeypatch):
    def no_rank(*args, **kwargs):
        raise AssertionError("a data-parallel rank started despite the refusal")

    monkeypatch.setattr("deepinfer_core.parallel.dp_engine.DataParallelLLM._start", no_rank)
    assert serve_main.main(["--model", "/nonexistent", *flags]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags,expected",
    [
        ([], None),  # this machine's platform is the CPU: the engine thread
        (["--device", "cuda"], True),  # the engine process (faster behind the server)
        (["--device", "cuda", "--no-engine-process"], False),
        (["--engine-process"], True),
        (["--no-engine-process"], False),
    ],
)
def test_the_server_runs_a_cuda_engine_in_its_own_process_by_default(flags, expected, monkeypatch):
    monkeypatch.delenv("DEEPINFER_ACCELERATOR", raising=False)
    args = serve_main.build_parser().parse_args(flags)
    assert serve_main.server_engine_options(args).get("engine_process") is expected
