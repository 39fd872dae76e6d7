"""Programmatic dependent launch (`deepinfer_kernels.pdl`): a kernel launched early must wait for its
predecessor before touching memory, so every kernel that takes the PDL flag opens with `pdl_gate`,
and every launch in the package passes `launch_args` (the flag and Triton's launch_pdl together).
PDL is opt-in (DEEPINFER_PDL=1); these check the contract itself, and on a GPU that a chain of real
kernels gives the same bits with it on as off."""
from __future__ import annotations

import ast
from pathlib import Path

import deepinfer_kernels
import pytest
import torch
from deepinfer_kernels import pdl

SOURCES = sorted(Path(deepinfer_kernels.__file__).parent.glob("*.py"))


def _jit_functions(tree: ast.Module):
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in node.decorator_list):
            yield node


def _launches(tree: ast.Module):
    """Calls of the form kernel[grid](...)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript):
            yield node


def _body_without_docstring(fn: ast.FunctionDef) -> list[ast.stmt]:
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return body


MEMORY_OPS = ("tl.load(", "tl.store(", "tl.atomic_", "_load_codes(", "fp4_tile(", "fp4_rows(")


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.name)
def test_kernels_taking_pdl_pass_the_gate_before_touching_memory(path):
    """`pdl_gate(PDL)` is a top-level statement of the kernel; before it only index arithmetic and
    `_weights_to_l2` (L2 prefetches of weights, which no kernel writes)."""
    tree = ast.parse(path.read_text())
    for fn in _jit_functions(tree):
        if "PDL" not in [a.arg for a in fn.args.args] or fn.name == "pdl_gate":
            continue
        body = [ast.unparse(s) for s in _body_without_docstring(fn)]
        assert "pdl_gate(PDL)" in body, f"{path.name}:{fn.name} must call pdl_gate(PDL) at its top level"
        before = body[:body.index("pdl_gate(PDL)")]
        for stmt in before:
            assert not any(op in stmt for op in MEMORY_OPS), f"{path.name}:{fn.name}: {stmt!r} before the gate"
            calls = [c.func for c in ast.walk(ast.parse(stmt)) if isinstance(c, ast.Call)]
            names = [f.attr if isinstance(f, ast.Attribute) and f.attr == "to" else ast.unparse(f) for f in calls]
            assert all(n.startswith("tl.") or n in ("to", "_tile_ids", "_weights_to_l2") for n in names), \
                f"{path.name}:{fn.name}: {stmt!r} before the gate"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.name)
def test_every_launch_passes_launch_args(path):
    tree = ast.parse(path.read_text())
    gated = {fn.name for fn in _jit_functions(tree) if "PDL" in [a.arg for a in fn.args.args]}
    for call in _launches(tree):
        name = ast.unparse(call.func.value)
        spread = [ast.unparse(k.value) for k in call.keywords if k.arg is None]
        assert any(s.startswith(("launch_args(", "_launch_args(")) for s in spread), \
            f"{path.name}: {name}[...] without launch_args"
        assert name in gated, f"{path.name}: {name} is launched with PDL but takes no PDL flag"


def test_off_on_cpu_and_under_the_interpreter():
    assert pdl.launch_args(torch.zeros(1)) == {"PDL": False, "launch_pdl": False}


@pytest.mark.parametrize("raw, want", [("", False), ("0", False), ("no", False), ("1", True), ("TRUE", True)])
def test_the_variable_reads_like_the_core_table(monkeypatch, raw, want):
    from deepinfer_core import envs
    monkeypatch.setenv("DEEPINFER_PDL", raw)
    assert pdl.requested() is want is envs.get("DEEPINFER_PDL")


def test_a_bad_value_names_the_variable_and_the_allowed_values(monkeypatch):
    from deepinfer_core import envs
    monkeypatch.setenv("DEEPINFER_PDL", "fast")
    allowed = envs.ENV_VARS["DEEPINFER_PDL"].allowed()
    with pytest.raises(ValueError, match=r"DEEPINFER_PDL='fast' is invalid; allowed: " + allowed):
        pdl.requested()


@pytest.mark.gpu
def test_on_for_sm90_when_asked(monkeypatch):
    if not torch.cuda.is_available():
        pytest.fail("needs a CUDA GPU")
    x = torch.zeros(1, device="cuda")
    monkeypatch.setenv("DEEPINFER_PDL", "1")
    pdl._enabled.cache_clear()
    assert pdl.launch_args(x)["launch_pdl"] is (torch.cuda.get_device_capability()[0] >= 9)
    monkeypatch.setenv("DEEPINFER_PDL", "0")
    pdl._enabled.cache_clear()
    try:
        assert pdl.launch_args(x) == {"PDL": False, "launch_pdl": False}
    finally:
        monkeypatch.delenv("DEEPINFER_PDL")
        pdl._enabled.cache_clear()


def _gemm_chain(x: torch.Tensor, weights: list, pdl_on: bool, monkeypatch) -> torch.Tensor:
    """act_quant -> fp8_gemm (split-K partials + their sum where it splits) -> act_quant -> ...,
    captured in a CUDA graph with PDL on or off, replayed once."""
    from deepinfer_kernels.fp8_gemm import fp8_gemm
    from deepinfer_kernels.fp8_quant import act_quant
    monkeypatch.setenv("DEEPINFER_PDL", "1" if pdl_on else "0")
    pdl._enabled.cache_clear()

    def chain():
        h = x
        for qw, sw in weights:
            h = fp8_gemm(*act_quant(h), qw, sw)
        return h

    chain()                         # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain()
    graph.replay()
    torch.cuda.synchronize()
    pdl._enabled.cache_clear()
    return out.clone()


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 64, 256])
def test_a_chain_of_real_kernels_gives_the_same_bits_with_pdl(monkeypatch, rows):
    """The gate (and the GEMM's L2 prefetch ahead of it) changes when a kernel starts, never what it
    reads: wkv-, wq_a- and wo_b-like weights (split-K and not) chained through act_quant."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        pytest.fail("needs an SM90+ CUDA GPU")
    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(1024, 4096), (512, 1024), (4096, 512)]
    weights = [((torch.randn(n, k, device="cuda", generator=g) * 0.5).to(torch.float8_e4m3fn),
                torch.rand((n + 127) // 128, (k + 127) // 128, device="cuda", generator=g) * 0.01 + 0.001)
               for n, k in shapes]
    x = torch.randn(rows, 4096, device="cuda", generator=g, dtype=torch.bfloat16)
    plain = _gemm_chain(x, weights, False, monkeypatch)
    with_pdl = _gemm_chain(x, weights, True, monkeypatch)
    assert torch.isfinite(plain.float()).all()
    assert torch.equal(with_pdl, plain)
