"""DeepSeek-V4.1's DSpark drafter (shifted mHC in its stages, no hc_head) on a tiny V4.1 with two
stages: speculation is lossless, with VARLEN and with bounded replay; a V4.1 config with drafter
layers but no dspark_* keys is refused."""
from __future__ import annotations

import pytest
import torch

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.config import ConfigError, ModelConfig
from deepinfer_core.tools.make_tiny_checkpoint import make_tiny_checkpoint
from deepinfer_core.tools.tiny_config_v41 import DRAFTER, tiny_v41_config_dict


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_v41_dspark"), DRAFTER, family="v41")


def _generate(path, prompts, **kw):
    # four sequences at most: VARLEN profiles its step times for every batch size up to this
    llm = LLM(str(path), dtype="float32", simulate_qat=False, max_num_seqs=4, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


MASK = {"yoco_prefill_truncation_mode": "mask", "yoco_prefill_keep_tokens": 40}


@pytest.mark.parametrize("options", [{}, {"enable_mtp_varlen": True}, MASK])
def test_drafting_is_lossless(drafter_dir, options):
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 128000, (n,), generator=gen).tolist() for n in (9, 120, 260)]
    base = {k: v for k, v in options.items() if k != "enable_mtp_varlen"}
    plain, _ = _generate(drafter_dir, prompts, num_speculative_tokens=0, **base)
    drafted, llm = _generate(drafter_dir, prompts, num_speculative_tokens=3, **options)
    assert drafted == plain
    m = llm.engine.spec_metrics
    assert m.num_steps > 0 and m.num_drafted_tokens > 0


def test_drafter_layers_without_dspark_keys_are_refused():
    cfg = tiny_v41_config_dict(num_nextn_predict_layers=1,
                               compress_ratios=[0, 0, 2, 2, 2, 1, 1, 1, 0])
    with pytest.raises(ConfigError, match="num_nextn_predict_layers=1 without dspark_"):
        ModelConfig.from_dict(cfg)


def test_the_last_stage_has_no_hc_head():
    from deepinfer_core.model import build_model
    cfg = ModelConfig.from_dict(tiny_v41_config_dict(drafter=True))
    names = build_model(cfg, "meta").state_dict()
    assert "mtp.1.norm.weight" in names and "mtp.0.main_proj.weight" in names
    assert not any("hc_head" in n for n in names)
