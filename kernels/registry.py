"""The one registry mapping ATen overloads to JAX functions, and the machinery that turns each entry into
PrivateUse1 kernels. Every executor reads LOWERINGS; nothing else maps aten ops to JAX.

A contributor writes one function:

    @lower("add.Tensor", "add.Scalar", promote=DEFAULT, promote_args=("self", "other"))
    def add(self, other, alpha=1):
        return self + other * alpha

Arguments arrive as the schema names them: Tensor -> device array, Scalar -> a JAX scalar (traced, so a new
value does not recompile), everything else (int, bool, float, int[], dtype...) -> a static Python value.
From that one definition the registry installs the functional overload, its in-place form (`add_.Tensor`)
and its out= form (`add.out`), with PyTorch's type promotion, broadcasting checks, cast and resize rules.
Each call runs as a cached `jax.jit` callable keyed by the static arguments; jit itself keys on shapes
and dtypes.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import threading
from typing import Any, Callable, Sequence

import torch
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes
from torch._prims_common.wrappers import _maybe_resize_out

from torch_tpu import _C, _checks, _deferred, _metrics, _runtime, _storage

_fast_args = _C._fast_args
_wrap = _C._wrap
_set_whole = _C._set_whole
_current_mode = _C._mode  # the calling thread's execution mode (torch_tpu/_deferred.py)
_recording = _C._recording
from torch_tpu._jax import jax, jnp

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


LOWERINGS: dict[str, Lowering] = {}
# Kernels written directly against torch tensors (copy_, item, random fills): overload -> function.
DIRECT: dict[str, Callable[..., Any]] = {}
# Direct kernels written for DEFER_AND_FUSE (they only use deferrable calls: _storage.read/write, wrap_arrays,
# `_deferred.jitted` helpers); every other direct kernel flushes pending work and runs eagerly.
DEFERRABLE: set[str] = set()


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
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        for name in names:
            if name in LOWERINGS or name in DIRECT:
                raise RuntimeError(f"torch_tpu: aten::{name} is registered twice")
            LOWERINGS[name] = Lowering(name, fn, promote, tuple(promote_args), jit, variants, cpu_tensors,
                                       broadcasts, trace_only, checks)
        return fn

    return deco


def direct(*names: str, defer: bool = False) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Registers a kernel written against torch tensors. `defer=True` declares it safe to record under
    DEFER_AND_FUSE (see DEFERRABLE)."""
    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        for name in names:
            if name in LOWERINGS or name in DIRECT:
                raise RuntimeError(f"torch_tpu: aten::{name} is registered twice")
            DIRECT[name] = fn
            if defer:
                DEFERRABLE.add(name)
        return fn

    return deco


# ---- schema analysis ----

TENSOR, OPT_TENSOR, TENSOR_LIST, SCALAR, STATIC, GENERATOR = range(6)
_DYNAMIC = (TENSOR, OPT_TENSOR, TENSOR_LIST, SCALAR)


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
    base, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, base), overload or "default")


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


# ---- errors PyTorch users know ----

def _device_mismatch(op: str, a: torch.device, b: torch.device) -> RuntimeError:
    return RuntimeError(
        f"Expected all tensors to be on the same device, but found at least two devices, {a} and {b}! "
        f"(when checking arguments for aten::{op})"
    )


# ---- the kernel built from one lowering ----

_tls = threading.local()


class OpKernel:
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
        # The C++ kernels installed for the functional (False) and in-place (True) forms: handles of their tables.
        self._eager_handles: dict[bool, int] = {}

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

    def prepare(self, vals: list) -> tuple[int, list, tuple, bool]:
        """(device index, dynamic values, static key, any tpu input) with tensors read as device arrays."""
        index = -1
        dev = None
        dyn: list[Any] = []
        static: list[Any] = []
        for v, k in zip(vals, self.kinds):
            if (k == TENSOR or k == OPT_TENSOR) and isinstance(v, (bool, int, float, complex)):
                # A Python number reaching a Tensor argument (`x + 1`): a wrapped scalar.
                dyn.append(v)
                static.append(type(v))
            elif k == TENSOR or (k == OPT_TENSOR and v is not None):
                index, dev = self._check_device(v, index, dev)
                dyn.append(_storage.read(v) if v.device.type == "tpu" else v)  # CPU scalars: below
                static.append(None)
            elif k == TENSOR_LIST:
                arrs = []
                for t in v:
                    if t is None:
                        arrs.append(None)
                        continue
                    index, dev = self._check_device(t, index, dev)
                    arrs.append(_storage.read(t) if t.device.type == "tpu" else t)
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

    # -- tracing --
    def _traced(self, static: tuple, out_dtype: Any) -> Callable[..., Any]:
        lowering = self.lowering
        names = self.arg_names
        kinds = self.kinds
        promote_idx = self.promote_idx

        def run(*dyn: Any) -> Any:
            vals = [dyn[i] if kinds[i] in _DYNAMIC else static[i] for i in range(len(kinds))]
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

        return run

    def compute(self, vals: list, out_dtype: Any = None) -> tuple[int, Any]:
        if _runtime.in_bad_fork:  # the slow path of every lowering (the fast path reads storages in C++)
            raise _runtime.fork_error()
        index, dyn, static, has_arrays = self.prepare(vals)
        key = (static, out_dtype) if has_arrays else (static, out_dtype, index)
        if self.lowering.jit and _recording():
            run = self._runs.get(key)
            if run is None:
                run = self._runs[key] = self._traced(static, out_dtype)
                run._torch_tpu_op = f"aten::{self.name}"  # type: ignore[attr-defined]
            return index, _deferred.record(index, (self.name, key), run, dyn)
        fn = self._jits.get(key)
        if fn is None:
            run = self._traced(static, out_dtype)
            # (_checks.jit / _checks.eager: index checks the lowering reports are registered after each call)
            if not self.lowering.jit:
                fn = _checks.eager(run)
            elif has_arrays:
                fn = _jit(self.lowering, run)
            else:  # nothing to follow: place the result on the op's device
                fn = _jit(self.lowering, run,
                          out_shardings=jax.sharding.SingleDeviceSharding(_runtime.device(index)))
            self._jits[key] = fn
        return index, fn(*dyn)

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
        if not kwargs:
            fast = _fast_args(args)
            if fast is not None:
                if not _current_mode():
                    fn = self._fast.get((len(args), fast[1], None))
                    if fn is not None:
                        return _wrap(fn(*fast[2]), None, fast[0])
                elif _recording():
                    entry = self._fast_rec.get((len(args), fast[1], None))
                    if entry is not None:
                        return _wrap(_deferred.record(fast[0], entry[0], entry[1], fast[2]), None, fast[0])
        vals = self.bind(args, kwargs)
        index, out = self.compute(vals)
        self._after_slow_call(args, kwargs, vals, out)
        return wrap_arrays(out, index)

    def _after_slow_call(self, args: tuple, kwargs: dict, vals: list, out: Any,
                         inplace_dtype: torch.dtype | None = None) -> None:
        """After a call that took the slow path: wait for the device under DEFER_NEVER_AND_LAUNCH_BLOCKING, else
        install the fast-path entry for calls shaped like this one (the recorded kind under DEFER_AND_FUSE)."""
        mode = _current_mode()
        if mode == _deferred.EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING:
            _deferred.block_arrays(out)
            return
        if kwargs or not self.lowering.jit or not self._fast_ok[len(args)] or isinstance(out, (tuple, list)):
            return
        if mode and not _recording():
            return  # inside a kernel that runs eagerly under DEFER_AND_FUSE: no entry for either table
        fast = _fast_args(args)
        if fast is not None:
            self._install_fast(len(args), fast[1], vals, inplace_dtype, recorded=bool(mode))

    def _install_fast(self, n: int, mask: int, vals: list, inplace_dtype: torch.dtype | None = None,
                      recorded: bool = False) -> None:
        """Caches a jitted callable for calls shaped like this one (see `functional` and `inplace`); with
        `recorded`, the unjitted callable DEFER_AND_FUSE records instead. An existing entry is kept: replacing
        it would throw away its compiled executables (jit keys them on shapes)."""
        key = (n, mask, inplace_dtype)
        table = self._fast_rec if recorded else self._fast
        if key in table:
            return
        _, dyn, static, _ = self.prepare(vals)
        run = self._traced(static, None)
        tail = tuple(dyn[n:])
        name = self.name

        def given_args(*given: Any) -> Any:
            out = run(*given, *tail)
            if inplace_dtype is not None:  # new argument dtypes retrace this entry: PyTorch's cast rule, each time
                _check_cast(name, _runtime.torch_dtype(out.dtype), inplace_dtype)
                out = _cast_tree(out, _runtime.jax_dtype(inplace_dtype))
            return out

        if recorded:
            given_args._torch_tpu_op = f"aten::{self.name}"  # type: ignore[attr-defined]
            self._fast_rec[key] = ((self.name, "fast", key), given_args)
        else:
            fn = self._fast[key] = _jit(self.lowering, given_args)
            handle = self._eager_handles.get(inplace_dtype is not None)
            if handle is not None:  # the C++ kernel's table (runtime/TpuDispatch.cpp)
                _C._eager_put(handle, n, mask, inplace_dtype, fn)

    def inplace(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs:
            args, kwargs = self._positional(args, kwargs)
        if not kwargs:
            fast = _fast_args(args)
            if fast is not None:
                if not _current_mode():
                    fn = self._fast.get((len(args), fast[1], args[0].dtype))
                    if fn is not None and _set_whole(args[0], fn(*fast[2])):
                        return args[0]
                elif _recording():
                    entry = self._fast_rec.get((len(args), fast[1], args[0].dtype))
                    if entry is not None and _set_whole(args[0], _deferred.record(fast[0], entry[0], entry[1],
                                                                                  fast[2])):
                        return args[0]
        vals = self.bind(args, kwargs)
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
        if _current_mode() == _deferred.EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING:
            _deferred.block_arrays(result)
        return outs[0] if n_out == 1 else tuple(outs)


def _jit(lowering: Lowering, fn: Callable[..., Any], **jit_kwargs: Any) -> Callable[..., Any]:
    """An eager op's jitted callable: through _checks.jit (which collects the index checks its trace reports)
    when the lowering declares `checks`, else the bare jax.jit callable (no wrapper on the call)."""
    if lowering.checks:
        return _checks.jit(fn, **jit_kwargs)
    return jax.jit(_checks.undeclared(fn, lowering.name), **jit_kwargs)


def _promote(operands: list, static: tuple, idx: tuple, kind: Any) -> tuple[Any, Any]:
    """PyTorch's elementwise type promotion, computed at trace time from avals (never on a cache hit)."""
    proxies = []
    for i, x in zip(idx, operands):
        scalar_type = static[i]
        if isinstance(scalar_type, type) and scalar_type in (bool, int, float, complex):
            proxies.append(scalar_type(0))
        else:
            proxies.append(torch.empty((1,) * x.ndim, dtype=_runtime.torch_dtype(x.dtype), device="meta"))
    compute, result = elementwise_dtypes(*proxies, type_promotion_kind=kind)
    return _runtime.jax_dtype(compute), _runtime.jax_dtype(result)


def _check_broadcast(op: str, operands: list) -> None:
    """PyTorch's broadcast error for elementwise operands whose shapes do not broadcast."""
    shapes = [tuple(jnp.shape(x)) for x in operands]
    if len(shapes) < 2:
        return
    acc = shapes[0]
    for other in shapes[1:]:
        n = max(len(acc), len(other))
        a = (1,) * (n - len(acc)) + acc
        b = (1,) * (n - len(other)) + other
        for i in range(n - 1, -1, -1):
            if a[i] != b[i] and a[i] != 1 and b[i] != 1:
                raise RuntimeError(
                    f"The size of tensor a ({a[i]}) must match the size of tensor b ({b[i]}) at non-singleton "
                    f"dimension {i}"
                )
        acc = tuple(max(x, y) if min(x, y) != 0 else 0 for x, y in zip(a, b))


def result_dtype(*arrays: Any, kind: Any = DEFAULT) -> Any:
    """PyTorch's promoted dtype of several arrays (all treated as dimensioned tensors), as a JAX dtype."""
    proxies = [torch.empty((1,) * max(a.ndim, 1), dtype=_runtime.torch_dtype(a.dtype), device="meta") for a in arrays]
    return _runtime.jax_dtype(elementwise_dtypes(*proxies, type_promotion_kind=kind)[1])


def _cast_tree(out: Any, dtype: Any) -> Any:
    if isinstance(out, (tuple, list)):
        return type(out)(_cast_tree(o, dtype) for o in out)
    return out if out.dtype == dtype else out.astype(dtype)


def wrap_arrays(out: Any, index: int) -> Any:
    """New tpu tensors on tpu:`index` owning the device array(s) `out` (a tuple of arrays gives a tuple)."""
    if isinstance(out, (tuple, list)):
        return tuple(wrap_arrays(o, index) for o in out)
    return _C._wrap(out, _runtime.torch_dtype(out.dtype), index)


def write_outs(op: str, outs: Sequence[torch.Tensor], arrays: Sequence[Any]) -> None:
    """PyTorch's out= convention: check each result can be cast to its out tensor's dtype, resize the out tensor
    (warning when a non-empty one changes shape), and write the result into it."""
    for o, r in zip(outs, arrays):
        _check_cast(op, _runtime.torch_dtype(r.dtype), o.dtype)
        _maybe_resize_out(o, tuple(r.shape))
        _storage.write(o, r)


def _check_same_shape(op: str, target: torch.Tensor, out: Any) -> None:
    if tuple(out.shape) != tuple(target.shape):
        raise RuntimeError(
            f"output with shape {list(target.shape)} doesn't match the broadcast shape {list(out.shape)} "
            f"(aten::{op})"
        )


def _check_cast(op: str, result: torch.dtype, target: torch.dtype) -> None:
    if not torch.can_cast(result, target):
        raise RuntimeError(f"result type {dtype_name(result)} can't be cast to the desired output type {dtype_name(target)}")


def dtype_name(dtype: torch.dtype) -> str:
    """PyTorch's short dtype name used in its error messages ("Float", "Long", ...)."""
    return {
        torch.float32: "Float", torch.float64: "Double", torch.float16: "Half", torch.bfloat16: "BFloat16",
        torch.int64: "Long", torch.int32: "Int", torch.int16: "Short", torch.int8: "Char",
        torch.uint8: "Byte", torch.bool: "Bool", torch.complex64: "ComplexFloat", torch.complex128: "ComplexDouble",
    }.get(dtype, str(dtype))




# ---- installation ----

_LIB: torch.library.Library | None = None
KERNELS: dict[str, OpKernel] = {}


def install() -> None:
    """Registers every lowering (with its in-place and out= forms) and direct kernel for PrivateUse1."""
    global _LIB
    if _LIB is not None:
        return
    lib = torch.library.Library("aten", "IMPL")
    for code in (OpKernel.functional, OpKernel.inplace, OpKernel.out):
        _metrics.register_kernel_code(code.__code__)

    def impl(name: str, fn: Callable[..., Any], deferrable: bool, reason: str) -> None:
        # A kernel that needs concrete arrays flushes DEFER_AND_FUSE's pending work first (and, like every
        # kernel, waits for the device under DEFER_NEVER_AND_LAUNCH_BLOCKING).
        lib.impl(name, fn if deferrable else _deferred.boundary(fn, reason), "PrivateUse1")

    for name, lowering in LOWERINGS.items():
        if lowering.trace_only:
            continue
        op = _overload(name)
        kernel = OpKernel(lowering, op)
        KERNELS[name] = kernel
        _install_eager(lib, kernel, name, False, impl)
        if lowering.variants:
            inplace, out = _find_variants(op)
            if inplace is not None and _name(inplace) not in LOWERINGS and _name(inplace) not in DIRECT:
                _install_eager(lib, kernel, _name(inplace), True, impl)
            if out is not None and _name(out) not in LOWERINGS and _name(out) not in DIRECT:
                kernel.out_names = [a.name for a in out._schema.arguments if a.is_out]
                impl(_name(out), kernel.out, lowering.jit, "data_dependent")
    for name, fn in DIRECT.items():
        reason = "item" if name in ("_local_scalar_dense", "equal") else f"aten::{name}"
        if name in DEFERRABLE:
            lib.impl(name, _deferred.blocking_after(fn), "PrivateUse1")
        else:
            impl(name, fn, False, reason)
    _LIB = lib


def _install_eager(lib: Any, kernel: OpKernel, name: str, inplace: bool, impl: Callable[..., None]) -> None:
    """Installs a lowering's functional or in-place form. A jitted lowering gets the C++ kernel
    (runtime/TpuDispatch.cpp): it runs cache hits without entering Python and calls the Python kernel otherwise."""
    fn = kernel.inplace if inplace else kernel.functional
    if not kernel.lowering.jit:
        impl(name, fn, False, "data_dependent")
        return
    kernel._eager_handles[inplace] = _C._eager_install(name, fn, inplace)


def _name(op: Any) -> str:
    s = op._schema
    return s.name.split("::")[1] + ("." + s.overload_name if s.overload_name else "")


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


def numel(shape: Sequence[int]) -> int:
    return math.prod(shape)



# =====================================================================================================================
# ---- tracing API: an aten overload's lowering called on JAX values ----
# Executors that build one XLA program out of many ops (torch.compile's FX interpreter, torch_tpu/_compile.py) call
# the lowerings here on JAX tracers, with the same argument binding, type promotion and casts as the eager kernels.
# Tensor arguments are JAX values, Scalars and static arguments are Python values. Trace-only lowerings
# (`lower(..., trace_only=True)`: views, metadata and composites) are found here too; `_foreach_*` overloads map
# their elementwise lowering over the lists.

_TRACE_KERNELS: dict[str, OpKernel | None] = {}


def overload_name(op: Any) -> str:
    """The registry's name of an aten OpOverload: `torch.ops.aten.add.Tensor` -> "add.Tensor"."""
    return _name(op)


def _trace_kernel(name: str) -> OpKernel | None:
    if name not in _TRACE_KERNELS:
        lowering = LOWERINGS.get(name)
        kernel = None
        if lowering is not None:
            kernel = KERNELS.get(name) or OpKernel(lowering, _overload(name))
        _TRACE_KERNELS[name] = kernel
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


def _is_scalar_list(arg: Any) -> bool:
    t = arg.type
    return t.kind() == "ListType" and t.getElementType().kind() in ("NumberType", "FloatType", "IntType")


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
    schema_args = _overload(name)._schema.arguments
    vals = list(args)
    for a in schema_args[len(vals):]:
        if a.name in kwargs:
            vals.append(kwargs[a.name])
        elif a.has_default_value():
            vals.append(a.default_value)
        else:
            raise TypeError(f"aten::{name}: missing argument {a.name!r}")
    n = len(next(v for v, p in zip(vals, per_elem) if p))
    return [trace_call(cand, [v[i] if p else v for v, p in zip(vals, per_elem)], {}) for i in range(n)]


# Random values in traced programs: the executor gives each program call a fresh key (`trace_random`), and each
# random lowering traced under it takes its own stream (`next_trace_key`).
_trace_rng = threading.local()


class trace_random:
    """`with trace_random(key):` random lowerings traced inside draw from `key` (one fold per random op)."""

    def __init__(self, key: Any) -> None:
        self.key = key

    def __enter__(self) -> None:
        self.saved = getattr(_trace_rng, "state", None)
        _trace_rng.state = [self.key, 0]

    def __exit__(self, *exc: Any) -> None:
        _trace_rng.state = self.saved


def next_trace_key() -> Any:
    state = getattr(_trace_rng, "state", None)
    if state is None:
        raise NotImplementedError("a random op traced without a key: the executor must trace it under trace_random")
    state[1] += 1
    return jax.random.fold_in(state[0], state[1])
