"""`python -m deepinfer_core.serve` refuses engine options the engine cannot run, with the engine's
message naming both settings and exit status 2, before any rank starts (what DataParallelLLM does not
build yet: speculative decoding and GPU devices with data parallelism)."""

from __future__ import annotations

import pytest

from deepinfer_core.serve import __main__ as serve_main


@pytest.mark.parametrize(
    "flags,message",
    [
        (
            ["--data-parallel-size", "2", "--num-speculative-tokens", "2", "--enable-mtp-varlen"],
            "data_parallel_size=2 with enable_mtp_varlen=True",
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
