"""Cost of the structured-output mask per decode step, at V4's vocabulary (129,280) and batch 64.

Runs the engine's own code path (`StructuredOutputProcessor.mask` / `.advance` on ConstraintStates
compiled through `prepare`) in a steady state: every row walks its grammar with uniformly random
allowed tokens and starts again when it completes. Per step it reports
  * host fill: xgrammar's batch bitmask fill, per request and per step;
  * mask call: the whole host side (fill + pinned copy + apply launch);
  * apply: the device kernel alone (CUDA events); serial: mask call + sync, the GPU otherwise idle;
  * accept: advancing the matchers with the sampled tokens (host);
  * overlapped (CUDA only): the executor calls the mask right after launching the forward, so the
    host fill runs while the GPU computes. A stand-in forward (`torch.cuda._sleep` for the
    43-layer-equivalent decode step) is queued first, then mask + accept; the extra wall time over
    the stand-in is the overhead a step actually sees.
The 43-layer-equivalent step is the sweep's extrapolated b64 c4k decode step
(benchmarks/results/sweep_NVIDIA_H200.json, `extrapolated.full_ms`), or --step-ms.

    python benchmarks/structured_outputs_mask.py [--batch 64] [--steps 200] [--device cuda]
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from deepinfer_core import SamplingParams
from deepinfer_core.api.tokenizer import Tokenizer
from deepinfer_core.tools.make_tiny_checkpoint import tokenizer_dir
from deepinfer_structured_outputs.grammar_service import ServiceSettings
from deepinfer_structured_outputs.processor import StructuredOutputProcessor

V, EOS = 129280, 1
RESULTS = Path(__file__).resolve().parent / "results"

_ADDRESS = {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                             "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["street", "city", "zip"]}
GRAMMARS = {
    "json": [{"schema_type": "json", "schema": {
        "type": "object", "properties": {
            "id": {"type": "integer"}, "name": {"type": "string"},
            "email": {"type": "string", "format": "email"},
            "tags": {"type": "array", "items": {"type": "string"}},
            "address": {"$ref": "#/$defs/address"},
            "status": {"enum": ["active", "inactive", "banned"]},
            "score": {"type": "number"}, "verified": {"type": "boolean"}},
        "required": ["id", "name", "tags", "address", "status"], "$defs": {"address": _ADDRESS}}}],
    "regex": [{"schema_type": "regex", "schema": r"[a-z0-9._]{1,20}@[a-z]{1,12}\.(com|org|net)"},
              {"schema_type": "regex", "schema": r"(\+1 )?\([0-9]{3}\) [0-9]{3}-[0-9]{4}"}],
    "ebnf": [{"schema_type": "ebnf", "schema": r'''
root ::= "SELECT " cols " FROM " ident where? ";"
cols ::= "*" | ident (", " ident)*
where ::= " WHERE " ident (" = " | " > " | " < ") value (" AND " ident " = " value)*
value ::= [0-9]+ | "'" [a-z ]* "'"
ident ::= [a-z_] [a-z0-9_]*
'''}],
}
GRAMMARS["mixed"] = GRAMMARS["json"] + GRAMMARS["regex"] + GRAMMARS["ebnf"]


def full_step_ms(batch: int) -> tuple[float | None, str]:
    path = RESULTS / "sweep_NVIDIA_H200.json"
    try:
        sweep = json.loads(path.read_text())
    except OSError:
        return None, "no sweep results"
    for e in sweep.get("decode", []):
        if e.get("batch") == batch and e.get("context") == 4096 and "extrapolated" in e:
            return float(e["extrapolated"]["full_ms"]), f"{path.name}: decode b{batch} c4096 extrapolated.full_ms"
    return None, f"{path.name} has no b{batch} c4096 row"


def make_states(proc, tok, specs, batch):
    cons = []
    for so in specs:
        params = SamplingParams(so_args=so)
        c = proc.prepare(params, tokenizer=tok, vocab_size=V, eos_token_id=EOS)
        c.wait(60)
        assert c.ready(), c.error()
        cons.append((c, params))
    return cons, [cons[i % len(cons)][0].new_state(cons[i % len(cons)][1], EOS) for i in range(batch)]


def single_char_tokens(tok) -> torch.Tensor:
    n = tok.backend.get_vocab_size(with_added_tokens=False)
    out = torch.zeros(V)
    out[:n] = torch.tensor([float(len(tok.decode([i])) == 1) for i in range(n)])
    return out


def sleep_cycles_per_ms(device) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1000)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    torch.cuda.synchronize()
    return 10_000_000 / start.elapsed_time(end)


def apply_kernel_ms(logits: torch.Tensor, proc, reps: int = 50) -> list[float]:
    """The device apply alone: xgrammar's kernel on the last step's bitmask, every row masked."""
    import xgrammar as xgr

    n = logits.shape[0]
    bitmask = proc._host[:n].to(logits.device)
    idx = torch.arange(n, dtype=torch.int32, device=logits.device)
    out = []
    for _ in range(reps):
        work = logits.clone()
        ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ev0.record()
        xgr.apply_token_bitmask_inplace(work, bitmask, vocab_size=logits.shape[-1], indices=idx)
        ev1.record()
        torch.cuda.synchronize()
        out.append(ev0.elapsed_time(ev1))
    return out


def run(name, specs, tok, args, device, step_ms):
    proc = StructuredOutputProcessor(ServiceSettings(), fill_threads=args.fill_threads)
    cons, states = make_states(proc, tok, specs, args.batch)
    rows = list(range(args.batch))
    gen = torch.Generator(device=device).manual_seed(0)
    base = torch.randn(args.batch, V, device=device, generator=gen)
    # Odd rows prefer one-character tokens (quotes, commas, digits): they walk through the grammar's
    # structure; even rows pick uniformly and spend their time inside strings, like a random model.
    bias = single_char_tokens(tok).to(device)[None, :] * (torch.arange(args.batch, device=device) % 2)[:, None]
    cuda = device.type == "cuda"
    cycles = sleep_cycles_per_ms(device) * step_ms if cuda and step_ms else None
    rec = {k: [] for k in ("fill_ms", "mask_call_ms", "serial_ms", "apply_ms", "accept_ms", "overlap_extra_ms")}
    completions = 0
    for step in range(args.warmup + args.steps):
        logits = base.clone()
        if cuda:
            torch.cuda.synchronize()
        overlapped = cuda and cycles is not None and step % 2 == 1
        if overlapped:                       # the stand-in forward, queued before the mask (as the executor)
            t_start = time.perf_counter()
            torch.cuda._sleep(int(cycles))
        fill0 = proc.stats.fill_seconds
        t0 = time.perf_counter()
        proc.mask(logits, rows, states)
        t1 = time.perf_counter()
        if cuda and not overlapped:
            torch.cuda.synchronize()
        t_serial = time.perf_counter()
        noise = torch.rand(args.batch, V, device=device, generator=gen)
        tokens = (noise + bias).masked_fill(logits == -torch.inf, -1.0).argmax(-1).tolist()   # syncs
        t2 = time.perf_counter()
        done = proc.advance(states, tokens)
        t3 = time.perf_counter()
        for i, d in enumerate(done):
            if d:
                c, p = cons[i % len(cons)]
                states[i] = c.new_state(p, EOS)
                completions += 1
        if step < args.warmup:
            continue
        if overlapped:
            rec["overlap_extra_ms"].append((t3 - t_start) * 1e3 - step_ms)
            continue
        rec["fill_ms"].append((proc.stats.fill_seconds - fill0) * 1e3)
        rec["mask_call_ms"].append((t1 - t0) * 1e3)
        rec["serial_ms"].append((t_serial - t0) * 1e3)
        rec["accept_ms"].append((t3 - t2) * 1e3)
    if cuda:
        rec["apply_ms"] = apply_kernel_ms(base, proc)
    med = {k: statistics.median(v) for k, v in rec.items() if v}
    out = {"grammars": name, "batch": args.batch, "steps": args.steps, "completions": completions,
           "median": med,
           "fill_us_per_request": med["fill_ms"] * 1e3 / args.batch,
           "accept_us_per_request": med["accept_ms"] * 1e3 / args.batch}
    if step_ms:
        out["serial_pct_of_step"] = 100 * (med["serial_ms"] + med["accept_ms"]) / step_ms
        if "overlap_extra_ms" in med:
            out["overlapped_pct_of_step"] = 100 * med["overlap_extra_ms"] / step_ms
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--fill-threads", default="auto", help="xgrammar batch-fill threads (int or auto)")
    ap.add_argument("--step-ms", type=float, default=None,
                    help="43-layer-equivalent decode step (default: from the H200 sweep results)")
    ap.add_argument("--grammars", default="json,regex,ebnf,mixed")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.fill_threads = args.fill_threads if args.fill_threads == "auto" else int(args.fill_threads)
    device = torch.device(args.device)
    step_ms, step_src = (args.step_ms, "--step-ms") if args.step_ms else full_step_ms(args.batch)
    if device.type != "cuda" and not args.step_ms:
        step_ms, step_src = None, "not compared: the 43-layer step was measured on the H200"
    tok = Tokenizer.from_path(tokenizer_dir())
    results = [run(g, GRAMMARS[g], tok, args, device, step_ms) for g in args.grammars.split(",")]
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.processor() or 'x86_64'})"
    print(f"\nstructured-output mask, vocab {V}, batch {args.batch}, {dev_name}; "
          f"43-layer-equivalent step {step_ms} ms ({step_src})")
    hdr = ("grammars", "fill us/req", "mask call ms", "apply kernel ms", "serial ms", "accept us/req",
           "serial %", "overlapped extra ms", "overlapped %")
    print(" | ".join(hdr))
    for r in results:
        m = r["median"]
        cells = [r["grammars"], f"{r['fill_us_per_request']:.1f}", f"{m['mask_call_ms']:.3f}",
                 f"{m['apply_ms']:.3f}" if "apply_ms" in m else "-", f"{m['serial_ms']:.3f}",
                 f"{r['accept_us_per_request']:.1f}", f"{r['serial_pct_of_step']:.2f}" if "serial_pct_of_step" in r else "-",
                 f"{m['overlap_extra_ms']:.3f}" if "overlap_extra_ms" in m else "-",
                 f"{r['overlapped_pct_of_step']:.2f}" if "overlapped_pct_of_step" in r else "-"]
        print(" | ".join(cells))
    import os
    tag = dev_name.replace(" ", "_").replace("(", "").replace(")", "")
    path = Path(args.out) if args.out else RESULTS / f"structured_mask_{tag}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "schema": "deepinfer-structured-mask/1", "device": dev_name, "vocab": V, "batch": args.batch,
        "step_ms": step_ms, "step_source": step_src, "cpus": os.cpu_count(), "fill_threads": args.fill_threads,
        "versions": {"torch": torch.__version__, "python": platform.python_version()},
        "results": results}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
