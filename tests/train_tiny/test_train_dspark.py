"""The DSpark drafter training tool (tools/train_tiny/dspark.py) on the CPU in a few steps, against
the bundled trained target: the DSpark paper's loss through the engine's own block forward, the
drafter artifact (<= 8 MB, the target's compact vocabulary), and the DSpark checkpoint built from
target + drafter, which the engine loads and drafts with."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
from test_train_tiny import write_corpus  # noqa: E402

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.config import ModelConfig
from deepinfer_core.tools.trained_model import (
    ARTIFACT,
    make_trained_checkpoint,
    read_drafter,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))      # the repository root: tools/
from tools.train_tiny import dspark  # noqa: E402


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_dspark")
    args = dspark.parse([str(write_corpus(root)), str(root / "out"), "--device", "cpu", "--steps", "2",
                         "--batch", "2", "--length", "40", "--anchors", "6", "--warmup", "1", "--eval-every", "2",
                         "--eval-windows", "2"])
    return root, dspark.train(args)


def test_training_reports_per_position_losses_and_acceptance(trained):
    root, report = trained
    curve = json.loads((root / "out" / "curve.json").read_text())
    assert report["steps"] == 2 and [p["step"] for p in curve] == [2]
    held = report["exported_heldout"]
    assert len(held["ce"]) == len(held["tv"]) == len(held["accept_t1"]) == 5
    assert all(0 <= tv <= 2 for tv in held["tv"]) and all(math.isfinite(ce) for ce in held["ce"])
    assert 1.0 <= held["tau_greedy"] <= 6.0 and 1.0 <= held["tau_t1"] <= 6.0


def test_the_drafter_artifact_is_small_and_builds_a_dspark_checkpoint(trained, tmp_path):
    root, report = trained
    artifact = root / "out" / "drafter.safetensors"
    keys, tensors, info = read_drafter(artifact)
    assert report["bytes"] == artifact.stat().st_size <= 8 * 2**20
    assert all(n.startswith("mtp.") for n in tensors if n != "vocab.kept")
    assert tensors["mtp.2.markov_head.markov_w1"].shape == (8192, keys["dspark_markov_rank"])
    ckpt = make_trained_checkpoint(tmp_path / "ckpt", ARTIFACT, drafter=artifact)
    cfg = ModelConfig.from_file(ckpt)
    assert cfg.dspark.block_size == 5 and cfg.dspark.target_layer_ids == (5, 6, 7) and len(cfg.compress_ratios) == 11
    llm = LLM(model=str(ckpt), num_speculative_tokens=5, dtype="float32", device="cpu", max_model_len=128)
    out = llm.generate("KING.\nMy lord,", SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 6 and out.metrics.spec.num_steps >= 1


def test_a_drafter_of_another_target_is_refused(trained, tmp_path):
    root, _ = trained
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    path = root / "out" / "drafter.safetensors"
    tensors = load_file(str(path))
    tensors["vocab.kept"] = tensors["vocab.kept"].flip(0)
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    save_file(tensors, str(tmp_path / "other.safetensors"), metadata=meta)
    with pytest.raises(ValueError, match="trained against another target"):
        make_trained_checkpoint(tmp_path / "ckpt", ARTIFACT, drafter=tmp_path / "other.safetensors")
