"""Batch invariance on the CPU backend (`features/batch_invariant`): the same requests give bitwise the
same tokens and logprobs alone, in batches of 2..256 with random other requests at shuffled positions,
and with chunked-prefill sizes 1..512 (float32; a subset in bfloat16, see SCENARIOS); a seeded sampled
request among random traffic gives one output; the settings that would break invariance are refused
by name."""
from __future__ import annotations

import random

import pytest

from deepinfer_batch_invariant.check import random_prompts, repeat_check, run_check
from deepinfer_core import LLM


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def invariant_llm(request, tiny_ckpt_dir):
    return LLM(model=str(tiny_ckpt_dir), dtype=request.param, batch_invariant=True, max_num_seqs=256)


def _targets(llm, n=8):
    # short prompts keep CI fast; they still span several CSA blocks and the 16-token window
    return random_prompts(n, random.Random(7), 12, 72, llm.vocab_size)


# float32 runs every scenario; bfloat16 (the same invariant kernels, another dtype) a subset, to keep
# CI within its time: an odd small batch, a large one, one tiny and one large prefill chunk
SCENARIOS = {"float32": ((2, 3, 8, 64, 256), (1, 5, 64, 512)), "bfloat16": ((3, 48), (5, 64))}


def test_logprobs_bitwise_equal_across_batches_and_chunks(invariant_llm):
    batch_sizes, chunk_sizes = SCENARIOS[str(invariant_llm.dtype).removeprefix("torch.")]
    report = run_check(invariant_llm, _targets(invariant_llm), batch_sizes=batch_sizes, chunk_sizes=chunk_sizes,
                       max_tokens=4, filler_len=(1, 32))
    print(report.table())
    assert report.batch_invariant
    tiny = sum(c < 16 for c in chunk_sizes)                        # tiny chunks run half the targets
    assert sum(s.runs for s in report.scenarios) == 8 * (1 + len(batch_sizes) + len(chunk_sizes) - tiny) + 4 * tiny
    assert report.all_equal, report.table()


def test_seeded_request_among_random_traffic_has_one_output(invariant_llm):
    got = repeat_check(invariant_llm, 8, batch_range=(1, 16), max_tokens=4, filler_len=(1, 48))   # the GPU test runs 1000
    assert got["runs"] == 8 and got["distinct_outputs"] == 1, got


def test_without_the_feature_float32_cpu_results_differ(tiny_ckpt_dir):
    """The check can fail: the default CPU path (a BLAS that picks its kernel by M, vectorised vs scalar
    sigmoid) changes a request's logprobs with its batch."""
    llm = LLM(model=str(tiny_ckpt_dir), dtype="float32", batch_invariant=False, max_num_seqs=64)
    report = run_check(llm, _targets(llm, 4), batch_sizes=(2, 8), chunk_sizes=(64,))
    print(report.table())
    assert not report.batch_invariant
    assert not report.all_equal


def test_env_variable_turns_it_on(tiny_ckpt_dir, monkeypatch):
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    llm = LLM(model=str(tiny_ckpt_dir), max_num_seqs=2)
    ops = llm.runner.loaded.ops
    assert llm.runner.loaded.ctx.batch_invariant
    assert all(getattr(op, "batch_invariant", False)
               for op in (*ops.linear.values(), ops.attention, ops.moe, ops.mhc, ops.pointwise, llm.sampler))


def test_mtp_varlen_is_refused_with_batch_invariance(tiny_ckpt_dir, monkeypatch):
    """Variable-length verification makes a seeded request's tokens depend on the load."""
    monkeypatch.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "1")
    with pytest.raises(ValueError, match="enable_mtp_varlen=True .*DEEPINFER_ENABLE_MTP_VARLEN=1.* "
                                         "batch_invariant=True .*DEEPINFER_BATCH_INVARIANT=1"):
        LLM(model=str(tiny_ckpt_dir), batch_invariant=True)


def test_bad_option_value_names_the_field(tiny_ckpt_dir):
    with pytest.raises(ValueError, match=r"batch_invariant='yes'; allowed: True, False, None"):
        LLM(model=str(tiny_ckpt_dir), batch_invariant="yes")


def test_disabled_feature_is_an_error_not_a_silent_fallback(tiny_ckpt_dir, monkeypatch):
    from deepinfer_core.plugins import PluginError, get_plugin_manager
    monkeypatch.setenv("DEEPINFER_DISABLE_PLUGINS", "batch_invariant")
    get_plugin_manager(refresh=True)
    try:
        with pytest.raises(PluginError, match="not batch invariant: linear method"):
            LLM(model=str(tiny_ckpt_dir), batch_invariant=True)
    finally:
        monkeypatch.delenv("DEEPINFER_DISABLE_PLUGINS")
        get_plugin_manager(refresh=True)


def test_unsupported_platform_and_op_are_refused(monkeypatch):
    from pathlib import Path
    from types import SimpleNamespace
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "backends/ascend950"))

    from deepinfer_batch_invariant import plugin, variants
    from deepinfer_core.plugins import PluginError
    from deepinfer_core.plugin_context import Platform
    ascend = SimpleNamespace(batch_invariant=True, platform=Platform("ascend", "npu", plugin="ascend"))
    with pytest.raises(ValueError, match=r"not supported on platform 'ascend'.*supported platforms: cpu, nvidia"):
        plugin.deepinfer_configure(ascend)
    from deepinfer_ascend import plugin as ascend_plugin
    with pytest.raises(ValueError, match="not supported on the Ascend backend"):
        ascend_plugin.deepinfer_configure(ascend)

    class ThirdPartyAttention:
        pass
    cpu = SimpleNamespace(batch_invariant=True, platform=Platform("cpu", "cpu"))
    with pytest.raises(PluginError, match="attention backend .*ThirdPartyAttention .* has no batch-invariant"):
        variants.invariant_op("attention backend", ThirdPartyAttention(), cpu)
    declared = ThirdPartyAttention()
    declared.batch_invariant = True
    assert variants.invariant_op("attention backend", declared, cpu) is declared


def test_cpu_primitives_do_not_depend_on_the_other_rows():
    """The CPU building blocks alone: a GEMM row and an elementwise sigmoid/SiLU/softplus value keep
    their bits whatever tensor they sit in (and stay close to torch's own functions)."""
    import torch

    from deepinfer_batch_invariant.portable_ops import fixed_tile_mm, sigmoid, silu, softplus
    g = torch.Generator().manual_seed(0)
    for n, k in ((24, 1024), (512, 4096)):   # the wider one is where padding M alone was not enough
        w = torch.randn(n, k, generator=g)
        x = torch.randn(300, k, generator=g)
        full = fixed_tile_mm(x, w)
        for rows in (slice(7, 8), slice(0, 9), slice(100, 300)):
            assert torch.equal(fixed_tile_mm(x[rows], w), full[rows]), (n, k, rows)
    z = torch.randn(4 * 63, generator=g) * 8
    for f, ref in ((sigmoid, torch.sigmoid), (silu, torch.nn.functional.silu), (softplus, torch.nn.functional.softplus)):
        whole = f(z)
        assert all(torch.equal(f(z[i:i + 4]), whole[i:i + 4]) for i in range(0, len(z), 4)), f.__name__
        torch.testing.assert_close(whole, ref(z), rtol=1e-6, atol=1e-6)
