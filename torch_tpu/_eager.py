"""The eager executor: turns each lowering of the table (kernels/registry.py) into PrivateUse1 kernels.

`install()` registers, for every `@lower` entry, an `OpKernel`'s functional form and the in-place and out= forms
found beside it (kernels/_schema.py), and every `@direct` kernel, into torch.library. An OpKernel call binds the
arguments by schema, reads tensors as device arrays, applies PyTorch's promotion and casts (kernels/_promote.py)
and runs the lowering as a cached `jax.jit` callable keyed by the static arguments (jit itself keys on shapes and
dtypes); a fast path skips the binding on a cache hit. Under DEFER_AND_FUSE the same function is recorded through
the executor interface (torch_tpu/_executor.py) instead of run.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch

from torch_tpu import _C, _checks, _executor, _memory, _metrics, _runtime, _storage

_fast_args = _C._fast_args
_fast_args_ex = _C._fast_args_ex
_wrap = _C._wrap
_set_whole = _C._set_whole
_current_mode = _C._mode  # the calling thread's execution mode (torch_tpu/_deferred.py)
_recording = _C._recording
from torch_tpu._jax import jax  # noqa: E402
from torch_tpu.kernels._promote import (  # noqa: E402
    _cast_tree,
    _check_cast,
    _check_same_shape,
    _device_mismatch,
    wrap_arrays,
    write_outs,
)
from torch_tpu.kernels._schema import (  # noqa: E402
    GENERATOR,
    OPT_TENSOR,
    SCALAR,
    STATIC,
    TENSOR,
    TENSOR_LIST,
    Signature,
    _find_variants,
    _name,
    _overload,
)
from torch_tpu.kernels.registry import DEFERRABLE, DIRECT, LOWERINGS, Lowering  # noqa: E402


# ---- the kernel built from one lowering ----

class OpKernel(Signature):
    def __init__(self, lowering: Lowering, op: Any) -> None:
        super().__init__(lowering, op)  # schema analysis: args, arg_names, kinds, defaults, promote_idx...
        self._jits: dict[Any, Callable[..., Any]] = {}
        self._runs: dict[Any, Callable[..., Any]] = {}  # the same functions unjitted, recorded by DEFER_AND_FUSE
        self.out_names: list[str] = []
        # Fast path, keyed by (number of positional args, _C._fast_args mask): a jitted callable taking just
        # those arguments' arrays/numbers. Eligible when the given args are Tensor/Scalar per the schema and
        # every omitted one has a default.
        # Values: jitted callables; keys: (args given, mask, None for the functional form or the in-place
        # target's dtype).
        self._fast: dict[tuple[int, int, torch.dtype | None], Callable[..., Any]] = {}
        # The same for DEFER_AND_FUSE: (key, unjitted callable) recorded into the pending graph.
        self._fast_rec: dict[tuple[int, int, torch.dtype | None], tuple[Any, Callable[..., Any]]] = {}
        self._fast_ok = [
            all(k in (TENSOR, SCALAR) for k in self.kinds[:n])
            and all(d is not inspect.Parameter.empty for d in self.defaults[n:])
            for n in range(len(self.kinds) + 1)
        ]
        # Fast path: every argument positional, tensors and scalars only.
        self.simple = all(k in (TENSOR, SCALAR) for k in self.kinds)
        # The wider fast path (_C._fast_args_ex) of functional calls the one above declines: static arguments
        # (int lists, flags, dims) keyed by value, None for optional tensors, several results, and views (a
        # transposed weight, a reshaped activation, a slice) keyed by geometry and read inside the op's program.
        # Keys: (args given, mask, None, the call's `extra`); values: jitted callables (DEFER_NEVER) here,
        # recorded ones in _fast_rec.
        self._fast_ex: dict[tuple, Callable[..., Any]] = {}
        self._static_mask = sum(1 << i for i, k in enumerate(self.kinds) if k == STATIC)
        self._fast_ex_ok = [
            n <= 30
            and all(k in (TENSOR, SCALAR, STATIC, OPT_TENSOR, TENSOR_LIST) for k in self.kinds[:n])
            and all(d is not inspect.Parameter.empty for d in self.defaults[n:])
            for n in range(len(self.kinds) + 1)
        ]
        # The C++ kernels installed for the functional (False) and in-place (True) forms: handles of their tables.
        self._eager_handles: dict[bool, int] = {}

    def prepare(self, vals: list, arrays: bool = True) -> tuple[int, list, tuple, bool]:
        """(device index, dynamic values, static key, any tpu input) with tensors read as device arrays (without
        `arrays`, None in their place: for a caller that needs only the key and the defaulted values)."""
        index = -1
        dev = None
        dyn: list[Any] = []
        static: list[Any] = []
        for v, k in zip(vals, self.kinds):
            if (k == TENSOR or k == OPT_TENSOR) and isinstance(v, (bool, int, float, complex)):
                # A Python number reaching a Tensor argument (`x + 1`): a wrapped scalar.
                dyn.append(v)
                static.append(type(v))
            elif (k == TENSOR or k == OPT_TENSOR) and v is not None:  # (an undefined Tensor arrives as None)
                index, dev = self._check_device(v, index, dev)
                dyn.append(None if not arrays else _storage.read(v) if v.device.type == "tpu" else v)  # CPU: below
                static.append(None)
            elif k == TENSOR_LIST:
                arrs = []
                for t in v:
                    if t is None:
                        arrs.append(None)
                        continue
                    index, dev = self._check_device(t, index, dev)
                    arrs.append(None if not arrays else _storage.read(t) if t.device.type == "tpu" else t)
                dyn.append(arrs)
                static.append(len(v))
            elif k == SCALAR:
                dyn.append(v)
                static.append(type(v))
            elif k == GENERATOR:
                dyn.append(None)
                static.append(None)
            else:
                static.append(tuple(v) if isinstance(v, list) else v)
                dyn.append(None)
        has_arrays = index >= 0
        if index < 0:
            index = _C._current_device()
        for i, d in enumerate(dyn):  # CPU tensors allowed above go to the op's device
            if isinstance(d, torch.Tensor):
                dyn[i] = _runtime.upload(d, index)
            elif isinstance(d, list) and any(isinstance(t, torch.Tensor) for t in d):
                dyn[i] = [_runtime.upload(t, index) if isinstance(t, torch.Tensor) else t for t in d]
        return index, dyn, tuple(static), has_arrays

    def _check_device(self, t: torch.Tensor, index: int, dev: torch.device | None) -> tuple[int, torch.device]:
        d = t.device
        if d.type == "tpu":
            if index >= 0 and d.index != index:
                raise _device_mismatch(self.name, dev, d)
            return d.index, d
        if d.type == "cpu" and (t.dim() == 0 or self.lowering.cpu_tensors):
            return index, dev  # CPU scalars (and, where allowed, index tensors) mix with device tensors, as on CUDA
        raise _device_mismatch(self.name, dev if dev is not None else torch.device("tpu", _C._current_device()), d)

    def compute(self, vals: list, out_dtype: Any = None) -> tuple[int, Any]:
        if _runtime.in_bad_fork:  # the slow path of every lowering (the fast path reads storages in C++)
            raise _runtime.fork_error()
        index, dyn, static, has_arrays = self.prepare(vals)
        key = (static, out_dtype) if has_arrays else (static, out_dtype, index)
        if self.lowering.jit and _recording():
            run = self._runs.get(key)
            if run is None:
                run = self._runs[key] = self._traced(static, out_dtype)
                run._torch_tpu_op = _qualified(self.name)  # type: ignore[attr-defined]
            return index, _executor.record(index, (self.name, key), run, dyn)
        fn = self._jits.get(key)
        if fn is None:
            run = self._traced(static, out_dtype)
            # (_checks.jit / _checks.eager: index checks the lowering reports are registered after each call)
            structure = repr(("eager", _qualified(self.name), static, repr(out_dtype)))
            if not self.lowering.jit:
                fn = _checks.eager(run)
            elif has_arrays:
                fn = _jit(self.lowering, run, structure=structure)
            else:  # nothing to follow: place the result on the op's device
                device = _runtime.device(index)
                fn = _jit(self.lowering, run, structure=structure, device=device,
                          out_shardings=jax.sharding.SingleDeviceSharding(device))
            self._jits[key] = fn
        try:
            return index, fn(*dyn)
        except RuntimeError:  # PJRT's RESOURCE_EXHAUSTED becomes torch.OutOfMemoryError
            _memory.raise_if_oom(index, _qualified(self.name))
            raise

    # -- the three installed forms --
    def _positional(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Keyword arguments that are exactly the next schema arguments become positional (fast path)."""
        names = self.arg_names[len(args):len(args) + len(kwargs)]
        if len(names) == len(kwargs) and all(n in kwargs for n in names):
            return args + tuple(kwargs[n] for n in names), {}
        return args, kwargs

    def functional(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs:
            args, kwargs = self._positional(args, kwargs)
        fast = None
        n = len(args)
        if not kwargs and n < len(self._fast_ok):
            # (an op with static arguments among these, or several results, never has an entry of the first kind)
            fast = _fast_args(args) if self._fast_ok[n] and self.n_returns == 1 else None
            if fast is not None:
                if not _current_mode():
                    fn = self._fast.get((len(args), fast[1], None))
                    if fn is not None:
                        try:
                            return _wrap(fn(*fast[2]), None, fast[0])
                        except RuntimeError:  # PJRT's RESOURCE_EXHAUSTED becomes torch.OutOfMemoryError
                            _memory.raise_if_oom(fast[0], f"aten::{self.name}")
                            raise
                elif _recording():
                    entry = self._fast_rec.get((len(args), fast[1], None))
                    if entry is not None:
                        return _wrap(_executor.record(fast[0], entry[0], entry[1], fast[2]), None, fast[0])
            elif self._fast_ex_ok[n]:
                ex = _fast_args_ex(args, self._static_mask)
                if ex is not None:
                    key = (n, ex[1], None, ex[3])
                    if not _current_mode():
                        fn = self._fast_ex.get(key)
                        if fn is not None:
                            try:
                                return wrap_arrays(fn(*ex[2]), ex[0])
                            except RuntimeError:  # PJRT's RESOURCE_EXHAUSTED becomes torch.OutOfMemoryError
                                _memory.raise_if_oom(ex[0], f"aten::{self.name}")
                                raise
                    elif _recording():
                        entry = self._fast_rec.get(key)
                        if entry is not None:
                            return wrap_arrays(_executor.record(ex[0], entry[0], entry[1], ex[2]), ex[0])
                    vals = self.bind(args, kwargs)
                    out = self._first_ex_call(key, ex, vals)
                    if out is not None:
                        return wrap_arrays(out, ex[0])
                    index, out = self.compute(vals)
                    self._after_ex_call(key, vals, out)
                    return wrap_arrays(out, index)
        vals = self.bind(args, kwargs)
        if not kwargs and fast is not None:
            out = self._first_fast_call(args, fast, vals, None)
            if out is not None:
                return _wrap(out, None, fast[0])
        index, out = self.compute(vals)
        self._after_slow_call(args, kwargs, vals, out)
        return wrap_arrays(out, index)

    def _first_ex_call(self, key: tuple, ex: tuple, vals: list) -> Any:
        """The wider fast path's `_first_fast_call` (under DEFER_NEVER, the first call runs through the entry it
        installs, so the program compiles once; under DEFER_AND_FUSE it is recorded through it, so the first step
        records the graph every later step records); None when the slow path must run."""
        if not self.lowering.jit or len(self._fast_ex) >= _FAST_EX_ENTRIES:
            return None
        if _current_mode():
            if not _recording() or key in self._fast_rec or len(self._fast_rec) >= _FAST_EX_ENTRIES:
                return None
            entry = self._recorded_entry(key, vals, None, _views(key[3]))
            try:
                out = _executor.record(ex[0], entry[0], entry[1], ex[2])
            except Exception:  # noqa: BLE001  (the slow path raises the op's own error, or PyTorch's)
                return None
            self._fast_rec[key] = entry
            return out
        if key in self._fast_ex:
            return None
        fn = self._make_fast(key[0], vals, None, _views(key[3]))
        try:
            out = fn(*ex[2])
        except Exception:  # noqa: BLE001  (the slow path raises the op's own error, or PyTorch's)
            return None
        self._fast_ex[key] = fn
        return out

    def _after_ex_call(self, key: tuple, vals: list, out: Any) -> None:
        """`_after_slow_call` of a call the wider fast path took: the recorded entry under DEFER_AND_FUSE."""
        mode = _current_mode()
        if mode == _executor.EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING:
            _executor.block_arrays(out)
            return
        if (not self.lowering.jit or not mode or not _recording() or key in self._fast_rec
                or len(self._fast_rec) >= _FAST_EX_ENTRIES):
            return
        self._fast_rec[key] = self._recorded_entry(key, vals, None, _views(key[3]))

    def _first_fast_call(self, args: tuple, fast: tuple, vals: list, inplace_dtype: torch.dtype | None) -> Any:
        """The first call shaped for the fast path (its entry missing) runs through the entry it installs. Under
        DEFER_NEVER, so the program is compiled once: through the slow path's general callable and then the entry,
        each op compiled (and, on a warm start, loaded from the persistent cache) twice. Under DEFER_AND_FUSE, so
        the first step records the graph every later step records: through the slow path's callable it recorded
        other nodes (and views read by nodes of their own), a graph of its own to compile. Returns the result
        array (placeholder), or None when the slow path must run (another mode, a result the fast path cannot
        take, an error, which the slow path raises as it always does)."""
        n = len(args)
        key = (n, fast[1], inplace_dtype)
        if not self.lowering.jit or not self._fast_ok[n] or self.n_returns != 1:
            return None
        if _current_mode():
            if not _recording() or key in self._fast_rec:
                return None
            entry = self._recorded_entry(key, vals, inplace_dtype)
            try:
                out = _executor.record(fast[0], entry[0], entry[1], fast[2])
            except Exception:  # noqa: BLE001  (the slow path raises the op's own error, or PyTorch's)
                return None
            if isinstance(out, (tuple, list)) or (inplace_dtype is not None and not _set_whole(args[0], out)):
                return None
            self._put_rec(key, entry)
            self._install_fast(n, fast[1], vals, inplace_dtype)  # DEFER_AND_FUSE runs one-op segments through it
            return out
        if key in self._fast:
            return None  # (an entry that exists has run and declined this call: the slow path decides)
        fn = self._make_fast(n, vals, inplace_dtype)
        try:
            out = fn(*fast[2])
        except Exception:  # noqa: BLE001  (the slow path raises the op's own error, or PyTorch's)
            return None
        if isinstance(out, (tuple, list)) or (inplace_dtype is not None and not _set_whole(args[0], out)):
            return None
        if key not in self._fast:
            self._put_fast(key, fn)
        return out

    def _after_slow_call(self, args: tuple, kwargs: dict, vals: list, out: Any,
                         inplace_dtype: torch.dtype | None = None) -> None:
        """After a call that took the slow path: wait for the device under DEFER_NEVER_AND_LAUNCH_BLOCKING, else
        install the fast-path entry for calls shaped like this one (the recorded kind under DEFER_AND_FUSE)."""
        mode = _current_mode()
        if mode == _executor.EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING:
            _executor.block_arrays(out)
            return
        if kwargs or not self.lowering.jit or not self._fast_ok[len(args)] or isinstance(out, (tuple, list)):
            return
        if mode and not _recording():
            return  # inside a kernel that runs eagerly under DEFER_AND_FUSE: no entry for either table
        fast = _fast_args(args)
        if fast is not None:
            self._install_fast(len(args), fast[1], vals, inplace_dtype, recorded=bool(mode))
            if mode:  # and the eager entry: DEFER_AND_FUSE runs one-op segments through it (_deferred._DIRECT_AFTER)
                self._install_fast(len(args), fast[1], vals, inplace_dtype)

    def _install_fast(self, n: int, mask: int, vals: list, inplace_dtype: torch.dtype | None = None,
                      recorded: bool = False) -> None:
        """Caches a jitted callable for calls shaped like this one (see `functional` and `inplace`); with
        `recorded`, the unjitted callable DEFER_AND_FUSE records instead. An existing entry is kept: replacing
        it would throw away its compiled executables (jit keys them on shapes)."""
        key = (n, mask, inplace_dtype)
        table = self._fast_rec if recorded else self._fast
        if key in table:
            return
        if recorded:
            self._put_rec(key, self._recorded_entry(key, vals, inplace_dtype))
        else:
            self._put_fast(key, self._make_fast(n, vals, inplace_dtype))

    def _given_args(self, n: int, vals: list, inplace_dtype: torch.dtype | None,
                    views: tuple = (), prepared: tuple | None = None) -> Callable[..., Any]:
        """The lowering as a function of the first `n` arguments only (the rest as in `vals`), for the fast path;
        `views` ((position, sizes, strides, storage offset) or (position, "list", elements), ...: _views) reads
        those arguments, or tensor lists' elements, from their storages' arrays. `prepared`: the caller's
        `self.prepare(vals, arrays=False)`."""
        _, dyn, static, _ = prepared or self.prepare(vals, arrays=False)
        run = self._traced(static, None)
        tail = tuple(dyn[n:])
        name = self.name

        def given_args(*given: Any) -> Any:
            if views:
                given = list(given)
                for view in views:
                    i = view[0]
                    if view[1] == "list":  # a tensor list (a tuple here): a list, as the slow path gives it
                        given[i] = [a if not g else _storage.view_of(a, *g) for a, g in zip(given[i], view[2])]
                    else:
                        given[i] = _storage.view_of(given[i], *view[1:])
            out = run(*given, *tail)
            if inplace_dtype is not None:  # new argument dtypes retrace this entry: PyTorch's cast rule, each time
                _check_cast(name, _runtime.torch_dtype(out.dtype), inplace_dtype)
                out = _cast_tree(out, _runtime.jax_dtype(inplace_dtype))
            return out

        given_args.__name__ = run.__name__  # the program's name: the aten overload (kernels/_schema.py _traced)
        return given_args

    def _make_fast(self, n: int, vals: list, inplace_dtype: torch.dtype | None,
                   views: tuple = ()) -> Callable[..., Any]:
        # What given_args computes, in words that mean the same in every process (the arguments after the
        # first n are baked into it)
        prepared = self.prepare(vals, arrays=False)
        _, dyn, static, _ = prepared
        structure = repr(("eager-fast", _qualified(self.name), n, repr(inplace_dtype), views, static,
                          tuple(dyn[n:])))
        return _jit(self.lowering, self._given_args(n, vals, inplace_dtype, views, prepared), structure=structure)

    def _recorded_entry(self, key: tuple, vals: list, inplace_dtype: torch.dtype | None,
                        views: tuple = ()) -> tuple[Any, Callable[..., Any]]:
        """A _fast_rec entry: (the node key DEFER_AND_FUSE records, the unjitted callable); key[0] is the number
        of arguments given."""
        given_args = self._given_args(key[0], vals, inplace_dtype, views)
        given_args._torch_tpu_op = f"aten::{self.name}"  # type: ignore[attr-defined]
        return (self.name, "fast", key), given_args

    def _put_fast(self, key: tuple[int, int, torch.dtype | None], fn: Callable[..., Any]) -> None:
        self._fast[key] = fn
        handle = self._eager_handles.get(key[2] is not None)
        if handle is not None:  # the C++ kernel's table (runtime/TpuDispatch.cpp)
            _C._eager_put(handle, key[0], key[1], key[2], fn)

    def _put_rec(self, key: tuple[int, int, torch.dtype | None], entry: tuple[Any, Callable[..., Any]]) -> None:
        self._fast_rec[key] = entry
        handle = self._eager_handles.get(key[2] is not None)
        if handle is not None:  # the C++ kernel records such calls itself (runtime/TpuDispatch.cpp)
            _C._eager_put_rec(handle, key[0], key[1], key[2], entry[0], entry[1])

    def inplace(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs:
            args, kwargs = self._positional(args, kwargs)
        fast = None
        if not kwargs:
            fast = _fast_args(args)
            if fast is not None:
                if not _current_mode():
                    fn = self._fast.get((len(args), fast[1], args[0].dtype))
                    try:
                        if fn is not None and _set_whole(args[0], fn(*fast[2])):
                            return args[0]
                    except RuntimeError:  # PJRT's RESOURCE_EXHAUSTED becomes torch.OutOfMemoryError
                        _memory.raise_if_oom(fast[0], f"aten::{self.name}")
                        raise
                elif _recording():
                    entry = self._fast_rec.get((len(args), fast[1], args[0].dtype))
                    if entry is not None and _set_whole(args[0], _executor.record(fast[0], entry[0], entry[1],
                                                                                  fast[2])):
                        return args[0]
        vals = self.bind(args, kwargs)
        if not kwargs and fast is not None and self._first_fast_call(args, fast, vals, args[0].dtype) is not None:
            return args[0]  # (its result is swapped into the target's storage)
        target = vals[0]
        index, out = self.compute(vals)
        _check_same_shape(self.name, target, out)
        _check_cast(self.name, _runtime.torch_dtype(out.dtype), target.dtype)
        _storage.write(target, out)
        self._after_slow_call(args, kwargs, vals, out, target.dtype)
        return target

    def out(self, *args: Any, **kwargs: Any) -> Any:
        n_out = self.n_returns
        outs = [kwargs.pop(a) for a in self.out_names if a in kwargs]
        if len(outs) < n_out:
            outs = list(args[len(args) - n_out:]) + outs
            args = args[: len(args) - n_out]
        vals = self.bind(args, kwargs)
        for o in outs:
            if o.device.type != "tpu":
                raise _device_mismatch(self.name, torch.device("tpu", _C._current_device()), o.device)
        index, result = self.compute(vals)
        write_outs(self.name, outs, result if isinstance(result, (tuple, list)) else (result,))
        if _current_mode() == _executor.EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING:
            _executor.block_arrays(result)
        return outs[0] if n_out == 1 else tuple(outs)


# Entries of the wider fast path per kernel and table: a loop over many view geometries (`x[i]` for each i) adds
# one per geometry, as the slow path's readers do (_storage._reader, an LRU of 4096); past this many, calls of
# new shapes take the slow path, so a long-running process does not keep every program it ever compiled.
_FAST_EX_ENTRIES = 256


def _views(extra: tuple) -> tuple:
    """The entries of a _fast_args_ex key that say how to read an argument: (position, sizes, strides, storage
    offset) of a view, (position, "list", per element None, () or a view's (sizes, strides, offset)) of a tensor
    list."""
    return tuple(e for e in extra if len(e) == 4 or (len(e) == 3 and e[1] == "list"))


def _qualified(name: str) -> str:
    """The op's name in messages: "aten::add.Tensor", or another namespace's "ns::op" as it stands."""
    return name if "::" in name else f"aten::{name}"


def _jit(lowering: Any, fn: Callable[..., Any], structure: str | None = None, device: Any = None,
         **jit_kwargs: Any) -> Callable[..., Any]:
    """An eager op's jitted callable: through _checks.jit (which collects the index checks its trace reports)
    when the lowering declares `checks`, else a jax.jit callable (no wrapper on the call); with `structure` (the
    text naming `fn` in every process; `device`: where a call without arrays runs) the compile cache stores its
    executables whole, so a warm start loads them without tracing."""
    from torch_tpu import compile_cache

    if lowering.checks:
        make = None if structure is None else (lambda f, checked: compile_cache.persistent_jit(
            f, repr((structure, "checked" if checked else "unchecked")), device, **jit_kwargs))
        return _checks.jit(fn, make, **jit_kwargs)
    fn = _checks.undeclared(fn, lowering.name)
    if structure is None:
        return jax.jit(fn, **jit_kwargs)
    return compile_cache.persistent_jit(fn, structure, device, **jit_kwargs)


# ---- installation ----

_LIB: torch.library.Library | None = None
KERNELS: dict[str, OpKernel] = {}


def install() -> None:
    """Registers every lowering (with its in-place and out= forms) and direct kernel for PrivateUse1."""
    global _LIB
    if _LIB is not None:
        return
    lib = torch.library.Library("aten", "IMPL")
    _C._eager_set_recorder(_executor.record)  # the C++ kernels' recorded entries (OpKernel._put_rec) record through it
    for code in (OpKernel.functional, OpKernel.inplace, OpKernel.out):
        _metrics.register_kernel_code(code.__code__)

    def impl(name: str, fn: Callable[..., Any], deferrable: bool, reason: str) -> None:
        # A kernel that needs concrete arrays flushes DEFER_AND_FUSE's pending work first (and, like every
        # kernel, waits for the device under DEFER_NEVER_AND_LAUNCH_BLOCKING).
        lib.impl(name, fn if deferrable else _executor.boundary(fn, reason), "PrivateUse1")

    for name, lowering in LOWERINGS.items():
        if lowering.trace_only or "::" in name:  # (other namespaces' entries: install_lowering, when defined)
            continue
        op = _overload(name)
        if any(a.alias_info is not None and a.alias_info.is_write for a in op._schema.arguments):
            # installed as a functional kernel it would return a new value and leave `out`/`self` unwritten
            raise RuntimeError(f"torch_tpu: @lower('{name}') names an overload that writes its arguments "
                               f"({op._schema}); a lowering names the functional overload and its in-place and "
                               "out= forms are generated from it. For a mutating overload alone, use @direct.")
        kernel = OpKernel(lowering, op)
        KERNELS[name] = kernel
        _install_eager(kernel, name, False, impl)
        if lowering.variants:
            inplace, out = _find_variants(op)
            if inplace is not None and _name(inplace) not in LOWERINGS and _name(inplace) not in DIRECT:
                _install_eager(kernel, _name(inplace), True, impl)
            if out is not None and _name(out) not in LOWERINGS and _name(out) not in DIRECT:
                kernel.out_names = [a.name for a in out._schema.arguments if a.is_out]
                impl(_name(out), kernel.out, lowering.jit, "data_dependent")
    for name, fn in DIRECT.items():
        reason = "item" if name == "equal" else f"aten::{name}"
        if name in DEFERRABLE:
            lib.impl(name, _executor.blocking_after(fn), "PrivateUse1")
        else:
            impl(name, fn, False, reason)
    _LIB = lib


_OTHER_LIBS: dict[str, torch.library.Library] = {}


def install_lowering(name: str) -> OpKernel:
    """Installs the PrivateUse1 kernel of one lowering registered after `install()` under another namespace's name
    ("ns::op", e.g. a `torch.tpu.jax_op`): its functional form only, the Python kernel (no C++ fast path)."""
    lowering = LOWERINGS[name]
    ns, _, op_name = name.rpartition("::")
    if not ns or ns == "aten" or lowering.variants or not lowering.jit:
        raise RuntimeError(f"torch_tpu: install_lowering({name!r}) is for other namespaces' functional, jitted "
                           "lowerings registered with variants=False; aten lowerings are installed by install()")
    kernel = OpKernel(lowering, _overload(name))
    KERNELS[name] = kernel
    lib = _OTHER_LIBS.get(ns)
    if lib is None:
        lib = _OTHER_LIBS[ns] = torch.library.Library(ns, "IMPL")
    lib.impl(op_name, kernel.functional, "PrivateUse1")
    return kernel


def _install_eager(kernel: OpKernel, name: str, inplace: bool, impl: Callable[..., None]) -> None:
    """Installs a lowering's functional or in-place form. A jitted lowering gets the C++ kernel
    (runtime/TpuDispatch.cpp): it runs cache hits without entering Python and calls the Python kernel otherwise."""
    fn = kernel.inplace if inplace else kernel.functional
    if not kernel.lowering.jit:
        impl(name, fn, False, "data_dependent")
        return
    kernel._eager_handles[inplace] = _C._eager_install(name, fn, inplace)


def registered_overloads() -> list[str]:
    """Every aten overload with a tpu kernel, including generated in-place and out= forms."""
    names = set(DIRECT)
    for name, lowering in LOWERINGS.items():
        if lowering.trace_only:
            continue
        names.add(name)
        if lowering.variants:
            for v in _find_variants(_overload(name)):
                if v is not None:
                    names.add(_name(v))
    return sorted(names)
