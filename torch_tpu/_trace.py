"""The trace executor's API: an aten overload's lowering called on JAX values.

Executors that build one XLA program out of many ops (torch.compile's FX interpreter, torch_tpu/_compile.py) call
the table's lowerings (kernels/registry.py) here on JAX tracers, with the same argument binding, type promotion
and casts as the eager kernels (kernels/_schema.py's `Signature`). Tensor arguments are JAX values, Scalars and
static arguments are Python values. Trace-only lowerings (`lower(..., trace_only=True)`: views, metadata and
composites) are found here too; `_foreach_*` overloads map their elementwise lowering over the lists. Random
lowerings draw their keys from `torch_tpu._executor.trace_random` (re-exported here). Higher-order operators
(flex_attention) call the registry's HIGHER_ORDER lowerings, their FX subgraph arguments turned into JAX
callables by `trace_graph`.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.fx

from torch_tpu._executor import next_trace_key, trace_random
from torch_tpu.kernels._schema import (
    GENERATOR,
    OPT_TENSOR,
    SCALAR,
    STATIC,
    TENSOR,
    TENSOR_LIST,
    Signature,
    _is_scalar_list,
    _kind,
    _overload,
    bind_arguments,
    overload_name,
)
from torch_tpu.kernels.registry import HIGHER_ORDER, LOWERINGS

__all__ = ["next_trace_key", "overload_name", "trace_call", "trace_graph", "trace_higher_order", "trace_random",
           "traceable", "traceable_higher_order"]

_TRACE_KERNELS: dict[str, Signature | None] = {}


def _trace_kernel(name: str) -> Signature | None:
    if name not in _TRACE_KERNELS:
        lowering = LOWERINGS.get(name)
        _TRACE_KERNELS[name] = Signature(lowering, _overload(name)) if lowering is not None else None
    return _TRACE_KERNELS[name]


def traceable(name: str) -> bool:
    """True when aten overload `name` can be called on JAX values by `trace_call`."""
    if _trace_kernel(name) is not None:
        return True
    return name.startswith("_foreach_") and _foreach_target(name) is not None


def trace_call(name: str, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """Calls aten overload `name`'s lowering on JAX values (call inside a trace, e.g. under one `jax.jit`)."""
    kernel = _trace_kernel(name)
    if kernel is None:
        if name.startswith("_foreach_"):
            return _trace_foreach(name, args, kwargs)
        raise NotImplementedError(
            f"aten::{name} has no lowering in torch_tpu.kernels that can be traced (it is missing, or only an eager "
            "kernel written against torch tensors): add one with @lower (docs/adding_kernels.md)"
        )
    vals = kernel.bind(tuple(args), dict(kwargs))
    dyn: list[Any] = []
    static: list[Any] = []
    for v, k in zip(vals, kernel.kinds):
        if k in (TENSOR, OPT_TENSOR, SCALAR) and (v is None or isinstance(v, (bool, int, float, complex))):
            dyn.append(v)
            static.append(type(v))  # a Python number (or None): promoted like eager's wrapped scalars
        elif k in (TENSOR, OPT_TENSOR, SCALAR):
            dyn.append(v)
            static.append(None)
        elif k == TENSOR_LIST:
            dyn.append(list(v))
            static.append(len(v))
        elif k == GENERATOR:
            dyn.append(None)
            static.append(None)
        else:
            dyn.append(None)
            static.append(tuple(v) if isinstance(v, list) else v)
    return kernel._traced(tuple(static), None)(*dyn)


_FOREACH_TARGETS: dict[str, tuple[str, tuple[bool, ...]] | None] = {}


def _foreach_target(name: str) -> tuple[str, tuple[bool, ...]] | None:
    """The elementwise overload a `_foreach_` overload maps over, and which of its arguments are per-element lists."""
    if name in _FOREACH_TARGETS:
        return _FOREACH_TARGETS[name]
    found = None
    try:
        op = _overload(name)
    except AttributeError:
        op = None
    if op is not None and not any(a.is_out for a in op._schema.arguments) and not op._schema.name.endswith("_"):
        args = [a for a in op._schema.arguments]
        per_elem = tuple(_kind(a) == TENSOR_LIST or _is_scalar_list(a) for a in args)
        want = [TENSOR if (_kind(a) == TENSOR_LIST or _kind(a) == TENSOR) else SCALAR if
                (_kind(a) == SCALAR or _is_scalar_list(a)) else STATIC for a in args]
        base = name.split(".")[0][len("_foreach_"):]
        packet = getattr(torch.ops.aten, base, None)
        for ov in (packet.overloads() if packet is not None else []):
            cand = base if ov == "default" else f"{base}.{ov}"
            if cand not in LOWERINGS:
                continue
            cargs = [a for a in getattr(packet, ov)._schema.arguments if not a.is_out]
            if len(cargs) < len(want):
                continue
            kinds = [_kind(a) for a in cargs]
            ok = all(w == k or (w == TENSOR and k == OPT_TENSOR) or (w == STATIC and k == STATIC)
                     for w, k in zip(want, kinds))
            if ok and all(a.has_default_value() for a in cargs[len(want):]):
                found = (cand, per_elem)
                break
    _FOREACH_TARGETS[name] = found
    return found


def _trace_foreach(name: str, args: Sequence[Any], kwargs: dict[str, Any]) -> list[Any]:
    target = _foreach_target(name)
    if target is None:
        raise NotImplementedError(
            f"aten::{name}: no elementwise lowering in torch_tpu.kernels matches its arguments, so it cannot be "
            "traced: add a lowering for it (docs/adding_kernels.md)"
        )
    cand, per_elem = target
    vals = bind_arguments(name, _overload(name)._schema.arguments, args, kwargs)
    n = len(next(v for v, p in zip(vals, per_elem) if p))
    return [trace_call(cand, [v[i] if p else v for v, p in zip(vals, per_elem)], {}) for i in range(n)]


# ---- higher-order operators: FX subgraphs as JAX callables ----

def traceable_higher_order(name: str) -> bool:
    """True when higher-order operator `name` (e.g. "flex_attention") has a graph lowering."""
    return name in HIGHER_ORDER


def higher_order_traced_args(name: str, args: Sequence[Any]) -> list[Any]:
    """The positional arguments of a call of HOP `name` that its lowering uses (all but its `unused` ones)."""
    import inspect

    fn = HIGHER_ORDER[name]
    params = list(inspect.signature(fn).parameters)
    unused = getattr(fn, "unused", frozenset())
    return [a for i, a in enumerate(args) if i >= len(params) or params[i] not in unused]


def trace_graph(gm: torch.fx.GraphModule) -> Any:
    """An FX subgraph of aten ops (a HOP's score_mod, mask_mod...) as a function of JAX values: each node's lowering
    is called by `trace_call`; Python nodes (operator.getitem, SymInt arithmetic) run as Python."""
    nodes = list(gm.graph.nodes)
    for node in nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            if not traceable(overload_name(node.target)):
                op = overload_name(node.target)
                raise NotImplementedError(
                    f"{op if '::' in op else 'aten::' + op} (node {node.name} of subgraph {type(gm).__name__}) has no "
                    "lowering in torch_tpu.kernels that can be traced: add one with @lower (docs/adding_kernels.md)")
        elif node.op in ("call_module", "call_method") or (node.op == "get_attr" and isinstance(
                getattr(gm, node.target, None), torch.Tensor)):
            raise NotImplementedError(
                f"torch.compile(backend='tpu'): subgraph node {node.name} ({node.op} {node.target}) cannot be traced "
                "in a higher-order op's subgraph: pass tensors the function reads as captured buffers")

    def run(*args: Any) -> Any:
        env: dict[Any, Any] = {}
        it = iter(args)
        for node in nodes:
            if node.op == "placeholder":
                env[node] = next(it)
            elif node.op == "get_attr":
                env[node] = getattr(gm, node.target)
            elif node.op == "call_function":
                a = torch.fx.node.map_arg(node.args, env.__getitem__)
                kw = torch.fx.node.map_arg(node.kwargs, env.__getitem__)
                if isinstance(node.target, torch._ops.OpOverload):
                    env[node] = trace_call(overload_name(node.target), a, kw)
                else:
                    env[node] = node.target(*a, **kw)
            elif node.op == "output":
                out = torch.fx.node.map_arg(node.args[0], env.__getitem__)
                return out[0] if isinstance(out, (tuple, list)) and len(out) == 1 else out
        raise RuntimeError(f"subgraph {type(gm).__name__} has no output node")

    return run


def trace_higher_order(name: str, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """Calls higher-order operator `name`'s graph lowering on JAX values; FX subgraphs among its arguments (also
    inside tuples, like flex_attention's block mask) become JAX callables."""
    fn = HIGHER_ORDER.get(name)
    if fn is None:
        raise NotImplementedError(
            f"torch.ops.higher_order.{name} has no graph lowering in torch_tpu.kernels (registry.HIGHER_ORDER): add "
            "one with @higher_order, or run the region eagerly (torch.compiler.disable)")

    def convert(v: Any) -> Any:
        if isinstance(v, torch.fx.GraphModule):
            return trace_graph(v)
        if isinstance(v, tuple):
            return tuple(convert(x) for x in v)
        if isinstance(v, list):
            return [convert(x) for x in v]
        return v

    import inspect

    params = list(inspect.signature(fn).parameters)
    unused = getattr(fn, "unused", frozenset())
    args = tuple(a if i < len(params) and params[i] in unused else convert(a) for i, a in enumerate(args))
    return fn(*args, **{k: v if k in unused else convert(v) for k, v in kwargs.items()})
