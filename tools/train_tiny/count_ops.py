"""How many aten calls one training step (forward + backward) makes: on a GPU the tiny model's step is
launch-bound, so this count, not FLOPs, is what to cut. A CPU count (the torch profiler's aten:: events,
nested calls included) is enough to compare versions.

    python -m tools.train_tiny.count_ops corpus.npz [--batch 1] [--length 256]
"""
from __future__ import annotations

import argparse

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from . import model as M


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.train_tiny.count_ops", description=__doc__.split("\n\n")[0])
    ap.add_argument("corpus")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--vocab-rows", type=int, default=8192)
    a = ap.parse_args(argv)
    tokens = np.load(a.corpus)["train"]
    vocab = M.VocabMap.most_frequent(tokens, a.vocab_rows - 1)
    rows = vocab.row_of_token()[tokens[:a.batch * a.length]]
    model = M.build(M.training_config(vocab.rows), "cpu", 0)
    windows = torch.from_numpy(rows.reshape(a.batch, a.length))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        main_loss, mtp, _ = M.forward_losses(model, windows)
        (main_loss + 0.3 * mtp).backward()
    calls = sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))
    print(f"{calls} aten calls in one training step of {a.batch} x {a.length} tokens")
    return calls


if __name__ == "__main__":
    main()
