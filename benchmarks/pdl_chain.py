"""What programmatic dependent launch (PDL) saves per kernel boundary inside a CUDA graph: a chain of
small dependent Triton kernels (each reads the previous one's output, as a decode step's kernels do),
replayed with and without PDL. Prints microseconds per kernel and writes
benchmarks/results/pdl_chain_<gpu>.json.

    python benchmarks/pdl_chain.py [--kernels 200] [--sizes 16384,262144,4194304] [--programs 8,64,132]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton
import triton.language as tl


@triton.jit
def _step_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """y = x * 0.5 + 1 over a grid-stride loop: a stand-in for one decode kernel."""
    if PDL:
        tl.extra.cuda.gdc_wait()                  # x is the previous kernel's output
        tl.extra.cuda.gdc_launch_dependents()     # the next kernel may launch and wait
    for start in range(tl.program_id(0) * BLOCK, n, tl.num_programs(0) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        ok = offs < n
        tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=ok) * 0.5 + 1.0, mask=ok)


def chain_us(n_kernels: int, numel: int, programs: int, pdl: bool) -> float:
    bufs = [torch.randn(numel, device="cuda") for _ in range(2)]

    def run():
        for i in range(n_kernels):
            _step_kernel[(programs,)](bufs[i % 2], bufs[(i + 1) % 2], numel, BLOCK=1024, PDL=pdl, launch_pdl=pdl)

    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    ms = triton.testing.do_bench(graph.replay, warmup=10, rep=200, return_mode="median")
    return 1e3 * ms / n_kernels


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernels", type=int, default=200)
    ap.add_argument("--sizes", default="16384,262144,4194304")
    ap.add_argument("--programs", default="8,64,132")
    args = ap.parse_args()
    rows = []
    print(f"{'elements':>10} {'programs':>8} {'plain us':>9} {'PDL us':>8} {'saved us':>9}")
    for numel in map(int, args.sizes.split(",")):
        for programs in map(int, args.programs.split(",")):
            plain = chain_us(args.kernels, numel, programs, False)
            pdl = chain_us(args.kernels, numel, programs, True)
            rows.append(dict(elements=numel, programs=programs, plain_us=plain, pdl_us=pdl))
            print(f"{numel:>10} {programs:>8} {plain:>9.2f} {pdl:>8.2f} {plain - pdl:>9.2f}")
    gpu = torch.cuda.get_device_name().replace(" ", "_")
    out = Path(__file__).resolve().parent / "results" / f"pdl_chain_{gpu}.json"
    out.write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(), kernels=args.kernels, rows=rows), indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
