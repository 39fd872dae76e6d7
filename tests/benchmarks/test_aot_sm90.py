"""benchmarks/aot_sm90.py on the CPU: the fused MoE's w2 kernel compiles for sm_90 without a GPU, FP8 and
FP4 (byte-permute decode, inline PTX) alike, and the report reads registers, MMAs and layouts. In a
subprocess: the kernels must be imported compiled there, while this test process may hold them
interpreted (tests/kernels/conftest.py sets TRITON_INTERPRET before triton is imported)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _aot(*args: str) -> subprocess.CompletedProcess:
    """aot_sm90.py with `args`, compiled (TRITON_INTERPRET unset); it must exit 0."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "aot_sm90.py", *args], cwd=BENCH, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def test_w2_compiles_for_sm90_and_is_described():
    r = _aot("--kernels", "w2", "--configs", "4x4", "--variants", "fp8,fp4 prmt")
    rows = re.findall(r"w2 (fp8|fp4 prmt)\s+warps 4 stages 4: regs (\d+) local (\d+) B, dot kWidth \[([\d, ]+)\], "
                      r"\['(mma\.sync[^']*)'\], SASS (\d+)", r.stdout)
    assert [row[0] for row in rows] == ["fp8", "fp4 prmt"], r.stdout
    for _, regs, local, kwidths, _, sass in rows:
        assert 0 < int(regs) <= 255 and int(local) >= 0 and kwidths and int(sass) > 100
    traffic = re.findall(r"LDG (\d+), LDGSTS (\d+), LDS (\d+), LDSM (\d+), STS (\d+), STSM (\d+), BAR (\d+), "
                         r"HMMA (\d+)", r.stdout)
    assert len(traffic) == 2 and all(int(row[-1]) > 0 for row in traffic), r.stdout    # both run tensor-core MMAs


def test_the_swapped_probe_feeds_decoded_fp4_weights_to_wgmma():
    """With the weights as the dot's first operand, the FP4 decode reaches Hopper's wgmma (e4m3 x e4m3,
    the tokens as its N = 16) instead of the f16 mma.sync the grouped GEMMs compile to at 16 rows."""
    r = _aot("--kernels", "swap_ab", "--configs", "4x3", "--variants", "fp4 prmt")
    assert "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3" in r.stdout, r.stdout
    assert re.search(r"HMMA 0\b", r.stdout), r.stdout


def test_the_swapped_kernels_compile_to_wgmma():
    """The swap_ab forms (weights first) of w13 and w2 compile for sm_90 to wgmma e4m3, FP8 and FP4
    experts alike."""
    r = _aot("--kernels", "w13,w2", "--configs", "4x4", "--variants", "fp8,fp4 prmt", "--swap")
    assert r.stdout.count("wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3") == 4, r.stdout


def test_the_fp8_gemm_split_stride_stays_specialised_so_its_stores_vectorise():
    """fp8_gemm passes a split stride that is always a multiple of 16 (`split_partials`), so the kernel
    keeps Triton's divisibility specialisation of it; compiled without it (`--unspecialise stride_cs`,
    what do_not_specialize did), the epilogue's global stores become 2-byte scalars."""
    stores = {}
    for extra in ([], ["--unspecialise", "stride_cs"]):
        r = _aot("--kernels", "fp8_gemm", "--configs", "8x3", "--block-m", "128", *extra)
        assert "wgmma" in r.stdout, r.stdout
        stores[bool(extra)] = int(re.search(r"STG (\d+)", r.stdout)[1])
    assert 0 < stores[False] * 4 <= stores[True], stores


def test_the_attention_kernel_compiles_for_sm90_over_bf16_and_packed_fp8_pools():
    """`aot_sm90.py --kernels attention` compiles the sparse attention kernel over bf16 and packed FP8 pools
    and counts its narrow (1-2 byte) shared-memory accesses: none for bf16, a handful for the packed form,
    whose key tiles are built per 64-dim group (`_load_packed`). Under Triton 3.6 (the H200's) the earlier
    per-element exponent gather compiled to 320 of them at this tile; the Triton 3.9 that CI installs
    compiles that form without them too, so this checks the tool and today's kernel, not the regression."""
    r = _aot("--kernels", "attention", "--kv", "bf16,fp8", "--block-m", "64", "--configs", "8x2")
    narrow = [int(n) for n in re.findall(r"LDS/STS of 1-2 B (\d+)", r.stdout)]
    assert len(narrow) == 2 and narrow[0] == 0 and narrow[1] <= 16, r.stdout


def test_the_cuda_core_moe_kernels_keep_the_fp4_decode_out_of_shared_memory():
    """moe_gemv's w13 and w2 with FP4 experts, one row per program: no MMA, and no 1-2 byte shared
    accesses (the layout conversions a 3-D broadcast over the rows had put in the K loop)."""
    r = _aot("--kernels", "gemv13,gemv2", "--configs", "4x1", "--block-m", "1", "--variants", "fp4 prmt")
    traffic = re.findall(r"STS (\d+), STSM \d+, BAR \d+, HMMA (\d+), STG \d+, LDS/STS of 1-2 B (\d+)", r.stdout)
    assert len(traffic) == 2, r.stdout
    for sts, hmma, narrow in traffic:
        assert int(hmma) == 0 and int(narrow) == 0 and int(sts) <= 4, r.stdout


def test_the_mma_kernels_build_their_fragments_in_registers():
    """moe_mma's kernels: the FP8 mma.sync, no spills, and the FP4 decode in place: an FP4 kernel
    makes exactly the shared-memory accesses of its FP8 twin (the tile lookup's reduction and, with
    some Triton versions, the epilogue's layout change), none for its weights."""
    r = _aot("--kernels", "mma13,mma2", "--configs", "4x1", "--variants", "fp8,fp4 prmt")
    rows = re.findall(r"(mma13|mma2) (fp8|fp4 prmt)\s+warps 4 stages 1: regs (\d+) local (\d+) B, .*"
                      r"'(mma\.sync\.aligned\.m16n8k32\.row\.col\.f32\.e4m3\.e4m3\.f32)'", r.stdout)
    assert len(rows) == 4, r.stdout
    assert all(0 < int(regs) <= 255 and int(local) == 0 for _, _, regs, local, _ in rows), r.stdout
    shared = re.findall(r"LDS (\d+), LDSM (\d+), STS (\d+), STSM (\d+), BAR \d+, HMMA (\d+)", r.stdout)
    assert len(shared) == 4 and all(int(row[-1]) > 0 for row in shared), r.stdout
    (w13_fp8, w13_fp4, w2_fp8, w2_fp4) = (row[:4] for row in shared)
    assert w13_fp4 == w13_fp8 and w2_fp4 == w2_fp8, r.stdout


def test_the_pdl_gate_precedes_every_global_access():
    """Compiled with PDL (`deepinfer_kernels.pdl`), a kernel's PTX waits for its predecessor before its
    first global load, store or async copy; the FP8 GEMM's weight prefetches come before the wait."""
    r = _aot("--pdl", "--kernels", "fp8_gemm,mma13,mma2,w2", "--configs", "4x1", "--variants", "fp8,fp4 prmt")
    gates = re.findall(r"^\s*(\w+) (fp8|fp4 prmt)\s.*pdl \{'gated': (\w+), 'wait_first': (\w+), "
                       r"'prefetches_before': (\d+)\}", r.stdout, re.M)
    assert [(g[0], g[1]) for g in gates] == [("fp8_gemm", "fp8"), ("mma13", "fp8"), ("mma13", "fp4 prmt"),
                                             ("mma2", "fp8"), ("mma2", "fp4 prmt"), ("w2", "fp8"),
                                             ("w2", "fp4 prmt")], r.stdout
    assert all(g[2] == g[3] == "True" for g in gates), r.stdout
    assert int(gates[0][4]) > 0 and all(int(g[4]) == 0 for g in gates[1:]), r.stdout
