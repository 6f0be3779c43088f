"""Schema analysis and argument binding for the table's lowerings (kernels/registry.py), shared by every
executor: the kind of each schema argument, the in-place and out= overloads of a functional one, and
`Signature`, a lowering bound to its aten overload's schema: `bind` puts the call's arguments in schema order and
`_traced` builds the function of arrays an executor runs (promotion, the lowering, result casts).
Helpers beside the table; kernels never need them.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Sequence

import torch

from torch_tpu._jax import jnp
from torch_tpu._profiler import program_name
from torch_tpu.kernels._promote import _cast_tree, _check_broadcast, _promote
from torch_tpu.kernels.registry import Lowering

# ---- schema analysis ----

TENSOR, OPT_TENSOR, TENSOR_LIST, SCALAR, STATIC, GENERATOR = range(6)
_DYNAMIC = (TENSOR, OPT_TENSOR, TENSOR_LIST, SCALAR)
_NUMBER_TYPES = (bool, int, float, complex)


def _kind(arg: Any) -> int:
    t = arg.type
    k = t.kind()
    if k == "TensorType":
        return TENSOR
    if k == "NumberType":
        return SCALAR
    if k == "OptionalType":
        inner = t.getElementType().kind()
        if inner == "TensorType":
            return OPT_TENSOR
        if inner == "NumberType":
            return SCALAR
        if inner == "GeneratorType":
            return GENERATOR
        return STATIC
    if k == "ListType" and t.getElementType().kind() in ("TensorType", "OptionalType"):
        return TENSOR_LIST
    if k == "GeneratorType":
        return GENERATOR
    return STATIC


def _overload(name: str) -> Any:
    """The OpOverload a registry name names: "add.Tensor" is aten's; "ns::op.overload" (a custom op such as a
    `torch.tpu.jax_op`) is another namespace's."""
    ns, _, name = name.rpartition("::")
    base, _, overload = name.partition(".")
    return getattr(getattr(getattr(torch.ops, ns or "aten"), base), overload or "default")


def _same_signature(a: Any, b: Any) -> bool:
    """Same argument names and types, ignoring out= arguments (and mutability annotations)."""
    def sig(schema: Any) -> list[tuple[str, str]]:
        return [(arg.name, str(arg.type)) for arg in schema.arguments if not arg.is_out]

    return sig(a) == sig(b)


def _find_variants(op: Any) -> tuple[Any | None, Any | None]:
    """The in-place (`add_.Tensor`) and out= (`add.out`) overloads of a functional overload, if any: the
    overloads of `base_` and `base` whose arguments match the functional's by name and type."""
    schema = op._schema
    base = schema.name.split("::")[1]
    inplace = None
    packet = getattr(torch.ops.aten, base + "_", None)
    if packet is not None:
        for ov in packet.overloads():
            cand = getattr(packet, ov)
            if _same_signature(cand._schema, schema):
                inplace = cand
                break
    out = None
    for ov in getattr(torch.ops.aten, base).overloads():
        cand = getattr(getattr(torch.ops.aten, base), ov)
        outs = [a for a in cand._schema.arguments if a.is_out]
        if len(outs) == len(schema.returns) and outs and _same_signature(cand._schema, schema):
            out = cand
            break
    return inplace, out


def _name(op: Any) -> str:
    s = op._schema
    ns, _, base = s.name.partition("::")
    return ("" if ns == "aten" else ns + "::") + base + ("." + s.overload_name if s.overload_name else "")


def overload_name(op: Any) -> str:
    """The registry's name of an aten OpOverload: `torch.ops.aten.add.Tensor` -> "add.Tensor"."""
    return _name(op)


def _is_scalar_list(arg: Any) -> bool:
    t = arg.type
    return t.kind() == "ListType" and t.getElementType().kind() in ("NumberType", "FloatType", "IntType")


# ---- a lowering bound to its schema ----

def bind_arguments(name: str, arguments: Sequence[Any], args: Sequence[Any], kwargs: dict[str, Any]) -> list:
    """The values of schema `arguments` for a call of aten::`name`: positional `args`, then each later argument
    from `kwargs` or its default."""
    vals = list(args)
    for a in arguments[len(vals):]:
        if a.name in kwargs:
            vals.append(kwargs[a.name])
        elif a.has_default_value():
            vals.append(a.default_value)
        else:
            raise TypeError(f"aten::{name}: missing argument {a.name!r}")
    return vals


class Signature:
    """Lowering `lowering` bound to aten overload `op`'s schema (the eager executor's OpKernel extends it)."""

    def __init__(self, lowering: Lowering, op: Any) -> None:
        self.lowering = lowering
        self.op = op
        self.name = lowering.name
        schema = op._schema
        self.args = [a for a in schema.arguments if not a.is_out]
        self.arg_names = [a.name for a in self.args]
        self.kinds = [_kind(a) for a in self.args]
        self.defaults = [a.default_value if a.has_default_value() else inspect.Parameter.empty for a in self.args]
        self.n_returns = len(schema.returns)
        self.promote_idx = tuple(i for i, n in enumerate(self.arg_names) if n in lowering.promote_args)
        self.dynamic_idx = tuple(i for i, k in enumerate(self.kinds) if k in (TENSOR, OPT_TENSOR, TENSOR_LIST, SCALAR))

    # -- argument binding --
    def bind(self, args: tuple, kwargs: dict) -> list:
        vals = list(args)
        for i in range(len(vals), len(self.args)):
            name = self.arg_names[i]
            if name in kwargs:
                vals.append(kwargs[name])
            elif self.defaults[i] is not inspect.Parameter.empty:
                vals.append(self.defaults[i])
            else:
                raise TypeError(f"aten::{self.name}: missing argument {name!r}")
        return vals

    # -- tracing --
    def _traced(self, static: tuple, out_dtype: Any) -> Callable[..., Any]:
        lowering = self.lowering
        names = self.arg_names
        kinds = self.kinds
        promote_idx = self.promote_idx

        def run(*dyn: Any) -> Any:
            vals = [dyn[i] if kinds[i] in _DYNAMIC else static[i] for i in range(len(kinds))]
            if lowering.validate is not None:  # the operands as given: a number of its type for each Python number
                lowering.validate(**{n: static[i](0) if kinds[i] in _DYNAMIC and static[i] in _NUMBER_TYPES
                                     else vals[i] for i, n in enumerate(names)})
            result_dtype = None
            kind = lowering.promote
            if callable(kind):
                kind = kind(**{n: static[i] for i, n in enumerate(names) if kinds[i] == STATIC})
            if kind is not None:
                if lowering.broadcasts:
                    _check_broadcast(self.name, [vals[i] for i in promote_idx if vals[i] is not None])
                present = tuple(i for i in promote_idx if vals[i] is not None)
                compute, result_dtype = _promote([vals[i] for i in present], static, present, kind)
                for i in present:
                    if vals[i] is not None:
                        vals[i] = jnp.asarray(vals[i]).astype(compute)
            out = lowering.fn(**dict(zip(names, vals)))
            if result_dtype is not None:
                out = _cast_tree(out, result_dtype)
            if out_dtype is not None:
                out = _cast_tree(out, out_dtype)
            return out

        # The XLA program's name (jax.jit names it `jit_<__name__>`): the aten overload, so a device trace
        # (torch.tpu.profiler, XProf) and dumped HLO map back to the op. Set once here, at the cache miss.
        run.__name__ = program_name(self.name)
        return run
