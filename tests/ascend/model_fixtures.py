"""Helpers of the Ascend model-level tests (test_backend_model.py, test_backend_engine.py): the
`ascend` platform chosen by DEEPINFER_ACCELERATOR on the simulated torch_npu (alias mode), the
portable CPU platform for the references, and a tiny V4 checkpoint whose config lets every hook
the Ascend op table maps serve, attention included.

The tiny checkpoint (`ascend_config`): head_dim 512 with a 64-wide RoPE part (SFA's MLA-absorb
mode), 2 attention heads, index_head_dim 128 with 8 indexer heads and index_topk 4 (the lightning
indexer's documented values on the 950), a window-only, a CSA (ratio 4) and an HCA (ratio 128)
layer, one hash layer and two routed ones, FP4 experts, mHC with 4 streams, one MTP block; hidden
size 128 keeps it fast (the real vocabulary of 129,280 tokens is most of its 75 MiB)."""
from __future__ import annotations

import contextlib
import os
from importlib import metadata
from pathlib import Path

import pytest
import torch
from fake_npu import SOC_A5, FakeNpu

from deepinfer_core import LLM, SamplingParams, plugins

BACKEND = Path(__file__).resolve().parents[2] / "backends" / "ascend950"
SFA, LI = "npu_sparse_flash_attention", "npu_lightning_indexer"
MHC = {"npu_mhc_pre", "npu_mhc_sinkhorn", "npu_mhc_post"}
POINTWISE = {"npu_rms_norm", "npu_rotary_mul"}
MOE = {"npu_moe_init_routing_v2", "npu_grouped_matmul", "npu_moe_token_unpermute"}
LINEAR = {"npu_quant_matmul"}


def ascend_config() -> dict:
    """`make_tiny_checkpoint` overrides (the `--set` keys) of the tiny model every mapped hook
    serves: see the module docstring."""
    return dict(hidden_size=128, num_hidden_layers=3, num_nextn_predict_layers=1,
                compress_ratios=[0, 4, 128, 0], num_attention_heads=2, head_dim=512,
                qk_rope_head_dim=64, q_lora_rank=128, o_groups=2, o_lora_rank=128,
                index_n_heads=8, index_head_dim=128, index_topk=4, num_hash_layers=1,
                n_routed_experts=4, moe_intermediate_size=128, sliding_window=16)


_CHECKPOINTS: dict[str, Path] = {}


def ascend_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint of `ascend_config`, written once per test session (the modules that
    use it share it read-only)."""
    key = str(tmp_path_factory.getbasetemp())
    if key not in _CHECKPOINTS:
        from deepinfer_core.tools.make_tiny_checkpoint import make_tiny_checkpoint
        _CHECKPOINTS[key] = make_tiny_checkpoint(tmp_path_factory.mktemp("ascend_ckpt"),
                                                 ascend_config(), seed=0)
    return _CHECKPOINTS[key]


def install_backend(mp: pytest.MonkeyPatch, tmp: Path) -> None:
    """The backend importable and registered as an entry point (a dist-info in a temporary site
    folder unless deepinfer-ascend is installed), an NPU device node faked under `tmp`, the
    runtime's device type the CPU (alias mode)."""
    mp.syspath_prepend(str(BACKEND))
    try:
        metadata.distribution("deepinfer-ascend")
    except metadata.PackageNotFoundError:
        info = tmp / "site" / "deepinfer_ascend-0.1.0.dist-info"
        info.mkdir(parents=True, exist_ok=True)
        (info / "METADATA").write_text(
            "Metadata-Version: 2.1\nName: deepinfer-ascend\nVersion: 0.1.0\n")
        (info / "entry_points.txt").write_text(
            "[deepinfer.backends]\nascend = deepinfer_ascend.plugin\n")
        mp.syspath_prepend(str(tmp / "site"))
    from deepinfer_ascend import plugin, runtime
    (tmp / "davinci0").write_text("")
    mp.setattr(plugin, "PROBE_PATHS", (str(tmp / "davinci0"),))
    for name, (value, _) in runtime.ENV_DEFAULTS.items():   # start-up's defaults, undone after
        mp.setenv(name, os.environ.get(name, value))
    runtime.reset()
    mp.setattr(runtime, "DEVICE_TYPE", "cpu")


def use_accelerator(mp: pytest.MonkeyPatch, name: str) -> None:
    """DEEPINFER_ACCELERATOR=name, resolved by a fresh plugin manager (the next LLM's platform)."""
    mp.setenv("DEEPINFER_ACCELERATOR", name)
    plugins.get_plugin_manager(refresh=True)


@contextlib.contextmanager
def simulated_ascend(tmp: Path):
    """A fake torch_npu (the Ascend 950) installed and the backend registered, for a module's
    fixtures; yields (the `FakeNpu`, a MonkeyPatch whose `use_accelerator` picks the platform of
    the next LLM). Undone on exit (fake removed, runtime reset, plugin manager refreshed)."""
    fake = FakeNpu(SOC_A5).install()
    try:
        with pytest.MonkeyPatch.context() as mp:
            install_backend(mp, tmp)
            try:
                yield fake, mp
            finally:
                from deepinfer_ascend import runtime
                runtime.reset()
        plugins.get_plugin_manager(refresh=True)
    finally:
        fake.uninstall()


def build_pair(ckpt: Path, mp: pytest.MonkeyPatch, **options) -> tuple[LLM, LLM]:
    """(the LLM on the simulated Ascend backend, the LLM on the portable CPU backend), both
    built from `ckpt` with `options`, as a user builds them (device "cpu": alias mode)."""
    use_accelerator(mp, "ascend")
    ours = LLM(model=str(ckpt), device="cpu", **options)
    assert ours.runner.loaded.ctx.platform.name == "ascend"
    use_accelerator(mp, "cpu")
    ref = LLM(model=str(ckpt), device="cpu", **options)
    assert ref.runner.loaded.ctx.platform.name == "cpu"
    return ours, ref


def called(fake: FakeNpu, since: int = 0) -> set[str]:
    """The torch_npu ops the fake recorded from call index `since` on."""
    return {name for name, _ in fake.calls[since:]}


def teacher_forced(llm: LLM, ids: list[int]) -> torch.Tensor:
    """Every position's logits [len(ids), V] (float32) of one forward over `ids`."""
    runner = llm.runner
    state = runner.new_sequence()
    try:
        return runner.forward(state, ids, all_logits=True).float().cpu()
    finally:
        runner.release(state)


def greedy(llm: LLM, prompts: list[list[int]], max_tokens: int, logprobs: int | None = None,
           **params):
    """`LLM.generate` at temperature 0 on token-id prompts: the CompletionOutput of each."""
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                        logprobs=logprobs, **params)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
    return [o.outputs[0] for o in outs]


def random_prompts(lengths, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 129280, (n,), generator=g).tolist() for n in lengths]
