"""The loader on variants of the tiny checkpoint that users may have: weights saved in float32
(e.g. after fine-tuning) and a checkpoint without the MTP block."""
from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.config import ModelConfig
from deepinfer_core.model import build_model
from deepinfer_core.model.weights import INDEX_FILE, CheckpointError, check_checkpoint, load_checkpoint
from test_loader import WEIGHTS_LOG, cast_lines


Edit = Callable[[str, torch.Tensor], "torch.Tensor | None"]
PROMPTS = [[0, 1000, 2000, 3000, 4000], [0, 77], [0, 5, 129279, 42, 9, 11, 300, 6]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3)


def rewrite_ckpt(src: Path, dst: Path, edit: Edit) -> Path:
    """Copy of checkpoint `src` with each tensor `t` replaced by `edit(name, t)` (None drops it):
    shards nothing changed in are linked, the index's weight_map and total_size stay consistent."""
    dst.mkdir(parents=True)
    index = json.loads((src / INDEX_FILE).read_text())
    weight_map: dict[str, str] = {}
    total = 0
    for shard in sorted(set(index["weight_map"].values())):
        old = load_file(str(src / shard))
        new = {n: t2.contiguous() for n, t in old.items() if (t2 := edit(n, t)) is not None}
        if new.keys() == old.keys() and all(new[n] is old[n] for n in old):
            (dst / shard).symlink_to(src / shard)
        elif new:
            save_file(new, str(dst / shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(new, shard))
        total += sum(t.numel() * t.element_size() for t in new.values())
    index["weight_map"], index["metadata"]["total_size"] = dict(sorted(weight_map.items())), total
    (dst / INDEX_FILE).write_text(json.dumps(index, indent=2))
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != INDEX_FILE:
            shutil.copyfile(f, dst / f.name)
    return dst


def greedy(llm: LLM) -> list[tuple[list[int], list[dict[int, float]]]]:
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY, use_tqdm=False)
    return [(c.token_ids, [{t: lp.logprob for t, lp in d.items()} for d in c.logprobs])
            for c in (o.outputs[0] for o in outs)]


@pytest.fixture(scope="module")
def reference(tiny_ckpt_dir):
    """The tiny checkpoint as published (float32 run, no QAT simulation) and its greedy outputs."""
    llm = LLM(model=str(tiny_ckpt_dir), dtype="float32", simulate_qat=False)
    return llm, greedy(llm)


@pytest.fixture(scope="module")
def f32_ckpt(tiny_ckpt_dir, tmp_path_factory):
    """Every bf16 tensor stored as float32 (same values), as after a float32 fine-tune."""
    return rewrite_ckpt(tiny_ckpt_dir, tmp_path_factory.mktemp("f32") / "ck",
                        lambda n, t: t.float() if t.dtype == torch.bfloat16 else t)


@pytest.fixture(scope="module")
def no_mtp_ckpt(tiny_ckpt_dir, tmp_path_factory):
    return rewrite_ckpt(tiny_ckpt_dir, tmp_path_factory.mktemp("nomtp") / "ck",
                        lambda n, t: None if n.startswith("mtp.") else t)


def test_float32_checkpoint_gives_bitwise_same_outputs(f32_ckpt, reference, caplog):
    ref_llm, ref_out = reference
    with caplog.at_level(logging.INFO, logger=WEIGHTS_LOG):
        llm = LLM(model=str(f32_ckpt), dtype="float32", simulate_qat=False)
    meta = build_model(ref_llm.model_config).state_dict()
    n_bf16 = sum(t.dtype == torch.bfloat16 for t in meta.values())
    (line,) = cast_lines(caplog)
    assert line.startswith(f"loading {n_bf16} float checkpoint tensors in another dtype than the "
                           f"model keeps, cast float32->float32 (float32 run, not bfloat16) "
                           f"x{n_bf16}: ")
    assert line.endswith(", ...") and "embed.weight" in line
    assert greedy(llm) == ref_out
    # every runtime buffer (process_weights made the linears' non-persistent): the same values
    ours = dict(llm.runner.model.named_buffers())
    theirs = dict(ref_llm.runner.model.named_buffers())
    assert ours.keys() == theirs.keys()
    assert ours["embed.weight"].dtype == torch.float32
    assert theirs["embed.weight"].dtype == torch.bfloat16
    assert all(torch.equal(ours[n].float(), theirs[n].float())
               for n in ours if ours[n].is_floating_point())


def test_float32_values_are_kept_exactly_in_a_float32_run(f32_ckpt, tmp_path):
    """Fine-tuned float32 values bf16 cannot hold: exact in a float32 run, rounded to bf16 in a
    bfloat16 run (what the model keeps); both runs generate."""
    g = torch.Generator().manual_seed(5)
    touched = ["embed.weight", "norm.weight", "layers.0.attn_norm.weight", "head.weight"]

    def perturb(n: str, t: torch.Tensor) -> torch.Tensor:
        return t * (1 + 2.0 ** -12 * torch.randn(t.shape, generator=g)) if n in touched else t
    path = rewrite_ckpt(f32_ckpt, tmp_path / "ck", perturb)
    stored = {}
    for shard in sorted(set(json.loads((path / INDEX_FILE).read_text())["weight_map"].values())):
        stored.update({n: t for n, t in load_file(str(path / shard)).items() if n in touched})
    assert all(t.dtype == torch.float32 and not torch.equal(t.bfloat16().float(), t)
               for t in stored.values())
    for dtype in ("float32", "bfloat16"):
        llm = LLM(model=str(path), dtype=dtype, simulate_qat=False)
        sd = dict(llm.runner.model.named_buffers())
        for n, t in stored.items():
            want = t if dtype == "float32" else t.bfloat16()
            if n == "head.weight":   # process_weights made it the fp32 runtime weight
                want = want.float()
            assert sd[n].dtype == want.dtype and torch.equal(sd[n], want), (dtype, n)
        outs = llm.generate(prompt_token_ids=PROMPTS[:2], sampling_params=GREEDY, use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in outs] == [4, 4]


def test_checkpoint_without_mtp_loads_and_matches(no_mtp_ckpt, reference, caplog):
    ref_llm, ref_out = reference
    with caplog.at_level(logging.INFO, logger=WEIGHTS_LOG):
        llm = LLM(model=str(no_mtp_ckpt), dtype="float32", simulate_qat=False)
    assert [r.getMessage() for r in caplog.records if "MTP block" in r.getMessage()] == [
        ("checkpoint has no mtp.* tensors: dropping the model's 1 MTP block(s) (they only draft "
         "tokens for speculative decoding)")]
    assert len(llm.runner.model.mtp) == 0 and len(ref_llm.runner.model.mtp) == 1
    cfg = llm.model_config
    layout, ref_layout = llm.runner.cache_layout(), ref_llm.runner.cache_layout()
    assert len(layout.ratios) == layout.num_main_layers == cfg.num_hidden_layers
    assert len(ref_layout.ratios) == cfg.num_hidden_layers + cfg.num_nextn_predict_layers
    assert layout.slot_bytes < ref_layout.slot_bytes
    seq = llm.runner.new_sequence()
    assert seq.mtp_layers == [] and len(seq.layers) == cfg.num_hidden_layers
    llm.runner.release(seq)
    assert greedy(llm) == ref_out       # the main model does not depend on the MTP block


def test_require_mtp_names_the_missing_tensors(no_mtp_ckpt):
    cfg = ModelConfig.from_file(no_mtp_ckpt)
    mtp_names = sorted(n for n in build_model(cfg).state_dict() if n.startswith("mtp."))
    assert check_checkpoint(build_model(cfg), no_mtp_ckpt) == []
    model = build_model(cfg, device="meta")
    with pytest.raises(CheckpointError) as ei:
        load_checkpoint(model, no_mtp_ckpt, require_mtp=True)
    msg = str(ei.value)
    assert ("mtp.*: the checkpoint has no MTP tensors; speculative decoding (MTP drafting) needs "
            "them") in msg
    assert all(f"{n}: missing (expected" in msg for n in mtp_names) and "mtp.0.e_proj.weight" in msg
    assert f"({len(mtp_names) + 1} problems)" in msg
    assert len(model.mtp) == 1 and all(b.is_meta for b in model.buffers())   # nothing changed
    strict = check_checkpoint(build_model(cfg), no_mtp_ckpt, require_mtp=True)
    assert len(strict) == len(mtp_names) + 1
    rep = load_checkpoint(model, no_mtp_ckpt)
    assert rep.mtp_dropped and len(model.mtp) == 0
    assert not any(n.startswith("mtp.") for n in model.state_dict())


def test_checkpoint_missing_some_mtp_tensors_is_refused(tiny_ckpt_dir, tmp_path):
    gone = {"mtp.0.e_proj.weight", "mtp.0.e_proj.scale", "mtp.0.norm.weight"}
    path = rewrite_ckpt(tiny_ckpt_dir, tmp_path / "ck", lambda n, t: None if n in gone else t)
    model = build_model(ModelConfig.from_file(path), device="meta")
    with pytest.raises(CheckpointError) as ei:
        load_checkpoint(model, path)
    msg = str(ei.value)
    assert "(3 problems)" in msg and "speculative" not in msg
    assert all(f"{n}: missing (expected" in msg for n in gone)
    assert len(model.mtp) == 1


# ---- path resolution ---------------------------------------------------------------------------

