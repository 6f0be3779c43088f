"""Value-dependent errors (index bounds, `_assert_async`) computed on the device and raised at the next
synchronization point.

CPU PyTorch raises at the op when an index is out of range; CUDA raises a device-side assert that surfaces at the
next synchronization. torch_tpu does what CUDA does, without a host round trip per op:

- The lowering side reports. While a lowering is traced, it calls `report_bad_index(op, index, size, ...)`: that
  computes, inside the same traced program, a tiny int64 flag `[any_bad, first_bad_value]` and appends it, with
  the error's static text, to the collector of the trace being built (thread-local). A kernel never asks which
  mode is on.
- The executor side collects. Every executor traces its programs under `collecting()` and returns the flags as
  extra program outputs: a dict whose keys carry the static text (keys are part of the output's tree structure,
  so the text comes back on every cache hit and with a program loaded from the on-disk store). After a call, the
  executor hands the concrete flags to `register()`; `jit()` does both for jitted per-op callables.
- At every synchronization point (`_runtime.download`: `.cpu()`, `.item()`, printing; `torch.tpu.synchronize()`)
  `raise_pending()` reads the pending flags (a host copy each) and raises the first bad one as the
  exception CPU raises (IndexError or RuntimeError), naming the op, the index, the dimension and the size. A host
  read of a value reads the flags of every program that has finished, which includes all the work the value
  depends on; a flag whose program is still running stays for a later synchronization point (`synchronize()`
  reads them all). Under DEFER_NEVER_AND_LAUNCH_BLOCKING the flags are read right after the op. The pending list
  is bounded: past `_MAX_PENDING` flags the oldest half is read (those ops are done by then).

Assertions (`torch._assert_async(cond[, msg])`, CUDA's device-side assert) are the same kind of flag,
`[cond == 0, 0]`: a traced graph reports them with `report_assert`; an eager kernel computes the flag with an
executor's program and hands it to `register` (under DEFER_AND_FUSE the flag is a placeholder of the pending
graph, computed when it is read: holding it keeps the assertion from being dropped with a graph whose results
are all dead).

`TORCH_TPU_INDEX_CHECKS=0` (or `set_enabled(False)`) turns the checks (assertions included) off: an UNSAFE
opt-out that exists to measure their cost (tools/bench.py); out-of-range indices then give unspecified values
silently.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import numpy as np
import torch

from torch_tpu import _config
from torch_tpu._jax import jax, jnp

enabled = _config.get("TORCH_TPU_INDEX_CHECKS")
_MAX_PENDING = 256

_tls = threading.local()  # .found: the collector (dict) of the trace being built on this thread, or None
_lock = threading.Lock()
_pending: list[tuple[str, Any]] = []  # (static text key, concrete flag array), oldest first


def set_enabled(on: bool) -> bool:
    """Turns the device-side index checks on or off (off is unsafe: for measuring their cost); returns the old
    setting. Executors key their compiled programs on it, so switching does not reuse a program of the other kind."""
    global enabled
    old, enabled = enabled, bool(on)
    return old


# ---- the lowering side ----

def _flag(index: Any, lo: int, hi: int) -> Any:
    flat = index.reshape(-1).astype(jnp.int64)
    bad = (flat < lo) | (flat >= hi)
    first = jnp.argmax(bad)
    return jnp.stack([bad[first].astype(jnp.int64), flat[first]])


_FLAG_JIT: list[Any] = []  # made on first use (importing torch_tpu must not import JAX)


def _flag_jit(index: Any, lo: int, hi: int) -> Any:
    if not _FLAG_JIT:
        _FLAG_JIT.append(jax.jit(_flag, static_argnums=(1, 2)))
    return _FLAG_JIT[0](index, lo, hi)


# Trace-time texts: where `{value}` stands, the bad index is written when the error is raised.
_DEFAULT = "{op}(): index {value} is out of bounds for dimension {dim} with size {size}"


def report_bad_index(op: str, index: Any, size: int, dim: int = 0, *, negative: bool = False,
                     error: type[Exception] = IndexError, message: str | None = None) -> None:
    """Checks, on the device, that every element of the integer array `index` lies in [0, size) (or in
    [-size, size) with `negative`). Called by lowerings while they are traced; the error (type `error`, text
    `message` with {op}, {dim}, {size} and {value} filled in) is raised at the next synchronization point."""
    found = getattr(_tls, "found", None)
    if found is _UNDECLARED:
        raise RuntimeError(
            f"torch_tpu internal error: the lowering of aten::{getattr(_tls, 'undeclared_op', '?')} reports an index "
            f"check ({op}) but does not declare it: add checks=True to its @lower(...) so its eager programs collect "
            "the check (kernels/registry.py)")
    if not enabled or getattr(index, "size", 1) == 0:
        return
    text = (message or _DEFAULT).replace("{op}", op).replace("{dim}", str(dim)).replace("{size}", str(size))
    lo = -size if negative else 0
    if found is None:
        if isinstance(index, jax.core.Tracer):
            raise RuntimeError(
                f"torch_tpu internal error: {op}'s index check was traced outside an executor that collects "
                "device-side checks (trace it under torch_tpu._checks.collecting())")
        register({f"0000|{error.__name__}|{text}": _flag_jit(index, lo, size)})
        return
    if found is _DISCARD:
        return
    flag = _flag(index, lo, size) if isinstance(index, jax.core.Tracer) else _flag_jit(index, lo, size)
    found[f"{len(found):04d}|{error.__name__}|{text}"] = flag


ASSERT = "assert"  # the first field of an assertion's key: its text is the user's, nothing is filled in


def assert_flag(value: Any) -> Any:
    """The flag of an assertion on a one-element array: bad when its value is zero (False)."""
    bad = (value.reshape(()) == 0).astype(jnp.int64)
    return jnp.stack([bad, jnp.zeros((), jnp.int64)])


def assert_key(message: str, error: type[Exception] = RuntimeError) -> str:
    return f"{ASSERT}|{error.__name__}|{message}"


def report_assert(op: str, value: Any, message: str, error: type[Exception] = RuntimeError) -> None:
    """Asserts, on the device, that the one-element array `value` is nonzero; called by lowerings while a graph is
    traced (torch.compile). The error (type `error`, text `message`) is raised at the next synchronization point."""
    found = getattr(_tls, "found", None)
    if found is _UNDECLARED or found is None:
        raise RuntimeError(
            f"torch_tpu internal error: {op}'s assertion was traced outside an executor that collects device-side "
            "checks (trace it under torch_tpu._checks.collecting())")
    if not enabled or found is _DISCARD:
        return
    found[f"{ASSERT}{len(found):04d}|{error.__name__}|{message}"] = assert_flag(value)


def vmap(fn: Callable[..., Any], *levels: Any) -> Callable[..., Any]:
    """`jax.vmap` of `fn`, once per entry of `levels` (each an `in_axes`, innermost first), that carries the checks
    `fn` reports out of the mapped function: a flag reported inside would be a batched tracer that escapes the map.
    Each check's flags over the batch become one flag (the first bad element) in the caller's collector."""
    def inner(*args: Any) -> tuple[Any, dict[str, Any]]:
        with collecting() as found:
            out = fn(*args)
        return out, dict(found)

    mapped = inner
    for axes in levels:
        mapped = jax.vmap(mapped, in_axes=axes)

    def call(*args: Any) -> Any:
        out, flags = mapped(*args)
        outer = getattr(_tls, "found", None)
        if not flags or outer is _DISCARD:
            return out
        if outer is None or outer is _UNDECLARED:
            raise RuntimeError(
                "torch_tpu internal error: a mapped function reports device-side checks outside an executor that "
                "collects them (trace it under torch_tpu._checks.collecting())")
        for key, flag in flags.items():
            rows = flag.reshape(-1, 2)
            first = rows[jnp.argmax(rows[:, 0])]
            rest = key.split("|", 1)[1]
            prefix = ASSERT if key.startswith(ASSERT) else ""
            outer[f"{prefix}{len(outer):04d}|{rest}"] = first
        return out

    return call


# ---- the executor side ----

_DISCARD: dict = {}


# A trace may be built while a user's TorchDispatchMode is active (a fused graph compiled as torch.utils.checkpoint
# recomputes a region under its caching mode and a compiled region there reads a pending value). The torch calls a
# lowering makes while it is traced (meta tensors for PyTorch's promotion rules, torch.can_cast) are torch_tpu's own:
# with the Python dispatch keys excluded no mode sees them. (Seen, TorchTitan's selective activation checkpointing
# raised "aten.empty.memory_format encountered during backward but not found in storage" under DEFER_AND_FUSE.)
_NO_PYTHON_DISPATCH = torch._C.DispatchKeySet(torch._C.DispatchKey.Python) | \
    torch._C.DispatchKeySet(torch._C.DispatchKey.PythonTLSSnapshot)


def outside_python_dispatch() -> Any:
    """A context in which torch calls reach no TorchDispatchMode or tensor subclass's __torch_dispatch__."""
    return torch._C._ExcludeDispatchKeyGuard(_NO_PYTHON_DISPATCH)


class collecting:
    """`with collecting() as found:` the checks reported by lowerings traced inside land in the dict `found`
    (static text -> flag value of this trace); return it as a program output. Inside, torch calls reach no user
    dispatch mode (`outside_python_dispatch`)."""

    __slots__ = ("found", "saved", "guard")

    def __init__(self, discard: bool = False) -> None:
        self.found: dict[str, Any] = _DISCARD if discard else {}

    def __enter__(self) -> dict[str, Any]:
        self.saved = getattr(_tls, "found", None)
        _tls.found = self.found
        self.guard = outside_python_dispatch()
        self.guard.__enter__()
        return self.found

    def __exit__(self, *exc: Any) -> None:
        self.guard.__exit__(None, None, None)
        _tls.found = self.saved


def discarding() -> collecting:
    """A trace that is never run (jax.eval_shape): reported checks are dropped."""
    return collecting(discard=True)


_UNDECLARED: dict = {}


def undeclared(fn: Callable[..., Any], op: str) -> Callable[..., Any]:
    """`fn` for the bare jax.jit of a lowering that declares no checks (kernels/registry.py `checks`): a check
    reported while it is traced fails the trace loudly instead of being dropped. Costs nothing per call."""
    def traced(*args: Any) -> Any:
        saved = getattr(_tls, "found", None), getattr(_tls, "undeclared_op", None)
        _tls.found, _tls.undeclared_op = _UNDECLARED, op
        try:
            return fn(*args)
        finally:
            _tls.found, _tls.undeclared_op = saved

    traced.__name__ = getattr(fn, "__name__", "traced")
    traced.__qualname__ = getattr(fn, "__qualname__", traced.__name__)
    return traced


class _Checked:
    """A traced function's result with the flags it reported (a pytree; the flags dict keys are static)."""

    __slots__ = ("value", "flags")

    def __init__(self, value: Any, flags: dict[str, Any]) -> None:
        self.value = value
        self.flags = flags


_REGISTERED: list[bool] = []


def _register_pytree() -> None:
    if not _REGISTERED:
        jax.tree_util.register_pytree_node(_Checked, lambda c: ((c.value, c.flags), None),
                                           lambda _, children: _Checked(*children))
        _REGISTERED.append(True)


def _collect_trace(fn: Callable[..., Any]) -> Callable[..., Any]:
    def traced(*args: Any) -> Any:
        with collecting() as found:
            out = fn(*args)
        return _Checked(out, dict(found)) if found else out

    traced.__name__ = getattr(fn, "__name__", "traced")
    traced.__qualname__ = getattr(fn, "__qualname__", traced.__name__)
    return traced


def jit(fn: Callable[..., Any], make: Callable[[Callable[..., Any], bool], Any] | None = None,
        **jit_kwargs: Any) -> Callable[..., Any]:
    """`jax.jit(fn)` for a per-op callable whose trace may report checks: calls return `fn`'s result and
    register the flags its program computed. `make(f, checked)` jits the two variants instead of jax.jit (the
    eager executor's persisted jit: the flags travel in the program's result tree)."""
    _register_pytree()
    if make is None:
        on = jax.jit(_collect_trace(fn), **jit_kwargs)
        off = jax.jit(fn, **jit_kwargs)
    else:
        on, off = make(_collect_trace(fn), True), make(fn, False)

    def call(*args: Any) -> Any:
        out = (on if enabled else off)(*args)
        if type(out) is _Checked:
            register(out.flags)
            return out.value
        return out

    call.lower = lambda *a: (on if enabled else off).lower(*a)  # type: ignore[attr-defined]
    return call


def eager(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A lowering run on concrete arrays (data-dependent shapes): checks it reports are registered after it."""
    def call(*args: Any) -> Any:
        with collecting() as found:
            out = fn(*args)
        if found:
            register(found)
        return out

    return call


def register(flags: dict[str, Any] | None, quiet: bool = False) -> None:
    """Hands the concrete flags a program computed to the pending list (read at the next synchronization point;
    right away under DEFER_NEVER_AND_LAUNCH_BLOCKING). `quiet`: only queue them (while another exception, e.g. a
    KeyboardInterrupt, is propagating)."""
    if not flags:
        return
    with _lock:
        _pending.extend(flags.items())
        over = len(_pending) > _MAX_PENDING
    if quiet:
        return
    if _launch_blocking():
        raise_pending(at_op=True)
    elif over:
        with _lock:
            oldest = _pending[:_MAX_PENDING // 2]
            del _pending[:_MAX_PENDING // 2]
        _raise_first(oldest, at_op=False)


_LAUNCH_BLOCKING = 1  # EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING (torch_tpu/_deferred.py; an executor, not imported here)


def _launch_blocking() -> bool:
    from torch_tpu import _C

    return _C._mode() == _LAUNCH_BLOCKING


def raise_pending(at_op: bool = False, computed_only: bool = False) -> None:
    """Reads the pending flags (a host copy each) and raises the first out-of-range index found; the flags read
    are cleared, so an error is raised once and later work is not affected.

    With `computed_only` (a host read, after the value it reads is computed: `.item()`, `.cpu()`), an index check
    whose program is still running stays pending for a later synchronization point instead of being waited for.
    The value read cannot depend on such a program (its own program started after everything it reads had
    finished), so every error of the work behind the value is still raised before the value is returned. A
    training step's `loss.item()` would otherwise wait for the backward pass it just dispatched (its embedding's
    flags): 1.5-2.3 ms of the GPT example's 12 ms step under DEFER_AND_FUSE, measured side by side. Assertions
    (`torch._assert_async`: a program of their own, which nothing reads) and an executor's placeholder (a
    DEFER_AND_FUSE flag not computed yet) are waited for and read, as before."""
    if not _pending:
        return
    with _lock:
        if computed_only:
            items, later = [], []
            for item in _pending:
                ready = getattr(item[1], "is_ready", None)  # (a placeholder, a host value: none)
                (items if ready is None or item[0].startswith(ASSERT) or ready() else later).append(item)
            _pending[:] = later
        else:
            items = _pending[:]
            _pending.clear()
    _raise_first(items, at_op)


def _read_flags(arrays: list[Any]) -> Any:
    """The values of the flag arrays: a host copy of each, all started before the first is waited for, so each
    waits only for the program that computed it. (A program stacking them, read in one copy, was 58 against 102 us
    for five ready flags on an idle machine, but it ran after every program queued before it: on XLA:CPU, a read
    of five ready flags behind a running 90 ms program took 126 ms that way, 0.04 ms copied one by one; on a TPU
    v5e, 5.3 against 0.73 ms behind a 5 ms program, and 0.96 against 0.66 ms with nothing queued.)"""
    for a in arrays:  # (as jax.device_get does, without its Python tree walk: about 50 us per call)
        start = getattr(a, "copy_to_host_async", None)  # (a host value has none)
        if start is not None:
            start()
    return [np.asarray(a) for a in arrays]


def _raise_first(items: list[tuple[str, Any]], at_op: bool) -> None:
    if not items:
        return
    # An executor's placeholder (a DEFER_AND_FUSE assertion's flag not computed yet) is computed now: this is a
    # synchronization point.
    items = [(k, a.concrete("check") if hasattr(a, "concrete") else a) for k, a in items]
    values = _read_flags([a for _, a in items])
    for (key, arr), v in zip(items, values):
        if int(v[0]):
            _, error, text = key.split("|", 2)
            if not key.startswith(ASSERT):
                text = text.replace("{value}", str(int(v[1])))
            raise _error(error, text, arr, at_op)


def _error(error: str, text: str, arr: Any, at_op: bool) -> Exception:
    from torch_tpu import _runtime

    try:
        where = f"tpu:{_runtime.index_of(arr)}"
    except Exception:  # noqa: BLE001 - the device only decorates the message
        where = "tpu"
    if at_op:
        when = f"detected on {where} at the op (DEFER_NEVER_AND_LAUNCH_BLOCKING)"
    else:
        when = (f"detected on {where} at the next synchronization point; run with "
                "TORCH_TPU_EAGER_MODE=DEFER_NEVER_AND_LAUNCH_BLOCKING to raise at the op")
    cls = IndexError if error == "IndexError" else RuntimeError
    return cls(f"{text} ({when})")


def pending_count() -> int:
    return len(_pending)
