"""The bundled trained model (its MTP block drafts acceptable tokens) and its non-speculative greedy
outputs, shared by the speculative-decoding tests (float32, batch-invariant ops, CPU)."""
from __future__ import annotations

import pytest
from spec_cases import GREEDY, OPTIONS, PROMPTS  # noqa: E402

from deepinfer_core import LLM  # noqa: E402
from deepinfer_core.tools.trained_model import (
    ARTIFACT,
    DSPARK_ARTIFACT,
    make_trained_checkpoint,
)


@pytest.fixture(scope="session")
def trained_dir(tmp_path_factory):
    return str(make_trained_checkpoint(tmp_path_factory.mktemp("trained") / "ckpt", ARTIFACT))


@pytest.fixture(scope="session")
def dspark_trained_dir(tmp_path_factory):
    """The bundled DSpark variant: the same target with its trained DSpark drafter."""
    return str(make_trained_checkpoint(tmp_path_factory.mktemp("trained") / "dspark", ARTIFACT,
                                       drafter=DSPARK_ARTIFACT))


@pytest.fixture(scope="session")
def reference_llm(trained_dir):
    """The non-speculative engine over the trained model."""
    return LLM(model=trained_dir, num_speculative_tokens=0, **OPTIONS)


@pytest.fixture(scope="session")
def prompts_and_reference(reference_llm):
    prompts = [reference_llm.tokenizer.encode(p) for p in PROMPTS]
    outs = reference_llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    return prompts, [o.outputs[0].token_ids for o in outs]
