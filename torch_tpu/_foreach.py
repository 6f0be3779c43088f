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

Per call, the common case (eager modes, every tensor a tpu tensor viewing its whole storage, one device) reads each
tensor list in one C++ call and binds the arguments column by column, not element by element: an optimizer step
calls about ten of these per parameter group, so their host cost is the eager optimizer's. An in-place call donates
its targets' arrays to the program where each storage holds the only reference (DESIGN.md's storage model), as
compiled graphs do: XLA then writes the new values into the old buffers instead of allocating new ones, which on
XLA:CPU costs more than the arithmetic (an AdamW step's eight programs took 2.2 ms without, 0.95 ms with donation).
"""

from __future__ import annotations

from typing import Any

import torch

from torch_tpu import _C, _executor, _metrics, _runtime, _storage, _trace
from torch_tpu._profiler import program_name
from torch_tpu.kernels._promote import _check_cast, wrap_arrays
from torch_tpu.kernels._schema import (OPT_TENSOR, SCALAR, STATIC, TENSOR, TENSOR_LIST, _find_variants, _kind, _overload,
                                       bind_arguments)

# The elementwise families whose foreach forms get a program (the reductions, e.g. _foreach_norm, keep PyTorch's
# loop: their element overloads take other arguments).
_BASES = ("add", "sub", "mul", "div", "addcmul", "addcdiv", "lerp", "sqrt", "rsqrt", "neg", "abs", "exp", "log",
          "sign", "reciprocal", "maximum", "minimum", "clamp_min", "clamp_max", "pow", "sigmoid", "tanh")
_NUMBERS = (bool, int, float, complex)
donated_inputs = 0  # target arrays given to foreach programs so far (tests read it; compiled graphs count theirs apart)
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
        # The column-wise path: every element argument is a tensor, a number or a static value (no generators or
        # tensor lists); the element arguments past the foreach ones take their defaults, the same in every element.
        kinds = self.sig.kinds
        self.kinds = kinds[:len(self.args)]
        self.columnar = all(k in (TENSOR, OPT_TENSOR, SCALAR, STATIC) for k in kinds)
        tail = self.sig.defaults[len(self.args):]
        self.dyn_tail = [None if k == STATIC else v for v, k in zip(tail, kinds[len(self.args):])]
        self.static_tail = tuple((tuple(v) if isinstance(v, list) else v) if k == STATIC else type(v)
                                 for v, k in zip(tail, kinds[len(self.args):]))

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
        targets = vals[0] if self.inplace else None
        donated: tuple = ()
        mask = 0
        recording = _executor.recording()
        cols = self._columns(vals, n, recording) if self.columnar else None
        if cols is not None:
            dyn, shared, statics, index, donated, mask = cols
        else:
            index = self._device(vals)
            if index is None or (self.inplace and not self._no_cross_alias(vals, n)):
                return self.loop(vals, n)
            per = self._elements(vals, n)
            if per is None:
                return self.loop(vals, n)
            dyn, statics = per
            shared = None
        key = (tuple(statics), tuple(t.dtype for t in targets) if targets is not None else None)
        prog = self._progs.get(key)
        if prog is None:
            prog = self._progs[key] = self._program(statics, key[1], index)
        outs = prog(dyn, shared, donated, mask)
        del donated  # the donated arrays are gone
        if mask:
            global donated_inputs
            donated_inputs += mask.bit_count()
        if _executor.current_mode() == _LAUNCH_BLOCKING:
            _executor.block_arrays(outs)
        if targets is None:
            return [wrap_arrays(o, index) for o in outs]
        left = _C._write_wholes(targets, list(outs))  # (placeholders too: they carry their shape and dtype)
        for i in left:
            _storage.write(targets[i], outs[i])
        return None

    def _elements(self, vals: list, n: int) -> tuple[list, list] | None:
        """The general path's inputs, element by element: the element overload's arguments, their static part
        (types of Python numbers, static values) and the dynamic ones (arrays, numbers: new values do not
        recompile). None when an element argument is not elementwise (the loop runs)."""
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
                    return None
            dyn.append(d)
            statics.append(tuple(s))
        return [list(col) for col in zip(*dyn)], statics  # by column, as _columns gives them

    def _columns(self, vals: list, n: int, recording: bool = False) -> tuple | None:
        """The same inputs as `_elements`, bound column by column, when every tensor argument is a tpu tensor
        viewing its whole storage (each list's arrays from one C++ call), every scalar a Python number, there is
        one device, and no in-place target's array is read by another argument at another position. With them: the
        in-place targets' arrays apart and the bitmask of those that may be donated (their storage holds the only
        reference, counted after every other argument took its own). None: the general path decides.

        On a recording thread (DEFER_AND_FUSE) the storages' placeholders stand for their arrays, and nothing is
        donated here: the fused executor donates a graph's inputs itself when it runs the graph."""
        if _C._device_count() != 1:
            return None
        viewed: list[torch.Tensor] = []  # tensors read through the storage layer (not whole arrays)
        cols: list[Any] = []  # per foreach argument: a tuple of n values, or one value for every element
        scol: list[Any] = []  # the same for the static part
        per: list[bool] = []
        for j, (v, p, k) in enumerate(zip(vals, self.per_elem, self.kinds)):
            if j == 0 and self.inplace:  # read last, for the donation count
                cols.append(None)
                scol.append(None)
                per.append(True)
            elif k == STATIC:
                cols.append(None)
                scol.append(tuple(v) if isinstance(v, list) else v)
                per.append(False)
            elif p:
                v = v if type(v) is list else list(v)
                if v and type(v[0]) in _NUMBERS and all(type(x) in _NUMBERS for x in v):  # (tensors: one test)
                    cols.append(v)
                    scol.append([type(x) for x in v])
                else:
                    arrays = _C._whole_arrays(v, (), recording)
                    if arrays is None:  # some element is a view, or its array has another shape: read it apart
                        got = self._reads(v, recording, viewed)
                        if got is None:
                            return None
                        cols.append(got)
                    else:
                        cols.append(arrays[0])
                    scol.append(None)
                per.append(True)
            elif v is None or type(v) in _NUMBERS:
                cols.append(v)
                scol.append(type(v))
                per.append(False)
            else:
                arrays = _C._whole_arrays([v], (), recording) if isinstance(v, torch.Tensor) else None
                if arrays is None:
                    return None
                cols.append(arrays[0][0])
                scol.append(None)
                per.append(False)
        donated: tuple = ()
        mask = 0
        if self.inplace:
            targets = vals[0] if type(vals[0]) is list else list(vals[0])
            arrays = []
            for c in range(0, n, 64):  # the C++ mask has 64 bits
                got = _C._whole_arrays(targets[c:c + 64], () if recording else tuple(range(min(64, n - c))),
                                       recording)
                if got is None:
                    return None
                arrays.extend(got[0])
                mask |= got[1] << c
            owner = dict(zip(map(id, arrays), range(n)))
            if len(owner) != n:  # two targets share an array: the general path checks their storages
                return None
            if viewed:  # a view's read is a new array: compare storages (a view of a target: the general path)
                mine = {t.untyped_storage().data_ptr() for t in targets}
                if any(t.untyped_storage().data_ptr() in mine for t in viewed):
                    return None
            for c, p in zip(cols[1:], per[1:]):
                if p and type(c) is tuple:
                    # (set operations first: in an optimizer step no other list reads a target's array at all)
                    if not owner.keys().isdisjoint(map(id, c)) and \
                            any(owner.get(id(a), i) != i for i, a in enumerate(c)):
                        return None
                elif id(c) in owner and n > 1:  # one tensor read by every element
                    return None
            cols[0] = arrays
            scol[0] = None
            if mask:
                donated = tuple(arrays)
        # Elements: the static part repeats unless a scalar list varies its number types.
        static0 = [None if p else s for s, p in zip(scol, per)]
        lists = [(j, s) for j, (s, p) in enumerate(zip(scol, per)) if p and s is not None]
        if not lists:
            statics = [tuple(static0) + self.static_tail] * n
        else:
            statics = []
            for i in range(n):
                for j, s in lists:
                    static0[j] = s[i]
                statics.append(tuple(static0) + self.static_tail)
        # By argument: the elements' own values (a column of n), or None where every element reads the same value;
        # `shared`: those values, passed once (each number is one more argument of the jitted call). Columns, not
        # rows: a recorded call's arguments are then flat lists of placeholders (one level, read inline).
        shared = [None if p else c for c, p in zip(cols, per)] + self.dyn_tail
        dyn = [c if p else None for c, p in zip(cols, per)] + [None] * len(self.dyn_tail)
        if mask:  # the targets passed apart, donated, are None in their column
            dyn[0] = None if mask == (1 << n) - 1 else [None if mask >> i & 1 else a for i, a in enumerate(arrays)]
        return dyn, shared, statics, 0, donated, mask

    @staticmethod
    def _reads(v: list, recording: bool, viewed: list) -> tuple | None:
        """The arrays of a tensor list some of whose elements do not view their whole array: those are read
        through the storage layer (a slice, a reshape) and added to `viewed`. None when an element is not a tpu
        tensor."""
        out = []
        for t in v:
            got = _C._whole_arrays([t], (), recording) if isinstance(t, torch.Tensor) else None
            if got is not None:
                out.append(got[0][0])
            elif isinstance(t, torch.Tensor) and t.device.type == "tpu":
                viewed.append(t)
                out.append(_storage.read(t))
            else:
                return None
        return tuple(out)

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
        """The program over the list, called as (per-argument columns of the elements' values, shared arguments or
        None, donated targets, bitmask): an element's argument that is None (or whose column is None) comes from the
        shared ones, element i's target from the donated ones when bit i is set. One jitted function per bitmask (in a steady loop: one), each giving its
        targets' buffers to XLA."""
        fns = [self.sig._traced(s, None) for s in statics]
        name = self.name

        def program(dyn: list, shared: list | None, *donated: Any) -> list[Any]:
            outs = []
            donated_iter = iter(donated)
            if shared is None:
                shared = [None] * len(dyn)
            for i, fn in enumerate(fns):
                d = [s if c is None or c[i] is None else c[i] for c, s in zip(dyn, shared)]
                if d[0] is None and donated:
                    d[0] = next(donated_iter)
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
        program.__name__ = program_name(name)  # the XLA program's name, "aten__foreach_mul_Scalar" (_profiler.py)
        base_key = (name, tuple(statics), target_dtypes, index)
        by_mask: dict[int, Any] = {0: _executor.jitted(program, index, key=base_key)}

        def run(dyn: list, shared: list | None, donated: tuple, mask: int) -> Any:
            if not mask:
                return by_mask[0](dyn, shared)
            prog = by_mask.get(mask)
            if prog is None:
                n_donated = mask.bit_count()
                prog = by_mask[mask] = _executor.jitted(program, index, key=(*base_key, mask),
                                                        donate_argnums=tuple(range(2, 2 + n_donated)))
            return prog(dyn, shared, *(a for i, a in enumerate(donated) if mask >> i & 1))

        return run


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
