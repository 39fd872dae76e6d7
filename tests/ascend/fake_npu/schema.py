"""Schema-true fake operators: argument binding, validation helpers, the call recorder.

Each fake op is declared with the exact schema string of the torch_npu wheel (`schemas.py`), parsed
by `torch._C.parse_schema`. A call binds its Python arguments the way PyTorch's dispatcher does:
positional arguments only up to the `*`, keyword-only ones by name, defaults filled in, and each
value type-checked against the declared type (`Tensor`, `Tensor?`, `Tensor[]`, `int`, `int[]`,
`float`, `str`, `bool`). A `torch.dtype` passed for an `int` argument becomes its ScalarType code,
as the dispatcher converts it (`torch.bfloat16` -> 15, `torch.float8_e4m3fn` -> 24). Binding
errors raise `TypeError("npu_<op>: ...")` naming the argument; documented-constraint violations
found by an op's validator raise `ValueError("npu_<op>: <arg> <what>; documented: <rule>")`.

Every successful call is appended to the installed fake's recorder `torch_npu._calls` as
`(op name, bound arguments as a dict)` before the reference runs. A call during an NPUGraph
capture is one fused node of the graph (`graphs.fused`): validated and run once at capture, its
reference re-run by each replay on the argument tensors' values then (not recorded again).
"""
from __future__ import annotations

import torch

from .graphs import fused
from .schemas import SCHEMAS

# ScalarType codes of c10 (stable enum order), for dtypes passed where the schema says `int`.
SCALAR_TYPE_CODE = {
    torch.uint8: 0, torch.int8: 1, torch.int16: 2, torch.int32: 3, torch.int64: 4,
    torch.float16: 5, torch.float32: 6, torch.float64: 7, torch.bool: 11, torch.bfloat16: 15,
    torch.float8_e5m2: 23, torch.float8_e4m3fn: 24, torch.float8_e8m0fnu: 44,
    torch.float4_e2m1fn_x2: 45,
}
CODE_TO_DTYPE = {v: k for k, v in SCALAR_TYPE_CODE.items()}

# torch_npu's own dtype codes (module attributes of torch_npu; values of the wheel's
# op_plugin meta registrations: 290 hifloat8 and 296 fp4 are carried as uint8 tensors).
INT4, HIFLOAT8, FLOAT8_E5M2, FLOAT8_E4M3FN = 285, 290, 291, 292
FLOAT8_E8M0FNU, FLOAT4_E2M1FN_X2, FLOAT4_E1M2FN_X2 = 293, 296, 297

_active = None          # the installed FakeNpu (see __init__.py); ops refuse to run without one


def active():
    if _active is None:
        raise RuntimeError("fake torch_npu op called while no fake NPU is installed")
    return _active


def fail(op: str, arg: str, what: str, documented: str):
    raise ValueError(f"{op}: {arg} {what}; documented: {documented}")


def check(cond, op: str, arg: str, what: str, documented: str):
    if not cond:
        fail(op, arg, what, documented)


def check_dtype(op, arg, t, allowed, documented=None):
    allowed = tuple(allowed)
    if t.dtype not in allowed:
        names = ", ".join(str(d).replace("torch.", "") for d in allowed)
        fail(op, arg, f"has dtype {str(t.dtype).replace('torch.', '')}",
             documented or f"dtype in {{{names}}}")


def check_dim(op, arg, t, dims, documented=None):
    dims = (dims,) if isinstance(dims, int) else tuple(dims)
    if t.dim() not in dims:
        fail(op, arg, f"has {t.dim()} dimensions (shape {tuple(t.shape)})",
             documented or f"{' or '.join(map(str, dims))}-D")


def check_shape(op, arg, t, shape, documented=None):
    if tuple(t.shape) != tuple(shape):
        fail(op, arg, f"has shape {tuple(t.shape)}, expected {tuple(shape)}",
             documented or f"shape {tuple(shape)}")


def _type_ok(tstr: str, v):
    """(ok, converted value) for a value against a schema type string of parse_schema."""
    if tstr.startswith("Optional["):
        return (True, None) if v is None else _type_ok(tstr[9:-1], v)
    if tstr == "Tensor":
        return isinstance(v, torch.Tensor), v
    if tstr in ("int", "SymInt"):
        if isinstance(v, torch.dtype) and v in SCALAR_TYPE_CODE:
            return True, SCALAR_TYPE_CODE[v]
        return isinstance(v, int) and not isinstance(v, bool), v
    if tstr == "float":
        return isinstance(v, (int, float)) and not isinstance(v, bool), v
    if tstr == "bool":
        return isinstance(v, bool), v
    if tstr == "str":
        return isinstance(v, str), v
    if tstr.startswith("List["):
        if not isinstance(v, (list, tuple, torch.Size)):
            return False, v
        out = []
        for x in v:
            ok, x = _type_ok(tstr[5:-1], x)
            if not ok:
                return False, v
            out.append(x)
        return True, out
    raise NotImplementedError(f"schema type {tstr}")


class FakeOp:
    """A callable `torch_npu.<name>` bound to its wheel schema, a validator and a reference."""

    def __init__(self, name: str, validate, reference):
        self.name = name
        self.schema_str = SCHEMAS[name]
        self.schema = torch._C.parse_schema(self.schema_str)
        self.validate = validate
        self.reference = reference
        self.__doc__ = f"{self.schema_str}\n\n{reference.__doc__ or ''}"

    def bind(self, args, kwargs) -> dict:
        op, params = self.name, self.schema.arguments
        positional = [a for a in params if not a.kwarg_only]
        if len(args) > len(positional):
            kw_only = [a.name for a in params if a.kwarg_only]
            raise TypeError(f"{op}: takes {len(positional)} positional argument(s) but "
                            f"{len(args)} were given; keyword-only: {kw_only}")
        names = {a.name for a in params}
        for k in kwargs:
            if k not in names:
                raise TypeError(f"{op}: unexpected keyword argument {k!r}; "
                                f"schema: {self.schema_str}")
        bound = {}
        for i, a in enumerate(params):
            if i < len(args) and not a.kwarg_only:
                if a.name in kwargs:
                    raise TypeError(f"{op}: got multiple values for argument {a.name!r}")
                v = args[i]
            elif a.name in kwargs:
                v = kwargs[a.name]
            elif a.has_default_value():
                v = a.default_value
                v = list(v) if isinstance(v, (list, tuple)) else v
            else:
                raise TypeError(f"{op}: missing required argument {a.name!r}")
            ok, v = _type_ok(str(a.type), v)
            if not ok:
                raise TypeError(f"{op}: argument {a.name!r} must be {a.type}, "
                                f"not {type(kwargs.get(a.name, v)).__name__}")
            bound[a.name] = v
        return bound

    def __call__(self, *args, **kwargs):
        fake = active()
        bound = self.bind(args, kwargs)

        def check():
            self.validate(_Args(bound), fake.soc_version)
            fake.calls.append((self.name, bound))
        return fused(fake.state, self.name, check, lambda: self.reference(_Args(bound)))


class _Args:
    """Bound arguments with attribute access (`a.epsilon`)."""

    def __init__(self, bound: dict):
        self.__dict__.update(bound)


OPS: dict[str, FakeOp] = {}


def register(name: str, validate, reference) -> FakeOp:
    op = FakeOp(name, validate, reference)
    OPS[name] = op
    return op
