"""`python -m deepinfer_core.serve` refuses engine options it cannot serve, before any model load."""

from __future__ import annotations

import pytest

from deepinfer_core.serve import __main__ as serve_main


@pytest.mark.parametrize(
    "flags", [["--data-parallel-size", "2"], ["--data-parallel-size", "4", "--enable-expert-parallel"]]
)
def test_data_parallel_is_refused_at_start(flags, capsys, monkeypatch):
    def no_load(*args, **kwargs):
        raise AssertionError("the server loaded a model despite the refusal")

    monkeypatch.setattr("deepinfer_core.api.llm.LLM.__init__", no_load)
    assert serve_main.main(["--model", "/nonexistent", *flags]) == 2
    err = capsys.readouterr().err
    assert f"--data-parallel-size {flags[1]}: not supported by the server yet" in err
    assert "use LLM(..., data_parallel_size=...) or the CLI" in err


def test_data_parallel_size_1_is_not_refused():
    assert serve_main.refusal({"data_parallel_size": 1}) is None
    assert serve_main.refusal({}) is None
