"""The fused MoE's grouped GEMMs at decode sizes on `mma.sync` with the operands built in registers
(W4A8 for FP4 experts, W8A8 for FP8 ones: FP8 activations, the QAT numerics).

The CUDA-core kernels (`moe_gemv`) spend ~9 instructions per FP4 weight (decode, widen to float32, one
multiply-add per row); the tensor-core tiles (`moe_gemm`) pass each decoded tile through shared memory
into the MMA layout. Here each thread loads exactly the bytes its MMA fragments hold, decodes them in
place and issues the MMAs itself (inline PTX): no shared memory, and one MMA serves up to 8 rows
(tokens) of an expert.

The fragments, in `mma.sync.m16n8k32.e4m3` terms. A warp computes 16 weight rows (n, n + 8 for lane
group g = lane / 4) against the tile's 8 rows (the MMA's N; token g feeds lane group g). Within a
128-deep block, lane q = lane % 4 holds inputs 32q..32q+31 of its rows: one FP4 scale group, 16 code
bytes or 32 FP8 bytes, one 16-byte load per row. MMA step j of the block takes inputs 32q + 8j .. +7
of every lane: their even inputs are the fragment's columns 4q..4q+3 and the odd ones columns
4q+16..4q+19, for the weights and the activations alike. Hopper has no e4m3 `mma.sync`: ptxas turns
each into two f16 MMAs from zero (the operands' low halves, then the high halves, each register's two
e4m3 bytes converted to an f16 pair) and a float32 add into the accumulator, and the conversions cost
more than the MMAs. FP8 weights take that path; FP4 weights skip the e4m3 bytes and the conversions:
their codes decode straight to f16 pairs (`_fp4_block_ptx`: a lookup of the f16 high bytes, exact
for every value the re-encoding holds) placed as ptxas places the converted ones, with the same MMAs
and adds, so FP4 and FP8 experts give the same bits. The block's sums are then scaled by the weight
block's scale times the activation's (powers of two) and accumulated in float32.

Under Triton's interpreter (CI) inline PTX cannot run: the same loads feed an emulation that forms
the same fragments' products and sums them in its own order (FP4 = FP8 bits there too; compiled and
interpreted agree to float32 rounding). The e4m3 `mma.sync` needs sm_89+ (Ada, Hopper, Blackwell).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp4_experts import code_e4m3, code_row, decode_ptx, group_row, word_codes
from .moe_gemm import TL_DTYPES, Experts, _check_experts, _find_tile, _interpreted, _round, swiglu, w2_output
from .moe_routing import TILE1_BEGIN, TILE2_BEGIN
from .pdl import launch_args, pdl_gate

BLOCK_K = 128           # the quantisation block
ROWS = 8                # tile rows (tokens) per program: the MMA's N
_TILE1 = tl.constexpr(TILE1_BEGIN)
_TILE2 = tl.constexpr(TILE2_BEGIN)
_ROWS = tl.constexpr(ROWS)
_BK = tl.constexpr(BLOCK_K)

_MMA = "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {$0, $1, $2, $3}, {g0, h0, g1, h1}, {b0, b1}, " \
       "{$0, $1, $2, $3};"


def _split(dst_even: str, dst_odd: str, lo: str, hi: str) -> str:
    """Eight bytes (two words, inputs k..k+7) to their even and odd inputs' words."""
    return f"prmt.b32 {dst_even}, {lo}, {hi}, 0x6420;\nprmt.b32 {dst_odd}, {lo}, {hi}, 0x7531;\n"


def _fp8_block_ptx() -> str:
    """One 128-deep block of FP8 weights: four MMA steps into the block's sums $0-$3 (float32: rows n /
    n + 8 times tile rows 2q / 2q + 1) from $4-$11 / $12-$19, the weight words of rows n / n + 8, and
    $20-$27, the activation words (inputs 32q..32q+31 of token g). Hopper has no e4m3 `mma.sync`: ptxas
    converts each operand register's halves to f16x2 and runs two f16 MMAs from zero, the low halves
    first, then adds their sums to the accumulator in float32 (the FP4 block below does exactly that on
    the same f16 operands)."""
    text = ["{", ".reg .b32 g0, g1, h0, h1, b0, b1;"] + [f"mov.b32 ${i}, 0;" for i in range(4)]
    for j in range(4):
        text.append(_split("g0", "g1", f"${4 + 2 * j}", f"${5 + 2 * j}"))
        text.append(_split("h0", "h1", f"${12 + 2 * j}", f"${13 + 2 * j}"))
        text.append(_split("b0", "b1", f"${20 + 2 * j}", f"${21 + 2 * j}"))
        text.append(_MMA)
    return "\n".join(text + ["}"])


# The e2m1 magnitudes (0, .5, 1, 1.5 | 2, 3, 4, 6) times 2^t as the high bytes of their f16 values (whose
# low bytes are 0: one significant bit below the leading one): two words, base + t * step (the exponent
# field steps by 4 in that byte). Every value the loader keeps FP4 (>= 2^-9, <= 448) is an f16 normal, so
# there is no other case; a group that cannot hold those values holds only zeros, and byte 0 stays 0.
_F16_A, _F16_A_STEP = tl.constexpr(0x3E3C3800), tl.constexpr(0x04040400)
_F16_B, _F16_B_STEP = tl.constexpr(0x46444240), tl.constexpr(0x04040404)


def _fp4_block_ptx() -> str:
    """One 128-deep block of FP4 weights on f16 MMAs, the products and sums of the FP8 block above (the
    same f16 operands in the same places): $4-$7 / $8-$11 the code words of rows n / n + 8 (word j:
    inputs 32q + 8j..+7), $12-$15 their f16 lookup tables (A, B of row n, then of row n + 8), $16-$31
    the activations as f16 pairs (`_ACT_F16`: step j's four words from $16 + 4j). Per code word: the
    byte-permute decode to the f16 high bytes of its even / odd inputs (signs in place), then four byte
    permutes spread them into f16 pairs with zero low bytes: 11 integer instructions per 8 weights."""
    text = ["{", ".reg .b32 a, s, o, en, on, e8, o8, p0, p1, p2, p3;", ".reg .f32 d0, d1, d2, d3, z;",
            "mov.f32 z, 0f00000000;"] + [f"mov.b32 ${i}, 0;" for i in range(4)]
    for j in range(4):
        text.append(decode_ptx(f"${4 + j}", "$12", "$13", "en", "on"))
        text.append(decode_ptx(f"${8 + j}", "$14", "$15", "e8", "o8"))
        for half, sel in ((0, "0x1404"), (1, "0x3424")):          # inputs 0-3, then 4-7 of the step
            text += [f"prmt.b32 p{i}, {w}, 0, {sel};" for i, w in enumerate(("en", "e8", "on", "o8"))]
            b, c = 16 + 4 * j + 2 * half, ("{z, z, z, z}", "{d0, d1, d2, d3}")[half]
            text.append("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {d0, d1, d2, d3}, {p0, p1, p2, p3}, "
                        f"{{${b}, ${b + 1}}}, {c};")
        text += [f"add.f32 ${i}, ${i}, d{i};" for i in range(4)]
    return "\n".join(text + ["}"])


def _act_f16_ptx() -> str:
    """A lane's 8 activation words (e4m3, inputs 32q..32q+31: $16-$19, $20-$23) to the f16 pairs the FP4
    block's MMAs take, step j's in $4j..$4j+3: inputs (0, 2), (1, 3), (4, 6), (5, 7) of the step."""
    text = ["{", ".reg .b32 e, o;", ".reg .b16 l, h;"]
    for j in range(4):
        text.append(_split("e", "o", f"${16 + 2 * j}", f"${17 + 2 * j}"))
        for k, word in enumerate(("e", "o")):
            text += [f"mov.b32 {{l, h}}, {word};", f"cvt.rn.f16x2.e4m3x2 ${4 * j + k}, l;",
                     f"cvt.rn.f16x2.e4m3x2 ${4 * j + 2 + k}, h;"]
    return "\n".join(text + ["}"])


_FP4_BLOCK = tl.constexpr(_fp4_block_ptx())
_FP8_BLOCK = tl.constexpr(_fp8_block_ptx())
_ACT_F16 = tl.constexpr(_act_f16_ptx())
_FP4_ARGS = tl.constexpr(",".join(["=r"] * 4 + ["r"] * 28))
_FP8_ARGS = tl.constexpr(",".join(["=r"] * 4 + ["r"] * 24))
_ACT_ARGS = tl.constexpr(",".join(["=r"] * 16 + ["r"] * 8))


@triton.jit
def _e4m3_values(lo, hi, NT: tl.constexpr):
    """[NT, 4] + [NT, 4] words (32 e4m3 bytes per thread, in input order) -> [NT, 32] float32."""
    words = tl.reshape(tl.permute(tl.join(lo, hi), (0, 2, 1)), (NT, 8))
    b = (words[:, :, None] >> (tl.arange(0, 4) * 8)[None, None, :]) & 0xFF
    return tl.reshape(b, (NT, 32)).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def _fp4_values(codes, t, NT: tl.constexpr):
    """[NT, 4] code words (inputs 32q..32q+31 of one row, decode order) and the group's shift [NT] ->
    [NT, 32] float32: the e4m3 values of the re-encoding."""
    nib = tl.reshape(word_codes(codes), (NT, 32))
    return code_e4m3(nib, tl.broadcast_to(t.to(tl.int16)[:, None], (NT, 32))).to(tl.float32)


@triton.jit
def _mma_emulated(wn, w8, x, NW: tl.constexpr):
    """What the four MMA steps compute, from each lane's [32] weights of rows n and n + 8 and [32]
    activations of token g: the warp's [16 rows, 8 tokens] sums, handed back in the accumulator
    fragments' places ([32 * NW, 4]: rows n / n + 8 times tokens 2q / 2q + 1)."""
    x4 = tl.reshape(x, (NW, 1, 8, 4, 32))                     # (warp, -, token, q, input)
    wn4 = tl.reshape(wn, (NW, 8, 1, 4, 32))                    # (warp, g, -, q, input)
    dn = tl.sum(tl.sum(wn4 * x4, axis=4), axis=3)               # [NW, 8 rows, 8 tokens]
    d8 = tl.sum(tl.sum(tl.reshape(w8, (NW, 8, 1, 4, 32)) * x4, axis=4), axis=3)
    dn = tl.reshape(dn, (32 * NW, 2))                           # lane (g, q): tokens 2q, 2q + 1
    d8 = tl.reshape(d8, (32 * NW, 2))
    return tl.reshape(tl.permute(tl.join(dn, d8), (0, 2, 1)), (32 * NW, 4))


@triton.jit
def _sums_fp4(codes_n, codes_8, t_n, t_8, act_lo, act_hi, b0, b1, b2, b3, el, NW: tl.constexpr,
              PRMT: tl.constexpr):
    """One FP4 block's [32 * NW, 4] sums from the code words of rows n / n + 8 ([32 * NW, 4]: lane q's
    inputs) and their groups' shifts t ([32 * NW]); b0-b3: the activations as `_act_f16` gives them
    (compiled), else act_lo / act_hi are used."""
    if PRMT:
        high = (el & 1) == 1
        t = tl.where(el < 2, t_n[:, None], t_8[:, None])
        lut = t * tl.where(high, _F16_B_STEP, _F16_A_STEP) + tl.where(high, _F16_B, _F16_A)
        d = tl.inline_asm_elementwise(_FP4_BLOCK, _FP4_ARGS, [codes_n, codes_8, lut, b0, b1, b2, b3],
                                      dtype=tl.uint32, is_pure=True, pack=4)
        return d.to(tl.float32, bitcast=True)
    return _mma_emulated(_fp4_values(codes_n, t_n, 32 * NW), _fp4_values(codes_8, t_8, 32 * NW),
                         _e4m3_values(act_lo, act_hi, 32 * NW), NW)


@triton.jit
def _act_f16(act_lo, act_hi, PRMT: tl.constexpr):
    """The FP4 block's f16 activation pairs (four [32 * NW, 4] words: steps 0-3), compiled only."""
    if PRMT:
        return tl.inline_asm_elementwise(_ACT_F16, _ACT_ARGS, [act_lo, act_hi],
                                         dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32), is_pure=True, pack=4)
    return act_lo, act_lo, act_lo, act_lo


@triton.jit
def _sums_fp8(n_lo, n_hi, e_lo, e_hi, act_lo, act_hi, NW: tl.constexpr, PRMT: tl.constexpr):
    """One FP8 block's sums from the weight words of rows n (n_lo, n_hi) and n + 8 (e_lo, e_hi)."""
    if PRMT:
        d = tl.inline_asm_elementwise(_FP8_BLOCK, _FP8_ARGS, [n_lo, n_hi, e_lo, e_hi, act_lo, act_hi],
                                      dtype=tl.uint32, is_pure=True, pack=4)
        return d.to(tl.float32, bitcast=True)
    return _mma_emulated(_e4m3_values(n_lo, n_hi, 32 * NW), _e4m3_values(e_lo, e_hi, 32 * NW),
                         _e4m3_values(act_lo, act_hi, 32 * NW), NW)


@triton.jit
def _block_exp(scale):
    """S + 127 of a block scale 2^S."""
    return (scale.to(tl.int32, bitcast=True) >> 23) & 0xFF


@triton.jit
def _inputs(x32, ok_in, xs_row, ok_out, sa_ptr, sb_ptr, kb, el):
    """Block kb's activation words (lane q's inputs of token g), the tile rows' activation scales and
    the two weight block scales."""
    act_lo = tl.load(x32[:, None] + kb * 32 + el, mask=ok_in[:, None], other=0)
    act_hi = tl.load(x32[:, None] + kb * 32 + 4 + el, mask=ok_in[:, None], other=0)
    sx = tl.load(xs_row + kb, mask=ok_out, other=0.0)
    return act_lo, act_hi, sx, tl.load(sa_ptr + kb), tl.load(sb_ptr + kb)


@triton.jit
def _fp4_codes(pa, pb, ga, gb, kb, el):
    """Block kb's code words of rows n / n + 8 of both row sets and their raw scale bytes (resident
    tiles: a block's 1 KB of codes and 64 scale bytes, rows n + 8 in the second half)."""
    return (tl.load(pa[:, None] + kb * 256 + el), tl.load(pa[:, None] + 128 + kb * 256 + el),
            tl.load(pb[:, None] + kb * 256 + el), tl.load(pb[:, None] + 128 + kb * 256 + el),
            tl.load(ga + kb * 64).to(tl.int32), tl.load(ga + 32 + kb * 64).to(tl.int32),
            tl.load(gb + kb * 64).to(tl.int32), tl.load(gb + 32 + kb * 64).to(tl.int32))


@triton.jit
def _fp8_words(wa, wb, r8w, kb, el):
    """Block kb's weight words of rows n / n + 8 of both row sets (low and high 16 bytes each)."""
    o = kb * 32 + el
    return (tl.load(wa[:, None] + o), tl.load(wa[:, None] + o + 4), tl.load(wa[:, None] + r8w + o),
            tl.load(wa[:, None] + r8w + o + 4), tl.load(wb[:, None] + o), tl.load(wb[:, None] + o + 4),
            tl.load(wb[:, None] + r8w + o), tl.load(wb[:, None] + r8w + o + 4))


@triton.jit
def _expert_sums(x32, ok_in, xs_row, ok_out, sa_ptr, sb_ptr, w_ptr, p_ptr, g_ptr, row, row_b, K, e, E4,
                 N_KG: tl.constexpr, NW: tl.constexpr, W4: tl.constexpr, PRMT: tl.constexpr,
                 PREFETCH: tl.constexpr):
    """Two [32 * NW, 4] float32 sums, of rows `row` / `row` + 8 (set a) and the same plus `row_b` (set
    b) of expert e (a [rows, K] weight; `w_ptr` its FP8 form's start, `p_ptr` / `g_ptr` the FP4
    form's) times the tile's activations (`x32`: each lane's activation words, `xs_row` the tile rows'
    scales), over all of K, each block scaled by its weight scale (`sa_ptr` / `sb_ptr`, along K) and
    the activations'. Each step loads the next block: with `PREFETCH` before it works on the current
    one (its loads in flight meanwhile, in registers), else after."""
    el = tl.arange(0, 4)[None, :]
    q = tl.arange(0, 32 * NW) % 4
    acc_a = tl.zeros((32 * NW, 4), tl.float32)
    acc_b = tl.zeros((32 * NW, 4), tl.float32)
    words8 = tl.multiple_of(K // 4, 32)            # FP8 weight words per row (K a multiple of 128)
    act_lo, act_hi, sx, sa, sb = _inputs(x32, ok_in, xs_row, ok_out, sa_ptr, sb_ptr, 0, el)
    if W4 and e < E4:
        # rows n (row % 16 < 8) start a resident tile's row; row_b a multiple of 16 rows: whole tiles
        pa = p_ptr.to(tl.pointer_type(tl.uint32)) + code_row(row, K) // 4 + q * 4
        ga = g_ptr + group_row(row, K) + q
        pb = pa + code_row(row_b, K) // 4
        gb = ga + group_row(row_b, K)
        ca_n, ca_8, cb_n, cb_8, ta_n, ta_8, tb_n, tb_8 = _fp4_codes(pa, pb, ga, gb, 0, el)
        for kb in tl.range(0, N_KG):
            kn = tl.minimum(kb + 1, N_KG - 1)
            if PREFETCH:
                na_n, na_8, nb_n, nb_8, sa_n, sa_8, sb_n, sb_8 = _fp4_codes(pa, pb, ga, gb, kn, el)
                n_lo, n_hi, n_sx, n_sa, n_sb = _inputs(x32, ok_in, xs_row, ok_out, sa_ptr, sb_ptr, kn, el)
            ea, eb = _block_exp(sa), _block_exp(sb)
            f0, f1, f2, f3 = _act_f16(act_lo, act_hi, PRMT)
            da = _sums_fp4(ca_n, ca_8, ta_n - ea, ta_8 - ea, act_lo, act_hi, f0, f1, f2, f3, el, NW, PRMT)
            db = _sums_fp4(cb_n, cb_8, tb_n - eb, tb_8 - eb, act_lo, act_hi, f0, f1, f2, f3, el, NW, PRMT)
            acc_a += da * (sa * sx)
            acc_b += db * (sb * sx)
            if not PREFETCH:
                na_n, na_8, nb_n, nb_8, sa_n, sa_8, sb_n, sb_8 = _fp4_codes(pa, pb, ga, gb, kn, el)
                n_lo, n_hi, n_sx, n_sa, n_sb = _inputs(x32, ok_in, xs_row, ok_out, sa_ptr, sb_ptr, kn, el)
            ca_n, ca_8, cb_n, cb_8, ta_n, ta_8, tb_n, tb_8 = na_n, na_8, nb_n, nb_8, sa_n, sa_8, sb_n, sb_8
            act_lo, act_hi, sx, sa, sb = n_lo, n_hi, n_sx, n_sa, n_sb
    else:
        wa = w_ptr.to(tl.pointer_type(tl.uint32)) + row * words8 + q * 8
        wb = wa + row_b * words8
        an_lo, an_hi, a8_lo, a8_hi, bn_lo, bn_hi, b8_lo, b8_hi = _fp8_words(wa, wb, 8 * words8, 0, el)
        for kb in tl.range(0, N_KG):
            kn = tl.minimum(kb + 1, N_KG - 1)
            if PREFETCH:
                w0, w1, w2, w3, w4, w5, w6, w7 = _fp8_words(wa, wb, 8 * words8, kn, el)
                n_lo, n_hi, n_sx, n_sa, n_sb = _inputs(x32, ok_in, xs_row, ok_out, sa_ptr, sb_ptr, kn, el)
            acc_a += _sums_fp8(an_lo, an_hi, a8_lo, a8_hi, act_lo, act_hi, NW, PRMT) * (sa * sx)
            acc_b += _sums_fp8(bn_lo, bn_hi, b8_lo, b8_hi, act_lo, act_hi, NW, PRMT) * (sb * sx)
            if not PREFETCH:
                w0, w1, w2, w3, w4, w5, w6, w7 = _fp8_words(wa, wb, 8 * words8, kn, el)
                n_lo, n_hi, n_sx, n_sa, n_sb = _inputs(x32, ok_in, xs_row, ok_out, sa_ptr, sb_ptr, kn, el)
            an_lo, an_hi, a8_lo, a8_hi, bn_lo, bn_hi, b8_lo, b8_hi = w0, w1, w2, w3, w4, w5, w6, w7
            act_lo, act_hi, sx, sa, sb = n_lo, n_hi, n_sx, n_sa, n_sb
    return acc_a, acc_b


@triton.jit
def _tile(sched_ptr, E1, EB: tl.constexpr, BEGIN_ROW: tl.constexpr, NW: tl.constexpr):
    """This program's expert (E1: none), weight-row block and, per lane: its row offset (warp * 16 + g),
    the tile row whose activations it feeds (g) and whether that row exists; per accumulator element
    [32 * NW, 4]: its tile row (2q or 2q + 1), whether it exists, and its weight row offset (+8 for
    elements 2, 3)."""
    e, first, row_end = _find_tile(sched_ptr, tl.program_id(0), E1, EB, BEGIN_ROW, _ROWS)
    tid = tl.arange(0, 32 * NW)
    el = tl.arange(0, 4)[None, :]
    g = (tid % 32) // 4
    r_in = first + g
    m_out = first + 2 * (tid % 4)[:, None] + (el & 1)
    rows = (tid // 32) * 16 + g
    return (e, tl.program_id(1), rows, r_in, r_in < row_end, m_out, m_out < row_end,
            rows[:, None] + 8 * (el >> 1))


@triton.jit
def _mma_w13_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, p_ptr, g_ptr, order_ptr, rw_ptr, sched_ptr, a_ptr,
                    I, D, E1, E4, n_clamped, limit, x_words, stride_a,
                    K1: tl.constexpr, EB: tl.constexpr, N_KG: tl.constexpr, NB_I: tl.constexpr, NW: tl.constexpr,
                    CDT: tl.constexpr, XDT: tl.constexpr, W4: tl.constexpr, PRMT: tl.constexpr,
                    PREFETCH: tl.constexpr, PDL: tl.constexpr = False):
    pdl_gate(PDL)
    e, pid_n, rows, r_in, ok_in, m_out, ok_out, cols = _tile(sched_ptr, E1, EB, _TILE1, NW)
    if e >= E1:
        return
    tok_in = tl.load(order_ptr + r_in, mask=ok_in, other=0) // K1
    src_out = tl.load(order_ptr + m_out, mask=ok_out, other=0)
    x32 = x_ptr.to(tl.pointer_type(tl.uint32)) + tok_in * x_words + (tl.arange(0, 32 * NW) % 4) * 8
    xs_row = xs_ptr + (src_out // K1) * N_KG
    n0 = pid_n * 16 * NW
    e64 = e.to(tl.int64)
    e8 = tl.maximum(e64 - E4, 0)
    s_g = ws_ptr + e64 * 2 * NB_I * N_KG + (n0 // _BK) * N_KG      # [E1, 2, NB_I, N_KG]
    # w13 [E1, 2, I, D]: gate rows, then up rows
    w8 = w_ptr + e8 * 2 * I * D
    p4 = p_ptr + e64 * 2 * I * (D // 2)
    g4 = g_ptr + e64 * 2 * I * (D // 32)
    gate, up = _expert_sums(x32, ok_in, xs_row, ok_out, s_g, s_g + NB_I * N_KG, w8, p4, g4, n0 + rows, I, D, e, E4,
                            N_KG, NW, W4, PRMT, PREFETCH)
    rw = tl.load(rw_ptr + src_out, mask=ok_out, other=0.0)
    act = swiglu(gate, up, e < n_clamped, limit, rw, CDT, XDT)
    tl.store(a_ptr + m_out * stride_a + n0 + cols, act.to(a_ptr.dtype.element_ty), mask=ok_out)


@triton.jit
def _mma_w2_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, p_ptr, g_ptr, order_ptr, sched_ptr, y_ptr, D, I, E1, E4, a_words,
                   stride_y, EB: tl.constexpr, N_KG: tl.constexpr, NB_D: tl.constexpr, NW: tl.constexpr,
                   W4: tl.constexpr, PRMT: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr = False):
    pdl_gate(PDL)
    e, pid_n, rows, r_in, ok_in, m_out, ok_out, cols = _tile(sched_ptr, E1, EB, _TILE2, NW)
    if e >= E1:
        return
    dest = tl.load(order_ptr + m_out, mask=ok_out, other=0)
    x32 = a_ptr.to(tl.pointer_type(tl.uint32)) + r_in * a_words + (tl.arange(0, 32 * NW) % 4) * 8
    n0 = pid_n * 32 * NW
    e64 = e.to(tl.int64)
    s = ws_ptr + e64 * NB_D * N_KG + (n0 // _BK) * N_KG                # [E1, NB_D, N_KG]
    # two row sets per program: rows n0 + (0..16 NW) and 16 NW further, inside one 128-row scale block
    ya, yb = _expert_sums(x32, ok_in, as_ptr + m_out * N_KG, ok_out, s, s, w_ptr + tl.maximum(e64 - E4, 0) * D * I,
                          p_ptr + e64 * D * (I // 2), g_ptr + e64 * D * (I // 32), n0 + rows, 16 * NW, I, e, E4, N_KG,
                          NW, W4, PRMT, PREFETCH)
    _y_out(ya, y_ptr, dest, stride_y, n0 + cols, ok_out)
    _y_out(yb, y_ptr, dest, stride_y, n0 + 16 * NW + cols, ok_out)


@triton.jit
def _y_out(y, y_ptr, dest, stride_y, cols, ok):
    if y_ptr.dtype.element_ty != tl.float32:
        y = _round(y, y_ptr.dtype.element_ty)
    tl.store(y_ptr + dest * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=ok)


def mma_fits(D: int, I: int) -> bool:
    """Whether the kernels take these sizes: whole 128-deep blocks (V4's D and I always are)."""
    return D % BLOCK_K == 0 and I % BLOCK_K == 0


def _check(name: str, D: int, I: int, num_warps: int, x: torch.Tensor) -> None:
    # w2's programs of 32 * num_warps rows stay inside one 128-row block of weight scales
    if not mma_fits(D, I) or num_warps not in (1, 2, 4):
        raise ValueError(f"{name}: num_warps={num_warps} must be 1, 2 or 4; D={D} and "
                         f"I={I} multiples of {BLOCK_K}")
    if x.dtype != torch.float8_e4m3fn or x.stride(1) != 1 or x.stride(0) % 4:
        raise ValueError(f"{name}: activations must be float8_e4m3fn rows of whole words, got {x.dtype} "
                         f"strides {x.stride()}")


def mma_w13(xq: torch.Tensor, xs: torch.Tensor, w13: Experts, s13: torch.Tensor, order: torch.Tensor,
            route_w: torch.Tensor, sched: torch.Tensor, n_tiles: int, *, k1: int, n_clamped: int, limit: float,
            compute_dtype: torch.dtype, x_dtype: torch.dtype, num_warps: int = 4,
            prefetch: bool = False) -> torch.Tensor:
    """`moe_w13` on FP8 activations (`act_quant`'s xq [T, D] and scales xs [T, D/128]), the schedule's
    tiles of `ROWS` rows: w2's input [n, I] in x_dtype, before its act_quant (the caller's)."""
    T, D = xq.shape
    E1, _, I, _ = w13.shape
    weights = _check_experts(w13, s13, (E1, 2, I, D), "mma_w13: w13")
    _check("mma_w13", D, I, num_warps, xq)
    n = order.numel()
    a = torch.empty((n, I), dtype=x_dtype, device=xq.device)
    if n == 0:
        return a
    _mma_w13_kernel[(n_tiles, I // (16 * num_warps))](
        x_ptr=xq, xs_ptr=xs, ws_ptr=s13, order_ptr=order, rw_ptr=route_w.reshape(-1), sched_ptr=sched, a_ptr=a, I=I,
        D=D, E1=E1, n_clamped=n_clamped, limit=float(limit), x_words=xq.stride(0) // 4, stride_a=a.stride(0),
        **weights, K1=k1, EB=sched.shape[1], N_KG=D // BLOCK_K, NB_I=I // BLOCK_K, NW=num_warps,
        CDT=TL_DTYPES[compute_dtype], XDT=TL_DTYPES[x_dtype], PRMT=not _interpreted(), PREFETCH=prefetch,
        num_warps=num_warps, **launch_args(xq))
    return a


def mma_w2(aq: torch.Tensor, a_s: torch.Tensor, w2: Experts, s2: torch.Tensor, order: torch.Tensor,
           sched: torch.Tensor, n_tiles: int, *, out_dtype: torch.dtype, num_warps: int = 4,
           prefetch: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """`moe_w2` on FP8 activations (aq [n, I] in sorted row order, scales a_s [n, I/128]): y [n, D]
    out_dtype in (token, slot) order (into `out` if given)."""
    n, I = aq.shape
    E1, D, _ = w2.shape
    weights = _check_experts(w2, s2, (E1, D, I), "mma_w2: w2")
    _check("mma_w2", D, I, num_warps, aq)
    y = w2_output(out, n, D, out_dtype, aq.device)
    if n == 0:
        return y
    _mma_w2_kernel[(n_tiles, D // (32 * num_warps))](
        a_ptr=aq, as_ptr=a_s, ws_ptr=s2, order_ptr=order, sched_ptr=sched, y_ptr=y, D=D, I=I, E1=E1,
        a_words=aq.stride(0) // 4, stride_y=y.stride(0), **weights, EB=sched.shape[1], N_KG=I // BLOCK_K,
        NB_D=D // BLOCK_K, NW=num_warps, PRMT=not _interpreted(), PREFETCH=prefetch, num_warps=num_warps,
        **launch_args(aq))
    return y
