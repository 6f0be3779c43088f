"""The one table mapping ATen overloads to JAX functions. Every executor reads it; nothing else maps aten ops
to JAX. This module is the table only: the entries (`Lowering`, `LOWERINGS`, `DIRECT`, `DEFERRABLE`), the two
decorators that fill it and PyTorch's promotion kinds. It imports nothing of torch_tpu.

A contributor writes one function:

    @lower("add.Tensor", "add.Scalar", promote=DEFAULT, promote_args=("self", "other"))
    def add(self, other, alpha=1):
        return self + other * alpha

Arguments arrive as the schema names them: Tensor -> device array, Scalar -> a JAX scalar (traced, so a new
value does not recompile), everything else (int, bool, float, int[], dtype...) -> a static Python value.
From that one definition the eager executor (torch_tpu/_eager.py) installs the functional overload, its in-place
form (`add_.Tensor`) and its out= form (`add.out`), with PyTorch's type promotion, broadcasting checks, cast and
resize rules (kernels/_schema.py binds the arguments, kernels/_promote.py promotes and casts); the fused executor
records the same function and the trace executor (torch.compile) calls it on tracers (torch_tpu/_trace.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND

DEFAULT = ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT
INT_TO_FLOAT = ELEMENTWISE_TYPE_PROMOTION_KIND.INT_TO_FLOAT
ALWAYS_BOOL = ELEMENTWISE_TYPE_PROMOTION_KIND.ALWAYS_BOOL
COMPLEX_TO_FLOAT = ELEMENTWISE_TYPE_PROMOTION_KIND.COMPLEX_TO_FLOAT
BOOL_TO_LONG = ELEMENTWISE_TYPE_PROMOTION_KIND.BOOL_TO_LONG
NO_OPMATH = ELEMENTWISE_TYPE_PROMOTION_KIND.NO_OPMATH


@dataclasses.dataclass(frozen=True)
class Lowering:
    """One ATen overload's JAX definition."""

    name: str  # overload, e.g. "add.Tensor"
    fn: Callable[..., Any]
    # PyTorch's promotion kind, or a function of the static arguments returning one (or None).
    promote: Any
    promote_args: tuple[str, ...]
    jit: bool  # False for data-dependent output shapes (run eagerly on concrete arrays)
    variants: bool  # also install the in-place and out= forms
    cpu_tensors: bool = False  # CPU tensor arguments (e.g. index tensors) are moved to the device, as on CUDA
    broadcasts: bool = True  # the promoted operands broadcast together (checked with PyTorch's error)
    # Trace-only: read by graph executors (torch.compile) but not installed as an eager PrivateUse1 kernel (view
    # and metadata ops are C++ metadata kernels eagerly; composites like clone/full reach eager kernels anyway).
    trace_only: bool = False
    # The lowering reports value-dependent index checks (torch_tpu._checks.report_bad_index) while it is traced:
    # its eager programs run through _checks.jit, which collects them. Without it, eager calls run the bare
    # jax.jit callable, and a report from an undeclared lowering fails its trace (a check is never dropped).
    checks: bool = False
    # Checks of the arguments as given, before promotion (PyTorch's argument checks that depend on the operands'
    # own dtypes, e.g. sub on bool): called at trace time with the arguments by name, a Python number of its type
    # standing for each Scalar; it raises PyTorch's error.
    validate: Callable[..., None] | None = None


LOWERINGS: dict[str, Lowering] = {}
# Kernels written directly against torch tensors (copy_, item, random fills): overload -> function.
DIRECT: dict[str, Callable[..., Any]] = {}
# Direct kernels written for DEFER_AND_FUSE (they only use deferrable calls: _storage.read/write, wrap_arrays,
# `_executor.jitted` helpers); every other direct kernel flushes pending work and runs eagerly.
DEFERRABLE: set[str] = set()
# Graph decompositions of direct kernels whose result depends on the operands' layout, which a lowering (a function
# of arrays) cannot see (`direct(..., graph=fn)`): overload -> a function of torch tensors made of lowered ops.
# torch.compile applies them while tracing, when the fake tensors still carry their strides.
GRAPH_DECOMPOSITIONS: dict[str, Callable[..., Any]] = {}
# Higher-order operators (torch.ops.higher_order.*, e.g. flex_attention) in compiled graphs: HOP name -> a JAX
# function of the HOP's arguments, in which each FX subgraph argument (a score_mod...) arrives as a JAX callable.
# Eager runs PyTorch's own implementation of the HOP (its composite of aten ops); graph executors call these.
HIGHER_ORDER: dict[str, Callable[..., Any]] = {}


def lower(
    *names: str,
    promote: Any = None,
    promote_args: Sequence[str] = ("self", "other"),
    jit: bool = True,
    variants: bool = True,
    cpu_tensors: bool = False,
    broadcasts: bool = True,
    trace_only: bool = False,
    checks: bool = False,
    validate: Callable[..., None] | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        for name in names:
            # (a trace-only lowering may be the graph form of a direct kernel of the same overload)
            if name in LOWERINGS or (name in DIRECT and not trace_only):
                raise RuntimeError(f"torch_tpu: aten::{name} is registered twice")
            LOWERINGS[name] = Lowering(name, fn, promote, tuple(promote_args), jit, variants, cpu_tensors,
                                       broadcasts, trace_only, checks, validate)
        return fn

    return deco


def direct(*names: str, defer: bool = False, graph: Callable[..., Any] | None = None
           ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Registers a kernel written against torch tensors. `defer=True` declares it safe to record under
    DEFER_AND_FUSE (see DEFERRABLE); `graph` is its decomposition for torch.compile graphs (GRAPH_DECOMPOSITIONS)."""
    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        for name in names:
            if name in DIRECT or (name in LOWERINGS and not LOWERINGS[name].trace_only):
                raise RuntimeError(f"torch_tpu: aten::{name} is registered twice")
            DIRECT[name] = fn
            if defer:
                DEFERRABLE.add(name)
            if graph is not None:
                GRAPH_DECOMPOSITIONS[name] = graph
        return fn

    return deco


def higher_order(name: str, unused: Sequence[str] = ()) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Registers the graph lowering of higher-order operator `name` (HIGHER_ORDER). `unused`: the parameters
    (subgraphs) it never calls, whose ops need no lowering (kept as `fn.unused`)."""
    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        if name in HIGHER_ORDER:
            raise RuntimeError(f"torch_tpu: higher-order op {name} is registered twice")
        fn.unused = frozenset(unused)  # type: ignore[attr-defined]
        HIGHER_ORDER[name] = fn
        return fn

    return deco
