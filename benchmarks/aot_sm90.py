"""Compile the fused MoE's grouped GEMMs for sm_90 on a machine without a GPU (Triton ahead of time,
V4-Flash sizes, bf16 + QAT, the specialisation the JIT gives on the device: 16-byte aligned pointers,
sizes divisible by 16) and report per variant what the compiled kernel is: registers and local memory
(spills; cuobjdump), the MMA instructions (PTX), the dot operands' layouts (`kWidth` of each `tt.dot`'s operands in
the TTGIR: the K grouping inside the MMAs, which decides the fp32 rounding of the sums) and the SASS
instruction count, and how many of its instructions (static counts, the whole kernel) are memory, barrier
and MMA ones (LDG global loads, LDGSTS async copies into shared memory, LDS / LDSM shared loads, STS / STSM
shared stores, BAR barriers, HMMA tensor-core MMAs, STG global stores): a decode that goes through shared
memory shows there. `--kernels fp8_gemm`: the dense FP8 GEMM at a prefill tile; `--unspecialise stride_cs`
compiles its split stride as `do_not_specialize` did (its epilogue then stores 2-byte scalars).
`--kernels attention --kv bf16,fp8 --block-m 64 --configs 8x2` (`--block-m` is the heads per program
there; 16 with `--configs 4x2` is the decode tile): the sparse attention over bf16 or packed FP8 pools.

Variants: the FP8 weights; FP4 experts with the integer decode; FP4 experts with the byte-permute
decode (PRMT). `--kernels swap_ab`: a probe with the operands swapped (weights first, tokens
second), to see whether the decoded weights reach wgmma as its register operand; `--swap`: the
kernels with their operands swapped (moe_w13 / moe_w2 swap_ab). The H200 runs Triton 3.6: put a
3.6 install first on PYTHONPATH to see what it compiles (`pip install --target DIR triton==3.6.0`);
layouts may differ between Triton versions.

    python benchmarks/aot_sm90.py [--configs 4x4,8x2] [--kernels w13,w2] [--block-m 16]
"""
from __future__ import annotations

import argparse
import inspect
import os
import re
import subprocess
import tempfile
from collections import Counter
from functools import partial

import triton
import triton.language as tl
from deepinfer_kernels import fp8_gemm as F
from deepinfer_kernels import moe_gemm as M
from deepinfer_kernels import moe_gemv as G
from deepinfer_kernels import moe_mma as MM
from deepinfer_kernels import sparse_attention as S
from deepinfer_kernels.fp4_experts import fp4_tile
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TARGET = GPUTarget("cuda", 90, 32)
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
TRAFFIC = ("LDG", "LDGSTS", "LDS", "LDSM", "STS", "STSM", "BAR", "HMMA", "STG")
VARIANTS = {"fp8": (False, False), "fp4 integer": (True, False), "fp4 prmt": (True, True)}   # (W4, PRMT)


UNSPECIALISED: set[str] = set()     # --unspecialise: more i32 arguments compiled as the JIT's do_not_specialize
PDL = {"on": False}                 # --pdl: kernels compiled with their launch gate (and the FP8 GEMM's prefetch)
GLOBAL_ACCESS = re.compile(r"\b(?:ld|st|atom|red)\.(?:\w+\.)*global|\bcp\.async")


def _compile(fn, sig: dict, const: dict, warps: int, stages: int):
    names = fn.arg_names
    # constexprs with defaults (the PDL gate and the GEMMs' weight prefetch: off, as without PDL)
    defaults = {k: p.default for k, p in inspect.signature(fn.fn).parameters.items()
                if p.default is not inspect.Parameter.empty}
    const = {**defaults, **const}
    if PDL["on"] and "PDL" in names:
        const["PDL"] = True
    sig = {**sig, **{k: "constexpr" for k in const}}
    # the JIT's specialisation on the device: aligned pointers, i32 sizes divisible by 16 (not the counts,
    # not the kernel's do_not_specialize arguments)
    plain = {"E1", "E4", "n_clamped", *fn.do_not_specialize, *UNSPECIALISED}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if sig.get(n, "").startswith("*") or (sig.get(n) == "i32" and n not in plain)}
    src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in const.items()}, attrs=attrs)
    return triton.compile(src, target=TARGET, options=dict(num_warps=warps, num_stages=stages))


def w13(w4: bool, prmt: bool, warps: int, stages: int, block_m: int, swap: bool = False):
    sig = dict(x_ptr="*fp8e4nv", xs_ptr="*fp32", w_ptr="*fp8e4nv", ws_ptr="*fp32", p_ptr="*u8", g_ptr="*u8",
               order_ptr="*i64", rw_ptr="*fp32", sched_ptr="*i32", a_ptr="*fp8e4nv", as_ptr="*fp32", I="i32",
               D="i32", E1="i32", E4="i32", n_clamped="i32", limit="fp32", stride_x="i32", stride_a="i32")
    const = dict(K1=7, EB=512, N_KG=32, NB_I=16, BLOCK_M=block_m, BLOCK_N=128, BLOCK_K=128, QAT_IN=True,
                 QAT_OUT=True, CDT=tl.bfloat16, XDT=tl.bfloat16, IEEE=False, UPCAST=False, PRECISE_ACC=32, W4=w4,
                 SUB=32, PRMT=prmt, SWAP=swap)
    return _compile(M._moe_w13_kernel, sig, const, warps, stages)


def w2(w4: bool, prmt: bool, warps: int, stages: int, block_m: int, swap: bool = False):
    sig = dict(a_ptr="*fp8e4nv", as_ptr="*fp32", w_ptr="*fp8e4nv", ws_ptr="*fp32", p_ptr="*u8", g_ptr="*u8",
               order_ptr="*i64", sched_ptr="*i32", y_ptr="*bf16", D="i32", I="i32", E1="i32", E4="i32",
               stride_a="i32", stride_y="i32")
    const = dict(EB=512, N_KG=16, NB_D=32, BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=128, QAT=True, CDT=tl.bfloat16,
                 IEEE=False, UPCAST=False, PRECISE_ACC=32, W4=w4, SUB=32, PRMT=prmt, SWAP=swap)
    return _compile(M._moe_w2_kernel, sig, const, warps, stages)


def gemv13(w4: bool, prmt: bool, warps: int, stages: int, block_m: int, block_n: int = 32):
    """The CUDA-core w13 (`moe_gemv`), block_m = its rows per program."""
    sig = dict(x_ptr="*fp32", w_ptr="*fp8e4nv", ws_ptr="*fp32", p_ptr="*u8", g_ptr="*u8",
               order_ptr="*i64", rw_ptr="*fp32", sched_ptr="*i32", a_ptr="*bf16", I="i32", D="i32", E1="i32",
               E4="i32", n_clamped="i32", limit="fp32", stride_x="i32", stride_a="i32")
    const = dict(K1=7, EB=512, N_KG=32, NB_I=16, M=block_m, BLOCK_N=block_n, QAT_OUT=True,
                 CDT=tl.bfloat16, XDT=tl.bfloat16, W4=w4, PRMT=prmt, STAGES=stages)
    return _compile(G._gemv_w13_kernel, sig, const, warps, stages)


def gemv2(w4: bool, prmt: bool, warps: int, stages: int, block_m: int, block_n: int = 32):
    sig = dict(a_ptr="*fp32", w_ptr="*fp8e4nv", ws_ptr="*fp32", p_ptr="*u8", g_ptr="*u8", order_ptr="*i64",
               sched_ptr="*i32", y_ptr="*bf16", D="i32", I="i32", E1="i32", E4="i32", stride_a="i32", stride_y="i32")
    const = dict(EB=512, N_KG=16, NB_D=32, M=block_m, BLOCK_N=block_n, W4=w4, PRMT=prmt, STAGES=stages)
    return _compile(G._gemv_w2_kernel, sig, const, warps, stages)


def mma13(w4: bool, prmt: bool, warps: int, stages: int, block_m: int):
    """The mma.sync w13 (`moe_mma`; `stages` is its PREFETCH, 0 or 1; always compiled with its inline
    PTX, the FP4 variants' decoder choice does not apply)."""
    sig = dict(x_ptr="*fp8e4nv", xs_ptr="*fp32", w_ptr="*fp8e4nv", ws_ptr="*fp32", p_ptr="*u8", g_ptr="*u8",
               order_ptr="*i64", rw_ptr="*fp32", sched_ptr="*i32", a_ptr="*bf16", I="i32", D="i32", E1="i32",
               E4="i32", n_clamped="i32", limit="fp32", x_words="i32", stride_a="i32")
    const = dict(K1=7, EB=512, N_KG=32, NB_I=16, NW=warps, CDT=tl.bfloat16, XDT=tl.bfloat16, W4=w4, PRMT=True,
                 PREFETCH=bool(stages))
    return _compile(MM._mma_w13_kernel, sig, const, warps, 1)


def mma2(w4: bool, prmt: bool, warps: int, stages: int, block_m: int):
    sig = dict(a_ptr="*fp8e4nv", as_ptr="*fp32", w_ptr="*fp8e4nv", ws_ptr="*fp32", p_ptr="*u8", g_ptr="*u8",
               order_ptr="*i64", sched_ptr="*i32", y_ptr="*bf16", D="i32", I="i32", E1="i32", E4="i32",
               a_words="i32", stride_y="i32")
    const = dict(EB=512, N_KG=16, NB_D=32, NW=warps, W4=w4, PRMT=True, PREFETCH=bool(stages))
    return _compile(MM._mma_w2_kernel, sig, const, warps, 1)


def fp8_gemm(w4: bool, prmt: bool, warps: int, stages: int, block_m: int, block: int = 128):
    """The dense FP8 linear's GEMM (`fp8_gemm._fp8_gemm_kernel`) at a prefill tile, V4-Flash's K = 4096,
    weights in `block` x `block` scale blocks (128: V4; 32: V4.1, fp8_gemm32)."""
    sig = dict(a_ptr="*fp8e4nv", as_ptr="*fp32", w_ptr="*fp8e4nv", ws_ptr="*fp32", c_ptr="*bf16", M="i32", N="i32",
               K="i32", stride_am="i32", stride_wn="i32", stride_cm="i32", stride_cs="i32")
    const = dict(N_KG=4096 // block, N_AG=32, BLOCK_M=block_m, BLOCK_N=128, BLOCK_K=block, GROUP_M=8, WB=block,
                 PRECISE_ACC=min(F.PROMOTE_EVERY, block), KG_PER_SPLIT=4096 // block, FOLD=block == 128,
                 PREFETCH=PDL["on"])
    return _compile(F._fp8_gemm_kernel, sig, const, warps, stages)


def attention(kv_fp8: bool, warps: int, stages: int, block_h: int):
    """The sparse attention kernel over CSA rows (D 512, 32-key tiles), its ring and compressed rows
    bf16 or packed FP8 (kv_fp8: 448 e4m3 + 64 bf16 RoPE + 7 exponent bytes per row); 64 heads per
    program is the prefill tile, fewer the decode one (with split-KV)."""
    nope = 448 if kv_fp8 else 0
    pool = "*u8" if kv_fp8 else "*bf16"
    sig = dict(q_ptr="*bf16", kv_ptr="*bf16", ring_ptr=pool, ring16_ptr="*bf16", sink_ptr="*fp32", out_ptr="*bf16",
               ws_acc_ptr="*fp32", ws_ml_ptr="*fp32", cu_ptr="*i32", start_ptr="*i32", tseq_ptr="*i32",
               pos_ptr="*i32", slots_ptr="*i32", comp_ptr=pool, comp16_ptr="*bf16", bt_ptr="*i32", idx_ptr="*i32",
               H="i32", R="i32", window="i32", n_idx="i32", ratio="i32", qk_scale="fp32", chunk="i32", s_qt="i32",
               s_qh="i32", s_kv="i32", s_rs="i32", s_rr="i32", s_cb="i32", s_cr="i32", s_bt="i32", s_idx="i32",
               s_ot="i32", s_oh="i32")
    const = dict(D=512, BLOCK_H=block_h, BLOCK_N=32, RPB=64, COMP=1, CLAMP=True, SPLIT=block_h < 64, UPCAST=False,
                 IEEE=False, RING_NOPE=nope, COMP_NOPE=nope)
    return _compile(S._sparse_attn_kernel, sig, const, warps, stages)


@triton.jit
def _swap_ab_probe(p_ptr, g_ptr, s_ptr, x_ptr, y_ptr, K, stride_x, stride_y, BN: tl.constexpr, BM: tl.constexpr,
                   PRMT: tl.constexpr):
    """y^T = W x^T for one BN-row tile of an FP4 expert and BM tokens: the decoded weights are the
    dot's first operand (wgmma's A, which may come from registers), the tokens its second (from
    shared memory), one fresh dot per 128-deep block as in the grouped GEMMs. Compiled only here, to
    see the layouts; not a kernel the engine runs."""
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rm = tl.arange(0, BM)
    scale = tl.load(s_ptr + rn)
    acc = tl.zeros((BN, BM), tl.float32)
    for k0 in range(0, K, 128):
        part = tl.zeros((BN, BM), tl.float32)
        for kk in tl.static_range(4):
            w = tl.trans(fp4_tile(p_ptr, g_ptr, rn, rn >= 0, k0 + kk * 32, K, scale, BN, 32, PRMT))
            xt = tl.load(x_ptr + rm[None, :] * stride_x + (k0 + kk * 32 + tl.arange(0, 32))[:, None])
            part = tl.dot(w, xt, part)
        acc += part * scale[:, None]
    tl.store(y_ptr + rm[None, :] * stride_y + rn[:, None], acc.to(tl.bfloat16))


def swap_ab(w4: bool, prmt: bool, warps: int, stages: int, block_m: int):
    sig = dict(p_ptr="*u8", g_ptr="*u8", s_ptr="*fp32", x_ptr="*fp8e4nv", y_ptr="*bf16", K="i32", stride_x="i32",
               stride_y="i32")
    return _compile(_swap_ab_probe, sig, dict(BN=64, BM=block_m, PRMT=prmt), warps, stages)


def pdl_gate_order(ptx: str) -> dict:
    """Where the PDL gate sits in the PTX: `griddepcontrol.wait` must come before the first global load,
    store or async copy (only L2 prefetches may precede it)."""
    wait = ptx.find("griddepcontrol.wait")
    first = GLOBAL_ACCESS.search(ptx)
    return dict(gated=wait >= 0, wait_first=wait >= 0 and (first is None or wait < first.start()),
                prefetches_before=ptx.count("prefetch.global.L2", 0, max(wait, 0)))


def describe(kernel) -> dict:
    """Registers and local memory (spills) of the cubin, MMA instructions, dot operand kWidths, SASS
    instruction count, the PDL gate's place."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        open(cubin, "wb").write(kernel.asm["cubin"])
        usage = subprocess.run([os.path.join(BIN, "cuobjdump"), "--dump-resource-usage", cubin],
                               capture_output=True, text=True).stdout
        sass = subprocess.run([os.path.join(BIN, "nvdisasm"), cubin], capture_output=True, text=True).stdout
    ops = re.findall(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass, re.M)
    regs, local = re.search(r"REG:(\d+)", usage), re.search(r"LOCAL:(\d+)", usage)
    return dict(registers=int(regs[1]) if regs else None, local_bytes=int(local[1]) if local else None,
                mma=sorted(set(re.findall(r"(?:wgmma|mma)\.[\w.]+", kernel.asm["ptx"]))),
                dot_kwidths=sorted({int(k) for k in re.findall(r"dot_op<\{opIdx = \d, parent = #\w+, kWidth = (\d+)",
                                                               kernel.asm["ttgir"])}),
                pdl=pdl_gate_order(kernel.asm["ptx"]), sass_instructions=len(ops),
                top_sass=Counter(o.split(".")[0] for o in ops).most_common(6),
                traffic={**{k: sum(o.split(".")[0] == k for o in ops) for k in TRAFFIC},
                         "LDS/STS of 1-2 B": sum(o.split(".")[0] in ("LDS", "STS") and o.endswith(("U8", "U16"))
                                                  for o in ops)})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="4x4,8x2", help="num_warps x num_stages, comma separated")
    ap.add_argument("--kernels", default="w13,w2", help="w13, w2, gemv13, gemv2 (the CUDA-core kernels), mma13, mma2 (the mma.sync ones; "
                    "--configs WARPSxPREFETCH), swap_ab (a probe of the grouped GEMMs with the "
                    "operands swapped; FP4 variants only; see _swap_ab_probe), fp8_gemm (the dense FP8 GEMM; the "
                    "fp8 variant only; --block-m 128 is its prefill tile), fp8_gemm32 (the same over 32x32 weight "
                    "blocks, V4.1) and/or attention (see --kv)")
    ap.add_argument("--kv", default="bf16,fp8", help="--kernels attention: the pools' forms (bf16, fp8 packed)")
    ap.add_argument("--unspecialise", default="", help="i32 arguments to compile without the divisibility "
                    "specialisation, as do_not_specialize would (e.g. stride_cs)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"of {list(VARIANTS)}")
    ap.add_argument("--block-m", type=int, default=16)
    ap.add_argument("--block-n", type=int, default=32, help="--kernels gemv13,gemv2: outputs per program")
    ap.add_argument("--swap", action="store_true", help="compile w13 / w2 with their operands swapped (swap_ab)")
    ap.add_argument("--pdl", action="store_true", help="compile with the PDL gate (deepinfer_kernels.pdl) and "
                    "report whether it precedes every global access")
    a = ap.parse_args()
    PDL["on"] = a.pdl
    UNSPECIALISED.update(filter(None, a.unspecialise.split(",")))
    print(f"Triton {triton.__version__}, target sm_90, BLOCK_M {a.block_m}")
    for name in a.kernels.split(","):
        if name == "attention":
            for kv in a.kv.split(","):
                for cfg in a.configs.split(","):
                    warps, stages = (int(x) for x in cfg.split("x"))
                    d = describe(attention(kv == "fp8", warps, stages, a.block_m))
                    print(f"attention {kv} pools, {a.block_m} heads, warps {warps} stages {stages}: regs "
                          f"{d['registers']} local {d['local_bytes']} B, SASS {d['sass_instructions']}, pdl {d['pdl']}",
                          flush=True)
                    print("    " + ", ".join(f"{k} {n}" for k, n in d["traffic"].items()))
            continue
        build = {"w13": partial(w13, swap=a.swap), "w2": partial(w2, swap=a.swap), "swap_ab": swap_ab,
                 "fp8_gemm": fp8_gemm, "fp8_gemm32": partial(fp8_gemm, block=32),
                 "gemv13": partial(gemv13, block_n=a.block_n), "gemv2": partial(gemv2, block_n=a.block_n),
                 "mma13": mma13, "mma2": mma2}[name]
        for variant in a.variants.split(","):
            w4, prmt = VARIANTS[variant]
            if (name == "swap_ab" and not w4) or (name.startswith("fp8_gemm") and w4):
                continue
            for cfg in a.configs.split(","):
                warps, stages = (int(x) for x in cfg.split("x"))
                d = describe(build(w4, prmt, warps, stages, a.block_m))
                print(f"{name:>4} {variant:<12} warps {warps} stages {stages}: regs {d['registers']} local "
                      f"{d['local_bytes']} B, dot kWidth {d['dot_kwidths']}, {d['mma']}, SASS {d['sass_instructions']}"
                      f" {d['top_sass']}, pdl {d['pdl']}", flush=True)
                print(f"{'':>4} {'':<12} {'':>19}  " + ", ".join(f"{k} {n}" for k, n in d["traffic"].items()))


if __name__ == "__main__":
    main()
