"""The tiny V4 model through the Ascend backend on the simulated device (alias mode): the engine
picks the `ascend` platform from DEEPINFER_ACCELERATOR, the backend starts on the fake torch_npu and
serves its pointwise, FP8 linear and MoE ops; greedy tokens must equal the portable CPU
backend's."""
from __future__ import annotations

from importlib import metadata
from pathlib import Path

import pytest
import torch

from deepinfer_core import LLM, SamplingParams, plugins

BACKEND = Path(__file__).resolve().parents[2] / "backends" / "ascend950"
PROMPTS = ["To be, or not to be", "Now is the winter of our discontent"]


@pytest.fixture
def ascend_platform(fake_npu, monkeypatch, tmp_path):
    """DEEPINFER_ACCELERATOR=ascend resolved by a fresh plugin manager: the backend installed as
    an entry point (a dist-info in a temporary site folder unless deepinfer-ascend is installed),
    an NPU device node faked, the runtime's device type the CPU (alias mode)."""
    monkeypatch.syspath_prepend(str(BACKEND))
    try:
        metadata.distribution("deepinfer-ascend")
    except metadata.PackageNotFoundError:
        info = tmp_path / "site" / "deepinfer_ascend-0.1.0.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(
            "Metadata-Version: 2.1\nName: deepinfer-ascend\nVersion: 0.1.0\n")
        (info / "entry_points.txt").write_text(
            "[deepinfer.backends]\nascend = deepinfer_ascend.plugin\n")
        monkeypatch.syspath_prepend(str(tmp_path / "site"))
    from deepinfer_ascend import plugin, runtime
    (tmp_path / "davinci0").write_text("")
    monkeypatch.setattr(plugin, "PROBE_PATHS", (str(tmp_path / "davinci0"),))
    runtime.reset()
    monkeypatch.setattr(runtime, "DEVICE_TYPE", "cpu")
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "ascend")
    plugins.get_plugin_manager(refresh=True)
    yield fake_npu
    runtime.reset()
    monkeypatch.delenv("DEEPINFER_ACCELERATOR")
    plugins.get_plugin_manager(refresh=True)


def _greedy(llm) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_tiny_model_greedy_tokens_equal_the_portable_backend(tiny_ckpt_dir, ascend_platform,
                                                             monkeypatch):
    from deepinfer_ascend.linear import MxFp8LinearMethod
    from deepinfer_ascend.moe import AscendMoE
    from deepinfer_ascend.pointwise import AscendPointwise
    options = dict(model=str(tiny_ckpt_dir), dtype="bfloat16", device="cpu", max_num_seqs=2)
    llm = LLM(**options)
    loaded = llm.runner.loaded
    assert loaded.ctx.platform.name == "ascend"
    assert isinstance(loaded.ops.pointwise, AscendPointwise)
    assert isinstance(loaded.ops.linear["fp8"], MxFp8LinearMethod)
    assert isinstance(loaded.ops.moe, AscendMoE) and loaded.ops.moe.form == "mx"
    # the tiny model's FP4 experts stay FP4 (W4A8 MXFP), stacked per layer
    ffn = loaded.model.layers[0].ffn
    assert ffn.npu_moe.fmt == "fp4" and ffn.npu_w13.dtype == torch.uint8
    got = _greedy(llm)
    called = {name for name, _ in ascend_platform.calls}
    assert {"npu_rms_norm", "npu_rotary_mul", "npu_quant_matmul", "npu_moe_init_routing_v2",
            "npu_grouped_matmul", "npu_moe_token_unpermute"} <= called, called
    assert all(args["weight_dtype"] == 296 for name, args in ascend_platform.calls
               if name == "npu_grouped_matmul")
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "cpu")
    plugins.get_plugin_manager(refresh=True)
    ref = LLM(**options)
    assert ref.runner.loaded.ctx.platform.name == "cpu"
    assert got == _greedy(ref)
