"""Eager kernels of the `_foreach_*` overloads (what optimizers and `clip_grad_norm_` call on tpu tensors).

Without them PyTorch's composite kernel loops over the list and dispatches one op per tensor: an AdamW step on a
model with P parameters is about 10·P ops, each a host round through the dispatcher (and, under DEFER_AND_FUSE,
one recorded node each). Here one call is one program over the whole list: one jitted call in the eager modes, one
node in the fused graph. Each element is the elementwise overload's lowering (the same mapping the trace executor
uses for compiled graphs, `_trace._foreach_target`), with its own promotion, so values and dtypes are those of the
per-tensor loop.

The program path is taken only where it is the loop's exact equivalent: every tensor is a tpu tensor on one
device, scalars are Python numbers, the lists have one length, and an in-place call's targets are distinct storages
that no other argument reads at another position (the loop would see earlier elements' new values). Anything else
runs PyTorch's loop itself (the element overload per tensor), which also gives PyTorch's errors.
"""

from __future__ import annotations

from typing import Any

import torch

from torch_tpu import _C, _executor, _metrics, _runtime, _storage, _trace
from torch_tpu.kernels._promote import _check_cast, wrap_arrays
from torch_tpu.kernels._schema import (OPT_TENSOR, SCALAR, STATIC, TENSOR, TENSOR_LIST, _find_variants, _kind, _overload,
                                       bind_arguments)

# The elementwise families whose foreach forms get a program (the reductions, e.g. _foreach_norm, keep PyTorch's
# loop: their element overloads take other arguments).
_BASES = ("add", "sub", "mul", "div", "addcmul", "addcdiv", "lerp", "sqrt", "rsqrt", "neg", "abs", "exp", "log",
          "sign", "reciprocal", "maximum", "minimum", "clamp_min", "clamp_max", "pow", "sigmoid", "tanh")
_NUMBERS = (bool, int, float, complex)
_LAUNCH_BLOCKING = _executor.EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING


class ForeachKernel:
    """One `_foreach_<base>[_].<overload>`: a program over the list, or PyTorch's loop."""

    def __init__(self, name: str, functional: str, cand: str, per_elem: tuple[bool, ...], inplace: bool) -> None:
        self.name = name
        op = _overload(name)
        self.args = list(op._schema.arguments)
        self.per_elem = per_elem
        self.inplace = inplace
        self.sig = _trace._trace_kernel(cand)  # the element overload's binding and traced lowering
        elem = _overload(cand)
        self.elem = _find_variants(elem)[0] if inplace else elem
        self.elem_args = [a for a in self.elem._schema.arguments if not a.is_out]
        self.tensor_args = tuple(i for i, a in enumerate(self.args) if _kind(a) in (TENSOR, OPT_TENSOR, TENSOR_LIST))
        self._progs: dict[Any, Any] = {}

    def bind(self, args: tuple, kwargs: dict) -> list:
        return bind_arguments(self.name, self.args, args, kwargs)

    def loop(self, vals: list, n: int) -> Any:
        """PyTorch's per-tensor loop (its composite foreach kernel)."""
        outs = []
        for i in range(n):
            pos, kw = [], {}
            for v, p, a in zip(vals, self.per_elem, self.elem_args):
                (kw.__setitem__(a.name, v[i] if p else v) if a.kwarg_only else pos.append(v[i] if p else v))
            outs.append(self.elem(*pos, **kw))
        return None if self.inplace else outs

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        vals = self.bind(args, kwargs)
        lists = [v for v, p in zip(vals, self.per_elem) if p]
        n = len(lists[0])
        if n == 0 or any(len(v) != n for v in lists):
            return self.loop(vals, n) if n == 0 else self.elem_mismatch(vals, lists)
        index = self._device(vals)
        if index is None or (self.inplace and not self._no_cross_alias(vals, n)):
            return self.loop(vals, n)
        # Per element: the element overload's arguments, their static part (types of Python numbers, static
        # values) and the dynamic ones (arrays, numbers: new values do not recompile).
        dyn: list[list[Any]] = []
        statics: list[tuple] = []
        for i in range(n):
            evals = self.sig.bind(tuple(v[i] if p else v for v, p in zip(vals, self.per_elem)), {})
            d, s = [], []
            for v, k in zip(evals, self.sig.kinds):
                if k in (TENSOR, OPT_TENSOR, SCALAR):
                    if v is None or type(v) in _NUMBERS:
                        d.append(v)
                        s.append(type(v))
                    else:
                        d.append(_storage.read(v))
                        s.append(None)
                elif k == STATIC:
                    d.append(None)
                    s.append(tuple(v) if isinstance(v, list) else v)
                else:  # generators, tensor lists: not elementwise
                    return self.loop(vals, n)
            dyn.append(d)
            statics.append(tuple(s))
        targets = vals[0] if self.inplace else None
        key = (tuple(statics), tuple(t.dtype for t in targets) if targets is not None else None)
        prog = self._progs.get(key)
        if prog is None:
            prog = self._progs[key] = self._program(statics, key[1], index)
        outs = prog(*dyn)
        if _executor.current_mode() == _LAUNCH_BLOCKING:
            _executor.block_arrays(outs)
        if targets is None:
            return [wrap_arrays(o, index) for o in outs]
        left = range(n) if _executor.recording() else _C._write_wholes(targets, list(outs))
        for i in left:
            _storage.write(targets[i], outs[i])
        return None

    def elem_mismatch(self, vals: list, lists: list) -> Any:
        raise RuntimeError(
            f"aten::{self.name}: Tensor lists must have the same number of tensors, got "
            + " and ".join(str(len(v)) for v in lists)
        )

    def _device(self, vals: list) -> int | None:
        """The one tpu device of every tensor argument, or None when the loop must run (CPU tensors, several
        devices, non-number scalars)."""
        index = None
        for i, (v, a) in enumerate(zip(vals, self.args)):
            if i in self.tensor_args:
                for t in (v if isinstance(v, (list, tuple)) else (v,)):
                    if t is None:
                        continue
                    if not isinstance(t, torch.Tensor) or t.device.type != "tpu":
                        return None
                    if index is None:
                        index = t.device.index
                    elif t.device.index != index:
                        return None
            elif _kind(a) == SCALAR or self.per_elem[i]:
                for s in (v if isinstance(v, (list, tuple)) else (v,)):
                    if s is not None and type(s) not in _NUMBERS:
                        return None
        return index

    def _no_cross_alias(self, vals: list, n: int) -> bool:
        """True when the in-place targets are distinct storages and no other argument reads one of them at another
        position: then computing every element from the old values equals the loop."""
        owner: dict[int, int] = {}
        for j, t in enumerate(vals[0]):
            ptr = t.untyped_storage().data_ptr()
            if ptr in owner:
                return False
            owner[ptr] = j
        for i, v in enumerate(vals[1:], 1):
            if i not in self.tensor_args:
                continue
            for j, t in enumerate(v if isinstance(v, (list, tuple)) else [v] * n):
                if t is not None and owner.get(t.untyped_storage().data_ptr(), j) != j:
                    return False
        return True

    def _program(self, statics: list[tuple], target_dtypes: tuple | None, index: int) -> Any:
        fns = [self.sig._traced(s, None) for s in statics]
        name = self.name

        def program(*dyn: Any) -> list[Any]:
            outs = []
            for i, (fn, d) in enumerate(zip(fns, dyn)):
                out = fn(*d)
                if target_dtypes is not None:
                    want = target_dtypes[i]
                    _check_cast(name, _runtime.torch_dtype(out.dtype), want)
                    if tuple(out.shape) != tuple(d[0].shape):
                        raise RuntimeError(
                            f"output with shape {list(d[0].shape)} doesn't match the broadcast shape "
                            f"{list(out.shape)} (aten::{name}, tensor {i})"
                        )
                    out = out.astype(_runtime.jax_dtype(want))
                outs.append(out)
            return outs

        program.__qualname__ = f"foreach[{name}]"
        return _executor.jitted(program, index, key=(name, tuple(statics), target_dtypes, index))


KERNELS: dict[str, ForeachKernel] = {}
_LIB: torch.library.Library | None = None


def install() -> None:
    """Registers a PrivateUse1 kernel for every functional and in-place foreach overload of `_BASES` whose
    elementwise overload has a jitted lowering."""
    global _LIB
    if _LIB is not None:
        return
    lib = torch.library.Library("aten", "IMPL")
    _metrics.register_kernel_code(ForeachKernel.__call__.__code__)  # recompile warnings name the caller
    for base in _BASES:
        for inplace in (False, True):
            packet = getattr(torch.ops.aten, f"_foreach_{base}{'_' if inplace else ''}", None)
            if packet is None:
                continue
            for ov in packet.overloads():
                op = getattr(packet, ov)
                if any(a.is_out for a in op._schema.arguments):
                    continue
                suffix = "" if ov == "default" else f".{ov}"
                name = f"_foreach_{base}{'_' if inplace else ''}{suffix}"
                target = _trace._foreach_target(f"_foreach_{base}{suffix}")
                if target is None:
                    continue
                cand, per_elem = target
                sig = _trace._trace_kernel(cand)
                if sig is None or not sig.lowering.jit or (inplace and _find_variants(_overload(cand))[0] is None):
                    continue
                kernel = KERNELS[name] = ForeachKernel(name, f"_foreach_{base}{suffix}", cand, per_elem, inplace)
                lib.impl(name, kernel, "PrivateUse1")
    _LIB = lib
