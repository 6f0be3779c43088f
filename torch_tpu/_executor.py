"""The executor interface: what kernels (kernels/), the storage layer (_storage.py) and the collectives call to
compute, so that none of them asks which execution mode is on.

The executors are peers behind it: eager (DEFER_NEVER and DEFER_NEVER_AND_LAUNCH_BLOCKING: a jitted function
runs now; torch_tpu/_eager.py installs the table's lowerings as kernels), fused (DEFER_AND_FUSE: the call is
recorded into the calling thread's pending graph, torch_tpu/_deferred.py) and trace (torch.compile: lowerings
called on tracers, torch_tpu/_trace.py and _compile.py). Each call here picks eager or fused by the calling
thread's mode:

- `jitted(fn, key=...)`: a jitted function of arrays, run now or recorded (its results may be placeholders).
- `concrete(x, reason)`: `x` with every value still pending computed (a kernel that needs real arrays).
- `flush(reason)` / `eagerly()`: run this thread's pending work now / run the ops of a block eagerly (code
  that is its own XLA program, like a collective).
- `boundary(fn, reason)` / `blocking_after(fn)`: how a kernel written against torch tensors is installed.
- `next_trace_key()`: the random key of a random lowering traced in a program (`trace_random` gives it).

Imports point down from here: this module uses the fused executor (_deferred), _checks and _runtime; nothing
below imports it except _storage and the kernels.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any, Callable

from torch_tpu import _C, _checks, _deferred, _memory, _rng, _runtime
from torch_tpu._deferred import EagerMode
from torch_tpu._jax import jax

__all__ = ["EagerMode", "Jitted", "block", "block_arrays", "blocking_after", "boundary", "concrete", "current_mode",
           "eagerly", "flush", "jitted", "next_trace_key", "record", "recording", "trace_random"]

current_mode = _C._mode  # the calling thread's effective mode (an EagerMode value)
recording = _C._recording  # True when this thread's tpu ops are recorded (DEFER_AND_FUSE, not suspended)
record = _deferred.record  # executors only: appends a call of arrays to the pending graph
concrete = _deferred.concrete
capturing = _rng.capturing  # True while this thread's tpu work is captured into a graph (torch_tpu/_graphs.py)
eagerly = _deferred.suspended
_ids = itertools.count(1)
_suspend = _C._suspend


def flush(reason: str) -> None:
    """Runs the work this thread has pending (DEFER_AND_FUSE), e.g. before a program of its own; a no-op in the
    eager modes."""
    if recording():
        _deferred.flush_thread(reason)


# ---- jitted functions: run now, or recorded ----

class Jitted:
    """A jitted function that runs now in the eager modes and is recorded under DEFER_AND_FUSE.

    `index` places results of calls without array arguments (creation ops); otherwise the device follows
    the arguments."""

    __slots__ = ("fn", "_jitted", "_jit_kwargs", "key", "index", "__weakref__")

    def __init__(self, fn: Callable[..., Any], index: int | None = None, key: Any = None,
                 **jit_kwargs: Any) -> None:
        self.fn = fn
        self.index = index
        self._jitted = None  # made on the first eager call (creating it here would import JAX at import time)
        self._jit_kwargs = jit_kwargs
        # With `key` (what makes this function what it is, e.g. its factory's arguments) the structural key is
        # the same in every process, so graphs using it can be cached on disk; without, it is process-local.
        name = getattr(fn, "__qualname__", "jitted")
        self.key = (name, key) if key is not None else (name, _deferred._LOCAL, next(_ids))

    def __call__(self, *args: Any) -> Any:
        if _runtime.in_bad_fork:  # kernels that compute before touching a storage (fill_, random_) come here
            raise _runtime.fork_error()
        if recording():
            return record(self._index(args), self.key, self.fn, args)
        if self._jitted is None:
            self._make()
        try:
            return self._jitted(*args)
        except RuntimeError:  # PJRT's RESOURCE_EXHAUSTED becomes torch.OutOfMemoryError
            _memory.raise_if_oom(self._index(args), f"the program of a tpu kernel ({self.key[0]})")
            raise

    def _make(self) -> None:
        kwargs = dict(self._jit_kwargs)
        if self.index is not None:
            kwargs.setdefault("out_shardings", jax.sharding.SingleDeviceSharding(_runtime.device(self.index)))
        self._jitted = _checks.jit(self.fn, **kwargs)  # index checks its trace reports are registered

    def _index(self, args: tuple) -> int:
        if self.index is not None:
            return self.index
        for a in args:
            if type(a) is _deferred.Pending:
                if a.graph is not None:
                    return a.graph.index
                a = a.value
            if hasattr(a, "devices") and not isinstance(a, type):
                return _runtime.index_of(a)
        return _C._current_device()


def jitted(fn: Callable[..., Any], index: int | None = None, key: Any = None, **jit_kwargs: Any) -> Jitted:
    return Jitted(fn, index, key, **jit_kwargs)


# ---- kernels that need concrete arrays ----

def boundary(fn: Callable[..., Any], reason: str) -> Callable[..., Any]:
    """Wraps a kernel that reads concrete arrays: under DEFER_AND_FUSE it flushes pending work first and runs
    eagerly; under DEFER_NEVER_AND_LAUNCH_BLOCKING it waits for the device afterwards."""

    def kernel(*args: Any, **kwargs: Any) -> Any:
        mode = current_mode()
        if not mode:
            return fn(*args, **kwargs)
        if mode == EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING:
            out = fn(*args, **kwargs)
            block(out)
            return out
        if not recording():  # suspended already
            return fn(*args, **kwargs)
        _deferred.flush_thread(reason)  # values pending elsewhere are computed when read (runtime/TpuPython.cpp)
        _suspend(1)  # (as `with _deferred.suspended()`, without the context manager's cost on sync-heavy code)
        try:
            return fn(*args, **kwargs)
        finally:
            _suspend(-1)

    kernel.__name__ = getattr(fn, "__name__", "kernel")
    kernel.__qualname__ = getattr(fn, "__qualname__", kernel.__name__)
    kernel.__wrapped__ = fn  # type: ignore[attr-defined]
    return kernel


def block(out: Any) -> None:
    """DEFER_NEVER_AND_LAUNCH_BLOCKING after a direct kernel: wait for all queued device work (a direct kernel's
    results are tensors, not arrays, so this does not look at `out`)."""
    _runtime.synchronize()


def block_arrays(out: Any) -> None:
    for a in jax.tree_util.tree_leaves(out):
        if hasattr(a, "block_until_ready"):
            a.block_until_ready()


def blocking_after(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps a deferrable direct kernel: under DEFER_NEVER_AND_LAUNCH_BLOCKING it waits for the device after."""

    def kernel(*args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        if current_mode() == EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING:
            block(out)
        return out

    kernel.__name__ = getattr(fn, "__name__", "kernel")
    kernel.__wrapped__ = fn  # type: ignore[attr-defined]
    return kernel


# ---- random values in traced programs ----
# The executor gives each program call a fresh key (`trace_random`), and each random lowering traced under it
# takes its own stream (`next_trace_key`); both live in the one RNG module, torch_tpu/_rng.py.
from torch_tpu._rng import next_trace_key, trace_random  # noqa: E402
