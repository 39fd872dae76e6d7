"""How closely the GPU paths agree with the CPU backend on the tiny model: max relative logit error
per prompt position and argmax agreement, for {float32, bfloat16} x {QAT simulation on, off} x
{portable ops on CUDA, nvidia backend}. Prints a table, writes benchmarks/results/backend_agreement.json.

    python benchmarks/backend_agreement.py      # on a GPU machine with deepinfer-nvidia installed

`--greedy DEVICE[,DEVICE]`: on the bundled trained tiny model, bf16 + QAT greedy continuations (32
tokens of 16 prompts, `LLM.generate`) against float32 ones with the same QAT setting, on each device
(cuda: the nvidia backend when installed); agreement counts each continuation up to its first
divergence, with float32's top-2 log-prob gap where bf16 parted from it. Writes
benchmarks/results/greedy_agreement_<devices>.json.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch

from deepinfer_core.plugins import get_plugin_manager
from deepinfer_core.runner.model_runner import ModelRunner
from deepinfer_core.tools.make_tiny_checkpoint import make_tiny_checkpoint


def logits(ckpt, ids, dtype, device, qat, backend_on=True):
    if backend_on:
        os.environ.pop("DEEPINFER_DISABLE_PLUGINS", None)
    else:
        os.environ["DEEPINFER_DISABLE_PLUGINS"] = "nvidia"
    get_plugin_manager(refresh=True)
    runner = ModelRunner(ckpt, dtype=dtype, simulate_qat=qat, device=device)
    state = runner.new_sequence()
    out = runner.forward(state, ids, all_logits=True).float().cpu()
    methods = sorted({type(m.method).__name__ for m in runner.model.modules() if getattr(m, "fmt", None) == "fp8"})
    return out, methods


GREEDY_PROMPTS = [
    "HAMLET.\nTo be, or not to be,", "KING.\nMy lord, the", "ROMEO.\nBut soft, what light",
    "First Citizen.\nWhat say you to", "Enter a Messenger.\n\nMESSENGER.\n", "QUEEN.\nAlas, my lord,",
    "ACT II.\n\nScene I.", "DUKE.\nGood morrow, gentle", "LADY.\nI pray you, sir,", "FOOL.\nNuncle,",
    "OTHELLO.\nIt is the cause,", "PORTIA.\nThe quality of mercy", "[Enter the Ghost.]\n\n",
    "BRUTUS.\nFriends, Romans,", "SECOND LORD.\nHe hath", "CLOWN.\nAy, marry, sir,",
]


def top2_gap(logprobs: dict) -> float:
    """The chosen token's log-prob minus the runner-up's (`logprobs=2`: the top two and the chosen one)."""
    best = sorted((entry.logprob for entry in logprobs.values()), reverse=True)
    return best[0] - best[1] if len(best) > 1 else float("inf")


def first_divergence(a: list[int], b: list[int], n: int) -> int:
    """How many leading tokens two continuations share (n when all do)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), n)


def greedy_agreement(devices: list[str], model: str | None = None, prompts: list[str] = GREEDY_PROMPTS) -> dict:
    from deepinfer_core import LLM, SamplingParams
    from deepinfer_core.tools.bundled_model import bundled_tiny_model_dir
    name, model, n = model or "bundled trained tiny model", model or str(bundled_tiny_model_dir()), 32
    if model.endswith(".safetensors"):          # a training run's compact artifact: build its checkpoint
        from deepinfer_core.tools.trained_model import make_trained_checkpoint
        model = str(make_trained_checkpoint(Path(tempfile.mkdtemp()) / "ckpt", model))
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=2)
    rows = []
    for device in devices:
        for qat in (True, False):
            runs, drafts = {}, set()
            for dtype in ("float32", "bfloat16"):
                llm = LLM(model=model, dtype=dtype, simulate_qat=qat, device=device, max_model_len=256)
                runs[dtype] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
                speculator = llm.engine.executor.speculator       # bf16 verify steps round as batches of rows
                drafts.add(speculator.num_drafts if speculator is not None else 0)
            prefix = [first_divergence(f.token_ids, h.token_ids, n)
                      for f, h in zip(runs["float32"], runs["bfloat16"])]
            # float32's top-2 log-prob gap along its own greedy path: where bf16 parts, and how many near-ties
            gaps = [[top2_gap(lp) for lp in f.logprobs] for f in runs["float32"]]
            rows.append(dict(device=device, simulate_qat=qat, speculative_drafts=drafts.pop(),
                             agreement=sum(prefix) / (n * len(prefix)),
                             identical=sum(p == n for p in prefix), first_divergence=prefix,
                             float32_gap_at_divergence=[round(g[p], 4) for g, p in zip(gaps, prefix) if p < n],
                             float32_gaps_below_0_1=sum(x < 0.1 for g in gaps for x in g),
                             float32_median_gap=float(torch.tensor(gaps).median())))
            print(f"{device:5} QAT={str(qat):5} bf16 vs float32: {rows[-1]['agreement']:.1%} of "
                  f"{len(prefix)} x {n} positions agree; {rows[-1]['identical']} continuations identical; "
                  f"float32's top-2 gap where they part: {rows[-1]['float32_gap_at_divergence']} "
                  f"({rows[-1]['float32_gaps_below_0_1']} of its {len(prefix) * n} gaps < 0.1 nats, "
                  f"median {rows[-1]['float32_median_gap']:.2f})")
    return dict(model=name, prompts=len(prompts), tokens=n, rows=rows)


def main() -> None:
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("--greedy", metavar="DEVICES", help="the greedy bf16-vs-float32 agreement on these devices")
    ap.add_argument("--mma-sync-tiles", action="store_true",
                    help="force 16-row FP8 GEMM tiles (mma.sync, fp32-exact sums) instead of wgmma tiles, to "
                         "separate the FP8 tensor cores' short accumulator from everything else")
    ap.add_argument("--model", help="--greedy on this checkpoint or training artifact (run/artifact.safetensors; "
                                    "default: the bundled trained tiny model)")
    ap.add_argument("--prompts", type=Path, help="--greedy with these prompts (JSON: {\"prompts\": [...]})")
    ap.add_argument("--tag", default="", help="suffix of the --greedy JSON's name")
    args = ap.parse_args()
    if args.greedy:
        devices = args.greedy.split(",")
        prompts = json.loads(args.prompts.read_text())["prompts"] if args.prompts else GREEDY_PROMPTS
        result = greedy_agreement(devices, args.model, prompts)
        out = Path(__file__).parent / "results" / f"greedy_agreement_{'_'.join(devices)}{args.tag}.json"
        out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {out}")
        return
    if args.mma_sync_tiles:
        import deepinfer_kernels.fp8_gemm as g
        g.tile_config = lambda M: dict(BLOCK_M=16, BLOCK_N=64, num_warps=4, num_stages=4)
    ckpt = make_tiny_checkpoint(Path(tempfile.mkdtemp()), seed=0)
    ids = torch.randint(2, 129280, (40,), generator=torch.Generator().manual_seed(8)).tolist()
    rows = []
    for qat in (False, True):
        for dtype in ("float32", "bfloat16"):
            ref, _ = logits(ckpt, ids, dtype, "cpu", qat)
            for backend_on in (False, True):
                out, methods = logits(ckpt, ids, dtype, "cuda", qat, backend_on)
                err = (out - ref).abs().amax(-1) / ref.abs().amax(-1)
                rows.append(dict(dtype=dtype, simulate_qat=qat, path="nvidia" if backend_on else "portable-cuda",
                                 linear=methods, first_pos_err=float(err[0]), median_err=float(err.median()),
                                 max_err=float(err.max()), argmax_agree=float((out.argmax(-1) == ref.argmax(-1)).float().mean())))
    print(f"{'dtype':9} {'QAT':5} {'path':14} {'err@0':>9} {'median':>9} {'max':>9} {'argmax=':>8}")
    for r in rows:
        print(f"{r['dtype']:9} {str(r['simulate_qat']):5} {r['path']:14} {r['first_pos_err']:9.2e} "
              f"{r['median_err']:9.2e} {r['max_err']:9.2e} {r['argmax_agree']:8.3f}")
    out = Path(__file__).parent / "results" / ("backend_agreement" + ("_mma_sync" if args.mma_sync_tiles else "") + ".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(), prompt_len=len(ids),
                                   mma_sync_tiles=args.mma_sync_tiles, rows=rows), indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
