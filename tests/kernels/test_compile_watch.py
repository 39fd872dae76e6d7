"""compile_watch turns Triton's JIT-hook arguments into per-parameter specialisations and names what
made a compile a new variant (the hooks themselves fire only on a GPU: tests/gpu/test_no_late_compiles.py)."""
from __future__ import annotations

from types import SimpleNamespace

from deepinfer_kernels.compile_watch import CompileWatch, describe_args


def hook_args(key: str, T_div16: bool, ptr_aligned: bool, block: int) -> dict:
    """What Triton 3.6 passes its jit_cache_hook / jit_post_compile_hook for a kernel (x_ptr, T, BLOCK)."""
    attrs = {}
    if ptr_aligned:
        attrs[(0,)] = [["tt.divisibility", 16]]
    if T_div16:
        attrs[(1,)] = [["tt.divisibility", 16]]
    info = {"signature": {"x_ptr": "*bf16", "T": "i32", "BLOCK": "constexpr"}, "constants": {(2,): block},
            "configs": [attrs]}
    return dict(key=key, fn=SimpleNamespace(name="_k"), compile=info)


def test_describe_args_reads_types_alignment_divisibility_and_constexprs():
    args = describe_args(hook_args("a", True, True, 64)["compile"])
    assert args == {"x_ptr": "*bf16 aligned", "T": "i32 %16", "BLOCK": "=64"}
    assert describe_args(hook_args("b", False, False, 32)["compile"]) == {"x_ptr": "*bf16", "T": "i32",
                                                                       "BLOCK": "=32"}


def test_a_new_variant_names_the_arguments_that_differ_from_the_closest_earlier_one():
    watch = CompileWatch()
    for key, div, aligned, block in [("a", True, True, 64), ("b", False, True, 64), ("c", False, False, 64)]:
        watch._on_start(hook_args(key, div, aligned, block))
        watch._on_end(hook_args(key, div, aligned, block))
    first, second, third = watch.events
    assert first.differs == {} and "first variant" in str(first)
    assert second.differs == {"T": "i32 %16 -> i32"}
    assert third.differs == {"x_ptr": "*bf16 aligned -> *bf16"}      # closest: the second, not the first
    mark = watch.mark()
    watch._on_start(hook_args("d", False, False, 128))
    assert [str(e).split(" compiled")[0] for e in watch.since(mark)] == ["_k"]
    assert watch.since(mark)[0].differs == {"BLOCK": "=64 -> =128"}


def test_a_compile_after_a_warm_up_is_a_warning_and_one_inside_a_warm_up_is_not(caplog):
    watch = CompileWatch()

    def compile_now(key: str, block: int) -> None:
        watch._on_start(hook_args(key, True, True, block))
        watch._on_end(hook_args(key, True, True, block))

    with caplog.at_level("DEBUG", logger="deepinfer_kernels.compile_watch"):
        compile_now("before", 16)                   # kernel tests, tools: no engine warmed up yet
        with watch.expecting():                     # the runner's warm-up
            compile_now("warm-up", 32)
        assert watch.armed and not [r for r in caplog.records if r.levelname == "WARNING"]
        compile_now("serving", 64)
        with watch.expecting():                     # a second engine's warm-up in the same process
            compile_now("second warm-up", 128)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "-> =64)" in warnings[0] and "after the engine's warm-up" in warnings[0]
    assert [e.expected for e in watch.events] == [True, True, False, True]
