"""Execution modes, and the pending graph of DEFER_AND_FUSE.

Every kernel computes its result with jitted JAX functions: the eager executor's per-op callables
(torch_tpu/_eager.py), the storage readers and writers (_storage.py) and the helpers kernels build with
`_executor.jitted()`. In the eager modes they run at once. Under DEFER_AND_FUSE, `record()` appends the call to the
calling thread's pending graph of its device instead and returns `Pending` placeholders carrying the result's
shape and dtype (from a cached `jax.eval_shape`); storages hold these placeholders like arrays. `flush()` runs the whole
graph as one cached `jax.jit` program whose outputs are only the placeholders still alive (a storage or a
tensor holds them): results nobody can read are never materialised. The C++ accessors swap a resolved
placeholder for its array on first read, through `resolve` (the placeholder contract in runtime/TpuPython.cpp).

A graph is flushed when a value is needed: `.cpu()`, `.item()`, printing, `torch.tpu.synchronize()`, an op
with data-dependent shapes or any kernel not written for deferral (they run eagerly after the flush), a mode
change, a tensor moving to another device, and a size limit (TORCH_TPU_FUSE_MAX_OPS, default 1000 ops). It is
also run, without waiting for it, when a backward pass starts or ends and when an optimizer step ends (see
_task_started).
The graph's cache key is structural: per op its callable's id, where its inputs come from, and their
shapes/dtypes; Python scalars are inputs, so new values do not recompile.

Sync-heavy code (an op, then a read of its result) would flush one-op graphs, each the op's own program: after a
few in a row, a thread runs the first op of each segment through the eager cache hit instead, the same program
without recording and flushing, until a segment grows past one op (`_DIRECT_AFTER`, runtime/TpuMode.cpp). Metrics
count each such segment as the one-op flush it stands for.

Threads: the mode is per thread with a process default, and each thread records its own graphs, so two
threads never interleave ops in one graph (which changed its structure, hence recompiled, on every flush).
The autograd engine's threads record into the graph of the thread that called backward. A placeholder read
by another thread, or by its own after the mode changed, is computed first: its graph's `run_lock` lets one
thread run it while the others wait.
"""

from __future__ import annotations

import collections
import enum
import functools
import itertools
import operator
import sys
import threading
import weakref
from typing import Any, Callable

import torch

from torch_tpu import _checks, _config, _memory, _metrics, _runtime
from torch_tpu._jax import jax
from torch_tpu._profiler import graph_program_name


class EagerMode(enum.IntEnum):
    """How tpu ops execute (`torch.tpu.eager_mode`)."""

    DEFER_NEVER = 0  # each op runs when called (asynchronously dispatched)
    DEFER_NEVER_AND_LAUNCH_BLOCKING = 1  # each op runs when called and the host waits for it: errors surface at the op
    DEFER_AND_FUSE = 2  # ops are recorded and run as one XLA computation when a value is needed

    def __str__(self) -> str:
        return f"EagerMode.{self.name}"

    __repr__ = __str__


# The mode is per thread with a process default (runtime/TpuMode.cpp keeps it; the hot paths call these two):
# `current_mode()` is the calling thread's effective mode (its own; inside a backward pass, the caller's; else
# the process default); `recording()` is True when this thread's tpu ops are recorded (DEFER_AND_FUSE, not
# suspended). Each thread records into its own pending graphs (one per device); the autograd engine's threads
# record into the graphs of the thread that called backward (`_C._graph_owner()`).
from torch_tpu import _C  # noqa: E402

current_mode = _C._mode
recording = _C._recording
_lock = threading.RLock()  # graph bookkeeping only: never held while a program compiles or runs
_ids = itertools.count(1)  # trace ids (_Trace)
_LOCAL = "<process-local>"  # marks a structural key that is only meaningful in this process


def _parse_mode(value: Any) -> EagerMode:
    if isinstance(value, EagerMode):
        return value
    if isinstance(value, str):
        key = value.strip().upper()
        if key in EagerMode.__members__:
            return EagerMode[key]
    elif isinstance(value, int) and value in tuple(EagerMode):
        return EagerMode(value)
    raise ValueError(
        f"torch_tpu: unknown eager mode {value!r}; use one of torch.tpu.EagerMode."
        f"{', torch.tpu.EagerMode.'.join(EagerMode.__members__)} (or their names in TORCH_TPU_EAGER_MODE)"
    )


def _changed(old: int) -> None:
    """After the calling thread's effective mode changed from `old`: leaving DEFER_AND_FUSE runs its graphs."""
    if old == EagerMode.DEFER_AND_FUSE and _C._mode() != old:
        flush_thread("mode_change")


def set_thread_mode(value: Any) -> int:
    """Sets the calling thread's own mode (None: it runs in the process default again); returns its previous
    own mode (-1 when it had none), for restore_thread_mode."""
    new = -1 if value is None else int(_parse_mode(value))
    if getattr(_step, "scope", None) is not None:
        _end_abandoned_step()
    old_own, old = _C._thread_mode(), _C._mode()
    _C._set_thread_mode(new)
    _changed(old)
    return old_own


def restore_thread_mode(own: int) -> None:
    old = _C._mode()
    _C._set_thread_mode(own)
    _changed(old)


def set_default_mode(value: Any) -> EagerMode:
    """Sets the process default (the mode of threads without one of their own); returns the previous one."""
    new = _parse_mode(value)
    old_default, old = EagerMode(_C._default_mode()), _C._mode()
    _C._set_default_mode(int(new))
    _changed(old)
    return old_default


def set_mode(value: Any) -> None:
    """`torch.tpu.eager_mode = value`: in the main thread, the process default (which the main thread then runs
    in, ending a set_eager_mode block's own mode); in any other thread, that thread's own mode."""
    if threading.current_thread() is threading.main_thread():
        new = _parse_mode(value)
        old = _C._mode()
        _C._set_default_mode(int(new))
        _C._set_thread_mode(-1)
        _changed(old)
    else:
        set_thread_mode(value)


def mode_from_env() -> None:
    from torch_tpu import _config

    value = _config.get("TORCH_TPU_EAGER_MODE")
    if value:
        try:
            set_default_mode(value)
        except ValueError as e:
            raise RuntimeError(f"TORCH_TPU_EAGER_MODE={value!r}: {e}") from None


class suspended:
    """Context: ops on this thread run eagerly (a kernel that needs concrete arrays)."""

    __slots__ = ()

    def __enter__(self) -> None:
        _C._suspend(1)

    def __exit__(self, *exc: Any) -> None:
        _C._suspend(-1)


# ---- placeholders ----

class DeferredError(RuntimeError):
    pass


class Pending:
    """A value a pending graph will compute. Storages hold it like a device array (shape, dtype)."""

    __slots__ = ("graph", "node", "out", "shape", "dtype", "weak_type", "meta", "value", "error", "__weakref__")

    def __init__(self, graph: "_Graph", node: int, out: int, meta: tuple) -> None:
        self.graph = graph
        self.node = node
        self.out = out
        self.shape, self.dtype, self.weak_type = meta  # the output's (shape, dtype, weak_type)
        self.meta = meta  # the same tuple: a recorded argument's signature
        self.value = None
        self.error: BaseException | None = None

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def concrete(self, reason: str = "value_needed") -> Any:
        if self.value is None:
            if self.error is None:
                flush(self.graph, reason)  # any thread may: the graph's run_lock makes one of them run it
            if self.error is not None:
                raise DeferredError(
                    f"torch_tpu: this tensor's value came from a deferred graph that failed: {self.error}"
                ) from self.error
        return self.value

    def __repr__(self) -> str:
        state = "resolved" if self.value is not None else "pending"
        return f"Pending({state}, shape={self.shape}, dtype={self.dtype})"


class Bound:
    """What a storage holds while a graph capture runs on its device (torch_tpu/_graphs.py): its array, as an input
    of the captured program bound to the storage, so that each replay reads the storage's array of that moment (a
    static input the user `copy_`s new data into, a parameter the captured step updates). Recorded ops take it as
    an input like an array (its shape, dtype and aval are the array's); only the capturing thread (and the autograd
    threads working for it) may read it. The capture puts every storage's own array back when it ends."""

    __slots__ = ("storage", "array", "graph", "shape", "dtype", "weak_type", "aval")

    def __init__(self, storage: Any, array: Any, graph: "_Graph") -> None:
        self.storage = storage  # the torch.UntypedStorage (a strong reference)
        self.array = array
        self.graph = graph
        self.aval = array.aval
        self.shape, self.dtype, self.weak_type = self.aval.shape, self.aval.dtype, self.aval.weak_type

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return self.array.size

    def devices(self) -> Any:
        return self.array.devices()

    def __repr__(self) -> str:
        return f"Bound(shape={self.shape}, dtype={self.dtype})"


def _bound_error(by: str) -> RuntimeError:
    return RuntimeError(
        "torch_tpu: this tensor's storage is bound to a tpu graph being captured (torch.tpu.graph / "
        f"torch.accelerator.Graph), and its value was needed {by}. Inside a capture only the capture's recorded "
        "tpu ops may use it: read values after the capture ends (after `replay()` for the captured results)."
    )


def _bound_read(x: Bound) -> None:
    if x.graph.owner != _C._graph_owner():
        raise _bound_error("by another thread")
    if not recording():
        raise _bound_error("by a kernel that runs eagerly (not recorded)")
    return None  # the capture records it as an input


def resolve(x: Any) -> Any:
    """The resolver of the storage accessors (runtime/TpuPython.cpp): a placeholder's array once computed; while
    the calling thread records, None (keep the placeholder); otherwise its value is computed now."""
    if type(x) is not Pending:
        if type(x) is Bound:
            return _bound_read(x)
        return None
    v = x.value
    if v is None and not recording():
        v = x.concrete()
    return v


def concrete(x: Any, reason: str = "value_needed") -> Any:
    """`x` with every Pending (also inside lists/tuples) replaced by its computed array (flushing if needed)."""
    if type(x) is Pending:
        return x.concrete(reason)
    if type(x) is Bound:  # (a capture's input: its value at a replay is not known now)
        raise _bound_error(f"as a concrete value ({reason})")
    if isinstance(x, (list, tuple)):
        return type(x)(concrete(v, reason) for v in x)
    _segment_end(x, reason)  # the read of an op that ran directly ends its segment (metrics count it as a flush)
    return x


# ---- the pending graph ----

class _Trace:
    """The recorded structure of a flushed graph, for replaying a step whose structure repeats: per node its
    (fn key, arg specs, arg signature, node info). A graph that starts recording predicts the trace that followed
    the previous one in the same slot (thread, device); while each op matches the prediction at its position, its
    node info is taken from the trace (no key hashing or lookup), and a graph that matched to the end runs the
    trace's program (its key `id` was computed once). The first op that differs, in function, static args, input
    structure, shape or dtype, leaves the prediction for good and records normally (Python scalars are inputs:
    their values never take part)."""

    __slots__ = ("id", "keys", "entries", "next")

    def __init__(self, keys: tuple, entries: list) -> None:
        self.id = next(_ids)
        self.keys = keys
        self.entries = entries
        self.next: _Trace | None = None  # the trace flushed after this one last time in the same slot


class _Graph:
    __slots__ = ("owner", "index", "inputs", "input_pos", "nodes", "keys", "pendings", "done", "run_lock",
                 "trace", "entries", "limit", "capture", "__weakref__")

    def __init__(self, owner: int, index: int) -> None:
        self.owner = owner  # the thread recording it (runtime/TpuMode.cpp's id)
        self.index = index
        # Ops before it runs ("size_limit"): TORCH_TPU_FUSE_MAX_OPS, or a whole number of periods where the slot's
        # last graphs grew without a synchronization and repeated a structure (see _cut).
        self.limit = min(_cut.get((owner, index)) or _MAX_OPS, _MAX_OPS)
        self.done = False  # ran (or failed): its placeholders hold their values (or errors)
        self.run_lock = threading.Lock()  # held by the one thread running it; readers elsewhere wait for it
        self.inputs: list[Any] = []  # concrete arguments: device arrays and Python scalars
        # id(device array) -> (spec, signature) of its position in inputs (arrays are deduplicated)
        self.input_pos: dict[int, tuple] = {}
        self.nodes: list[tuple[Callable[..., Any], tuple, Any]] = []  # (fn, arg specs, output treedef)
        self.keys: list[int] = []  # structural id per node (see _nodes)
        self.pendings: list[weakref.ref] = []  # every placeholder handed out, in order
        # The predicted trace while every op so far matched it (None once one did not, or without one).
        self.trace: _Trace | None = _predicted.get((owner, index))
        self.entries: list[tuple] = []  # (fn key, specs, signature, node info) per node: this graph's trace
        # While a tpu graph capture records into it (torch_tpu/_graphs.py): the capture. It never runs as a pending
        # graph: a flush (a value needed, a synchronization) raises the capture's error instead.
        self.capture: Any = None


_graphs: dict[tuple[int, int], _Graph] = {}  # (owner thread, device index) -> the graph recording there
_avals: dict[tuple, tuple[list[Any], Any]] = {}  # (fn key, arg signature) -> (output avals, treedef)
# (fn key, arg specs, arg signature) -> (node id, outputs' (shape, dtype, weak_type), treedef or None for a
# single array): a graph's key is its node ids, so a flush hashes a tuple of ints, not every op's structure.
_nodes: dict[tuple, tuple[int, list[tuple], Any, str | None]] = {}
_node_text: dict[int, str | None] = {}  # node id -> stable text of its key (None: process-local)
# graph key -> compiled program, least recently used first; capped (TORCH_TPU_FUSE_CACHE, default 512 programs)
# so a workload whose graphs keep changing does not hold every executable it ever compiled.
_fused: collections.OrderedDict[tuple, Callable[..., Any]] = collections.OrderedDict()
_SCALARS = (bool, int, float, complex)
_ARRAY_TYPES: set[type] = set()  # the types of device arrays _arg has seen (jax's array type): inputs as they are
_HOST_DTYPES = {bool: "bool", int: "int64", float: "float64", complex: "complex128"}  # a packed scalar's, exact
# Traces of flushed graphs by their node ids (oldest first, capped like _fused), and per slot (owner thread, device
# index) the trace the next graph there is predicted to follow and the one flushed last.
_traces: dict[tuple, _Trace] = {}
_predicted: dict[tuple[int, int], _Trace] = {}
_last_trace: dict[tuple[int, int], _Trace] = {}
_first: dict[tuple, _Trace] = {}  # a first op's (fn key, specs, signature) -> the trace flushed last that began with it
# Per slot, the size at which its graphs are cut while they grow without a synchronization and repeat a structure
# of `p` ops (a training loop that never reads a value): the smallest multiple of p of at least _CUT_MIN ops (within
# TORCH_TPU_FUSE_MAX_OPS); 0: the cut did not repeat, graphs run at the size limit until the next synchronization.
# Cut at the size limit alone, such a stream is cut at a different point of its step each time, and every graph
# is a new structure to compile (ResNet-18 + AdamW, 30 steps without a sync: about 816 ms a step); cut at a
# multiple of its period, every graph after the first has one structure, so it compiles once and then replays.
# A graph of about one step also compiles far faster than one of the size limit (XLA's compile time grows with
# the graph). _cut_last: the trace of the slot's last graph run at the cut (None: the next is the first there).
_cut: dict[tuple[int, int], int] = {}
_cut_last: dict[tuple[int, int], _Trace | None] = {}
_CUT_MIN = 64


def _env_count(name: str) -> int:
    from torch_tpu import _config

    return _config.get(name)


_MAX_OPS = _env_count("TORCH_TPU_FUSE_MAX_OPS")
_FUSED_CAP = _env_count("TORCH_TPU_FUSE_CACHE")
# Sync-heavy code (an op, then a read of its result) flushes one-op graphs, and a one-op graph runs the op's own
# program: after this many of a thread's own graphs in a row flushed with one op, the first op of each segment
# (the ops between two synchronization points) runs through the eager cache hit instead, which computes the same
# program without the cost of recording and flushing; a second op in a segment, or an op the cache hit does not
# take, records again from there (runtime/TpuMode.cpp keeps the state, with a back-off). 0: always record.
_DIRECT_AFTER = 3
_segment_end = _C._fuse_segment_end


def reset_direct() -> None:
    """The calling thread records every op again, as before its first flush (its one-op-segment state cleared)."""
    _C._fuse_flushed(0, 0)


def _graph(index: int) -> _Graph:
    """The graph this thread records into on tpu:`index` (under _lock)."""
    key = (_C._graph_owner(), index)
    g = _graphs.get(key)
    if g is None:
        if _ended:
            _drop_ended()
        g = _graphs[key] = _Graph(*key)
        if getattr(_thread_end, "owner", None) is None and key[0] == _C._thread_id():
            _thread_end.owner = _ThreadEnd(key[0])
    return g


class _ThreadEnd:
    """Lives in a recording thread's thread-local state: when the thread ends, its graphs leave `_graphs` (at the
    next new graph or flush_thread, under _lock). Placeholders still alive keep their graph (and can run it); a
    graph nobody can read is freed with its inputs."""

    __slots__ = ("owner",)

    def __init__(self, owner: int) -> None:
        self.owner = owner

    def __del__(self) -> None:
        _ended.append(self.owner)  # atomic; _graphs itself is only changed under _lock


_thread_end = threading.local()
_ended: list[int] = []  # threads that ended since the last _drop_ended


def _drop_ended() -> None:
    while _ended:
        owner = _ended.pop()
        for key in [k for k in _graphs if k[0] == owner]:
            del _graphs[key]
        for key in [k for k in _cut if k[0] == owner]:
            del _cut[key]
            _cut_last.pop(key, None)


class _Transfer(Exception):
    """Raised inside _lock by a recording call that needs a value pending in another graph: record computes it
    outside the lock (running a graph waits for its run_lock, which its runner may hold while it waits for _lock)
    and retries."""

    def __init__(self, pending: "Pending") -> None:
        self.pending = pending


def _input(g: _Graph, a: Any) -> tuple[tuple, Any]:
    found = g.input_pos.get(id(a))
    if found is None:
        aval = getattr(a, "aval", None)  # a jax.Array's: reading its fields is cheaper than its properties
        sig = (aval.shape, aval.dtype, aval.weak_type) if aval is not None else \
            (tuple(a.shape), a.dtype, bool(getattr(a, "weak_type", False)))
        found = g.input_pos[id(a)] = (("i", len(g.inputs)), sig)
        g.inputs.append(a)
    return found


def _arg(g: _Graph, a: Any) -> tuple[Any, Any]:
    """(spec, signature) of an argument of a recorded call that the C++ loop (`_arg_list`, which takes this graph's
    placeholders, the inputs it has, Python numbers, None and lists inline) hands back: a placeholder of another
    graph or already computed, a `Bound`, a device array of a type not seen yet, a constant."""
    t = type(a)
    if t is Pending:
        if a.value is not None:
            return _input(g, a.value)
        if a.graph is not g:
            raise _Transfer(a)  # another thread's or device's graph: materialise it (outside _lock)
        return ("n", a.node, a.out), a.meta
    if t is Bound and a.graph is not g:
        raise _bound_error("by an op recorded into another graph (another thread's, or another device's)")
    if hasattr(a, "shape") and hasattr(a, "dtype"):  # a device array (or numpy value, Bound, drawn RNG step)
        if t is not Bound:
            _ARRAY_TYPES.add(t)  # _arg_list takes its elements of this type inline
        return _input(g, a)
    return ("c", a), ("c", a)  # a hashable constant


# _arg of a list (a foreach op's: per element, its arguments): ("l", specs), sigs. One C++ loop (runtime/TpuMode.cpp)
# takes the common elements inline (this graph's placeholders, inputs it has already, Python numbers, None, nested
# lists) and hands anything else to _arg or _input; a foreach op over a model's parameters has a few hundred.
_arg_list = _C._fuse_arg_list
_C._fuse_arg_types(Pending, _ARRAY_TYPES, _arg, _input)


_fast_record = _C._fuse_record  # _record for the op the graph's trace predicts (None: record it below)


def _abstract(spec: Any, sig: Any, inputs: list[Any]) -> Any:
    if spec is None:
        return None
    kind = spec[0]
    if kind == "l":
        return [_abstract(s, g, inputs) for s, g in zip(spec[1], sig)]
    if kind == "c":
        return spec[1]
    if kind == "i" and type(inputs[spec[1]]) in _SCALARS:
        return inputs[spec[1]]
    shape, dtype, weak = sig
    return jax.ShapeDtypeStruct(shape, dtype, weak_type=weak)


def record(index: int, fkey: Any, fn: Callable[..., Any], args: tuple | list) -> Any:
    """Appends `fn(*args)` to the pending graph this thread records into on tpu:`index`; returns placeholders
    shaped like its result."""
    task = _task_id()
    if task >= 0 and task not in _ending:
        _task_started(task)
    fast = _fast_record(index, fkey, fn, args)
    if fast is not None:
        if fast[1] is not None:
            _recorded(fast[1])
        return fast[0]
    while True:
        try:
            with _lock:
                result, full = _record(index, fkey, fn, args)
        except _Transfer as t:
            t.pending.concrete("transfer")
            continue
        if full is not None:
            _recorded(full)
        return result


def _recorded(full: "_Graph") -> None:
    """After an op is recorded into a graph that reached its size limit: runs it."""
    flush(full, "size_limit")


# ---- the start and end of a backward pass, the end of an optimizer step ----
# A training step records its forward pass, backward pass and optimizer update, and only then reads a value
# (`loss.item()`): the device waited for the last op to be recorded before any of the step ran. So under
# DEFER_AND_FUSE, when a backward pass is about to record its first tpu op, when it ends, and when an optimizer step
# ends, the graphs of the thread that called it are run (dispatched, not waited for): the device computes the
# forward pass while the host records the backward pass, the backward pass while the host records the update, and
# the update while the host records the next forward pass; the next read waits only for what it reads. A step is
# then three programs, each with one structure from the first step on (the first update has its own: it creates
# the optimizer's state). Run at the backward pass's end only, the forward and backward passes were one program
# that started after the host had recorded both: on the issue-12 Llama step (HF, tiny), 19 ms of recording before
# a 28 ms program; started at the backward pass's start, the step took 10-19% less (phases timed in one process).
# None is a synchronization (the host does not wait): metrics count them as "backward_start", "backward_end" and
# "optimizer_step" flushes. Graphs being captured (torch.tpu.graph) are left alone.
_task_id = torch._C._current_graph_task_id  # the autograd graph task this thread runs a node of, or -1
_ending: set[int] = set()  # graph tasks whose end is queued


def _task_started(task: int) -> None:
    """Before the first op a backward pass (autograd graph task `task`) records: the graphs of the thread it records
    for run now (dispatched, not waited for), so the device computes the forward pass while the host records the
    backward pass, and their run is queued for the pass's end. (Called again for a task already started: nothing.)"""
    if task in _ending:
        return
    if len(_ending) > 1024:  # tasks that raised never ran their callback
        _ending.clear()
    _ending.add(task)
    owner = _C._graph_owner()
    torch.autograd.Variable._execution_engine.queue_callback(functools.partial(_backward_ended, task, owner))
    _run_graphs_of(owner, "backward_start")


def _backward_ended(task: int, owner: int) -> None:
    _ending.discard(task)
    _run_graphs_of(owner, "backward_end")


# ---- DEFER_NEVER runs each optimizer step as one program ----
# Op by op, an optimizer step is a program launch per multi-tensor op: AdamW over an MLP's 6 parameters made 17
# launches and 1.2 ms of host work per step, more than the forward pass. So in a thread running DEFER_NEVER, a
# step of an optimizer with tpu parameters is recorded as DEFER_AND_FUSE records (`optimizer_step_starts`, a
# global pre-hook) and dispatched as one program when it ends (`optimizer_step_ended`), without waiting; the thread
# is then back in DEFER_NEVER. The values are DEFER_AND_FUSE's, which the whole test suite checks against CPU; an
# error in the step's own arithmetic is raised as the step records it or as it ends, inside `opt.step()` still.
# Not for DEFER_NEVER_AND_LAUNCH_BLOCKING (debugging op by op), for `fused=True` optimizers (one program already),
# for a step given a closure (LBFGS: a forward and backward pass and value reads inside the step, each read a new
# graph to compile), under torch.compile, nor with TORCH_TPU_FUSE_OPTIMIZER_STEPS=0. A step that raises never
# reaches its post-hook: the thread returns to its mode at its next flush, its next optimizer step or its next mode
# query (`_end_abandoned_step`), whichever comes first; what it recorded meanwhile runs then, with the same values.
_step = threading.local()  # .scope: (optimizer, the frame of its step's hook wrapper, the thread's own mode)


def _on_tpu(optimizer: Any) -> bool:
    for group in optimizer.param_groups:
        params = group["params"]
        if params and params[0].device.type == "tpu":
            return True
    return False


def optimizer_step_starts(optimizer: Any, args: Any, kwargs: Any) -> None:
    """A global optimizer step pre-hook (watch_optimizer_steps)."""
    if getattr(_step, "scope", None) is not None:
        _end_abandoned_step()
    if (_C._mode() != EagerMode.DEFER_NEVER or torch.compiler.is_compiling()
            or optimizer.defaults.get("fused") or any(a is not None for a in args[1:])
            or any(v is not None for v in kwargs.values()) or not _on_tpu(optimizer)
            or not _config.get("TORCH_TPU_FUSE_OPTIMIZER_STEPS")):
        return
    own = _C._thread_mode()
    _C._set_thread_mode(int(EagerMode.DEFER_AND_FUSE))  # (from DEFER_NEVER: nothing pending to run)
    _step.scope = (optimizer, sys._getframe(1), own)


def optimizer_step_ended(optimizer: Any, args: Any, kwargs: Any) -> None:
    """A global optimizer step post-hook (watch_optimizer_steps)."""
    if torch.compiler.is_compiling():
        return
    scope = getattr(_step, "scope", None)
    if scope is not None and scope[0] is optimizer and scope[1] is sys._getframe(1):
        _step.scope = None
        _run_graphs_of(_C._graph_owner(), "optimizer_step")
        restore_thread_mode(scope[2])  # (anything recorded since, by another hook, runs here)
    elif recording():
        _run_graphs_of(_C._graph_owner(), "optimizer_step")


def mode_now() -> int:
    """The calling thread's effective mode, for torch.tpu.eager_mode (after _end_abandoned_step)."""
    if getattr(_step, "scope", None) is not None:
        _end_abandoned_step()
    return _C._mode()


def _end_abandoned_step() -> None:
    """Returns the calling thread to its own mode if the optimizer step that fused its ops raised (its frame
    has left the stack without the post-hook running)."""
    scope = getattr(_step, "scope", None)
    if scope is None:
        return
    f = sys._getframe(1)
    while f is not None:
        if f is scope[1]:
            return  # the step is still running
        f = f.f_back
    _step.scope = None
    restore_thread_mode(scope[2])


_optimizer_hooks: Any = None


def watch_optimizer_steps() -> None:
    """Installs the optimizer step hooks above (wired in torch_tpu/__init__.py when the runtime starts)."""
    global _optimizer_hooks
    if _optimizer_hooks is None:
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        _optimizer_hooks = (register_optimizer_step_pre_hook(optimizer_step_starts),
                            register_optimizer_step_post_hook(optimizer_step_ended))


def _run_graphs_of(owner: int, reason: str, captured: bool = False) -> None:
    """Runs the pending graphs of thread `owner` (with `captured`, also a capture's graph, whose flush raises)."""
    if not _graphs and not _ended:  # nothing pending anywhere (sync-heavy code running its ops directly)
        return
    with _lock:
        if _ended:
            _drop_ended()
        graphs = [g for (o, _), g in _graphs.items() if o == owner and (captured or g.capture is None)]
    for g in graphs:
        flush(g, reason)


def _record(index: int, fkey: Any, fn: Callable[..., Any], args: tuple | list) -> tuple[Any, _Graph | None]:
    g = _graph(index)
    n_inputs = len(g.inputs)
    try:
        specs, sig = _arg_list(g, args, True)  # (per argument as _arg: an earlier result of this graph inline)
        node = len(g.nodes)
        if node == 0:
            _C._fuse_recorded()  # a segment that records: this thread stops running one-op segments directly
        tr = g.trace
        if tr is not None and node < len(tr.entries) and (e := tr.entries[node])[0] == fkey and e[1] == specs \
                and e[2] == sig:
            entry = e  # the op the trace predicted here: its node info, without hashing its key
        else:
            g.trace = None  # diverged (or longer than the trace): record normally from here on
            nkey = (fkey, specs, sig)
            info = _nodes.get(nkey)
            if info is None:
                info = _nodes[nkey] = _node_info(fkey, fn, specs, sig, g.inputs)
                _node_text[info[0]] = info[3]
            entry = (fkey, specs, sig, info)
            if node == 0:  # mispredicted at the start: the last trace that began with this op, if any
                cand = _first.get(nkey)
                if cand is not None and cand.entries:
                    g.trace = cand
    except BaseException:
        _truncate_inputs(g, n_inputs)
        raise
    node_id, metas, treedef, _ = entry[3]
    g.nodes.append((fn, specs, treedef))
    g.keys.append(node_id)
    g.entries.append(entry)
    pendings = g.pendings
    if treedef is None:
        result = Pending(g, node, 0, metas[0])
        pendings.append(weakref.ref(result))
    else:
        outs = [Pending(g, node, j, meta) for j, meta in enumerate(metas)]
        pendings.extend(map(weakref.ref, outs))
        result = treedef.unflatten(outs)
    return result, (g if node + 1 >= g.limit else None)


def _stable_text(key: Any) -> str | None:
    """A text form of a structural key that means the same in every process, or None (it holds something
    process-local: an object address or a Jitted without a key)."""
    text = repr(key)
    if " at 0x" in text or _LOCAL in text:
        return None
    return text


def _node_info(fkey: Any, fn: Callable[..., Any], specs: tuple, sig: tuple, inputs: list[Any]) -> tuple:
    """(node id, outputs' (shape, dtype, weak_type), treedef or None, stable text or None) of a call not seen
    before in this process. Output shapes come from jax.eval_shape, cached by (function, argument shapes) in
    memory and, when the key is stable, in the persistent cache (so warm starts trace nothing per op)."""
    akey = (fkey, sig)
    shaped = _avals.get(akey)
    stable = _stable_text((fkey, specs, sig))
    if shaped is None:
        from torch_tpu import compile_cache

        atext = _stable_text(akey) if stable is not None else None
        shaped = compile_cache.get_meta("shape", atext) if atext is not None else None
        if shaped is None:
            abstract = [_abstract(s, gs, inputs) for s, gs in zip(specs, sig)]
            with _checks.discarding():  # shapes only: index checks reported here belong to no program
                shaped = jax.tree_util.tree_flatten(jax.eval_shape(fn, *abstract))
            shaped = ([(tuple(a.shape), a.dtype, bool(getattr(a, "weak_type", False))) for a in shaped[0]],
                      shaped[1])
            if atext is not None:
                compile_cache.put_meta("shape", atext, shaped)
        _avals[akey] = shaped
    metas, treedef = shaped
    single = treedef.num_leaves == 1 and treedef == jax.tree_util.tree_structure(0)
    return len(_nodes), metas, None if single else treedef, stable


def _truncate_inputs(g: _Graph, n: int) -> None:
    """Drops inputs added by a call that failed before it was recorded."""
    for a in g.inputs[n:]:
        g.input_pos.pop(id(a), None)
    del g.inputs[n:]


_C._fuse_record_state(_lock, _graphs, _truncate_inputs, _Transfer, _recorded, _task_started)


def _replay(nodes: list[tuple[Callable[..., Any], tuple, Any]], outs: tuple[tuple[int, int], ...],
            layout: "_Layout") -> Callable:
    def value(spec: Any, inputs: tuple, env: list) -> Any:
        if spec is None:
            return None
        kind = spec[0]
        if kind == "i":
            return inputs[spec[1]]
        if kind == "n":
            return env[spec[1]][spec[2]]
        if kind == "l":
            return [value(s, inputs, env) for s in spec[1]]
        return spec[1]

    def fused(*args: Any) -> tuple[list[Any], dict[str, Any]]:
        inputs = layout.unpack(args)
        env: list[list[Any]] = []
        with _checks.collecting() as checks:  # the ops' index checks become outputs of the program
            for fn, specs, _ in nodes:
                env.append(jax.tree_util.tree_leaves(fn(*(value(s, inputs, env) for s in specs))))
        return [env[n][o] for n, o in outs], dict(checks)

    return fused


def flush(g: _Graph | None, reason: str) -> None:
    """Runs pending graph `g` as one program; every placeholder still alive gets its value. Any thread may call
    it: one runs the graph, the others wait for it. A KeyboardInterrupt or SystemExit (any BaseException that is
    not an Exception) while it traces, compiles or runs propagates as itself and leaves the graph pending, so a
    later read runs it again."""
    if g is None:
        return
    if getattr(_step, "scope", None) is not None:
        _end_abandoned_step()
    with g.run_lock:
        with _lock:
            if g.done or not g.nodes:
                return
            if g.capture is not None:
                raise g.capture.needs_value(reason)
            key = (g.owner, g.index)
            if _graphs.get(key) is g:
                del _graphs[key]  # recording from here on starts a new graph
            alive = [p for r in g.pendings if (p := r()) is not None and p.value is None]
            tr = g.trace
            replayed = tr is not None and len(tr.entries) == len(g.nodes)
            tr = _follow(key, tr if replayed else None, g)
            if reason == "size_limit":
                _cut_at(key, g, tr)
            elif key in _cut:
                del _cut[key]  # a synchronization: graphs are cut where values are needed again
                _cut_last.pop(key, None)
            if g.owner == _C._thread_id():
                _C._fuse_flushed(len(g.nodes), _DIRECT_AFTER)
        _metrics.flush(reason, len(g.nodes), len(alive), replayed)
        if not alive:
            g.done = True
            return  # nothing can read any result: nothing to run
        single = len(g.nodes) == 1
        if single:
            # One op (sync-heavy code: an op, then a read of its result): a program of all its outputs, keyed by
            # its node id (and what it may donate: an in-place op's old buffer), not by a fused graph key.
            outs = tuple((0, j) for j in range(len(g.entries[0][3][1])))
            donate = _donatable(g.inputs, alive)
            key = (g.keys[0], donate, _checks.enabled)
        else:
            outs = tuple((p.node, p.out) for p in alive)
            donate = _donatable(g.inputs, alive)
            key = (tr.id, outs, donate, _checks.enabled)  # the trace's id stands for its node ids
        results = checks = None
        try:
            with _lock:
                found = _fused.get(key)
                if found is not None:
                    _fused.move_to_end(key)
            if found is None:
                order = None if single or not donate else _alias_order(g, alive, donate)
                fn = _fused_program(g, outs if order is None else tuple(outs[i] for i in order), donate)
                found = (fn, order)
                with _lock:
                    _fused[key] = found
                    if len(_fused) > _FUSED_CAP:
                        _fused.popitem(last=False)
            fn, order = found
            if order is not None:
                alive = [alive[i] for i in order]  # the program's outputs come in this order
            if single:
                out = fn(*g.inputs)
                results, checks = [out[0][p.out] for p in alive], out[1]
            else:
                results, checks = fn(g.inputs)
        except Exception as e:
            g.done = True
            names = sorted({_op_name(fn) for fn, _, _ in g.nodes})[:12]
            oom = _memory.oom_error(e, g.index, f"a deferred graph of {len(g.nodes)} ops ({', '.join(names)})")
            for p in alive:
                p.error = oom or e
            if oom is not None:
                raise oom from e
            raise DeferredError(
                f"torch_tpu: running the deferred graph of {len(g.nodes)} ops on tpu:{g.index} failed "
                f"(ops include {', '.join(names)}): {type(e).__name__}: {e}. Rerun with "
                "TORCH_TPU_EAGER_MODE=DEFER_NEVER_AND_LAUNCH_BLOCKING to find the op."
            ) from e
        except BaseException as e:  # KeyboardInterrupt, SystemExit: re-raised as themselves
            if results is not None:
                _resolve(g, alive, results)
                _checks.register(checks, quiet=True)  # raised at the next synchronization point, not over `e`
            elif any(g.inputs[i].is_deleted() for i in donate):  # the program ran: its inputs are gone
                g.done = True
                lost = RuntimeError(f"the run was interrupted ({type(e).__name__}) after it consumed its inputs")
                for p in alive:
                    p.error = lost
            raise
        _resolve(g, alive, results)
    _checks.register(checks)


def _follow(slot: tuple[int, int], tr: _Trace | None, g: _Graph) -> _Trace:
    """Under _lock, as graph `g` of `slot` flushes: its trace (`tr` when it replayed one, else found by its node ids
    or made), linked after the slot's previous trace; the slot's next graph is predicted to follow what followed
    this trace last time (a step that flushes twice alternates between two traces), else this trace again."""
    if tr is None:
        keys = tuple(g.keys)
        tr = _traces.get(keys)
        if tr is None:
            tr = _traces[keys] = _Trace(keys, g.entries)
            if len(_traces) > 2 * _FUSED_CAP:
                old = _traces.pop(next(iter(_traces)))
                if _first.get(old.entries[0][:3]) is old:
                    del _first[old.entries[0][:3]]
                old.entries, old.next = [], None  # inert: nothing can match it, it holds nothing
        _first[tr.entries[0][:3]] = tr  # (a replayed trace is there already unless another one flushed since)
    last = _last_trace.get(slot)
    if last is not None and last.entries:  # (last is tr: the step repeats itself)
        last.next = tr
    _last_trace[slot] = tr
    nxt = tr.next
    _predicted[slot] = nxt if nxt is not None and nxt.entries else tr
    return tr


def _cut_at(slot: tuple[int, int], g: _Graph, tr: _Trace) -> None:
    """Under _lock, as graph `g` of `slot` (structure `tr`) runs because it reached its size: where the slot's
    next graphs are cut (`_cut`). At the size limit: from the period of the structure its ops repeat at its end,
    if they repeat at least twice. At the cut: kept while each graph there has the structure of the one before (the
    first there is new); one that does not gives the cut up until the next synchronization."""
    c = _cut.get(slot)
    if c is None:
        p = _period(g.entries)
        if p:
            _cut[slot] = min(_MAX_OPS, p * -(-_CUT_MIN // p))
            _cut_last[slot] = None
    elif c:
        last = _cut_last.get(slot)
        if last is None or last is tr:
            _cut_last[slot] = tr
        else:
            _cut[slot] = 0


def _period(entries: list[tuple]) -> int:
    """The number of ops `p` of the structure that the end of a recorded graph repeats (at least twice in a row,
    over the longest such stretch), or 0. Ops compare by function, static arguments and argument shapes and
    dtypes (their signature), not by where their arguments come from: a value the previous graph computed is an
    input here and an earlier op's result in the next period, so a graph cut after whole periods still shows its
    period. It only chooses where graphs are cut: what runs is keyed by the full structure as always. The smallest
    period of each suffix comes from the prefix function of the reversed sequence (Knuth-Morris-Pratt), in one
    pass."""
    table: dict[tuple, int] = {}
    seq = [table.setdefault((e[0], e[2]), len(table)) for e in entries]
    seq.reverse()
    pi = [0] * len(seq)
    k = best = 0
    for i in range(1, len(seq)):
        c = seq[i]
        while k and c != seq[k]:
            k = pi[k - 1]
        if c == seq[k]:
            k += 1
        pi[i] = k
        if 2 * (i + 1 - k) <= i + 1:  # the last i+1 ops repeat their smallest period at least twice
            best = i + 1 - k
    return best


def _resolve(g: _Graph, alive: list[Pending], results: list[Any]) -> None:
    # In C calls only (map and setattr check no signals): a KeyboardInterrupt cannot land half way.
    g.done = True
    collections.deque(map(setattr, alive, itertools.repeat("value"), results), maxlen=0)
    collections.deque(map(setattr, alive, itertools.repeat("graph"), itertools.repeat(None, len(alive))), maxlen=0)


_ARRAY_TYPE: list[type] = []


def _donatable(inputs: list[Any], alive: list[Pending]) -> tuple[int, ...]:
    """Inputs whose buffers the fused program may reuse for its outputs: device arrays that nothing but this
    graph references any more (an in-place op swapped their storage to a placeholder, as after `p.add_(g)`),
    each matched to an output of the same shape and dtype (XLA cannot reuse the others)."""
    if not _ARRAY_TYPE:
        from jax._src.array import ArrayImpl

        _ARRAY_TYPE.append(ArrayImpl)
    array_type = _ARRAY_TYPE[0]
    wanted: dict[tuple, int] = {}
    for p in alive:
        k = (p.shape, p.dtype)
        wanted[k] = wanted.get(k, 0) + 1
    donate = []
    getrefcount = sys.getrefcount
    for i in range(len(inputs)):
        # References: the inputs list and getrefcount's argument. Anything else (a storage, a tensor being
        # read, a numpy view) keeps the buffer.
        if type(inputs[i]) is array_type and getrefcount(inputs[i]) <= 2:
            a = inputs[i]
            k = (a.shape, a.dtype)
            del a
            if wanted.get(k, 0) > 0:
                wanted[k] -= 1
                donate.append(i)
    return tuple(donate)


def _source(g: _Graph, node: int, out: int) -> int | None:
    """The input an output of the graph updates in place, as far as the graph shows it: followed back through
    each op's first argument (an in-place op's target; in a foreach op's first list, the element of the output's
    position), to an input of the graph. None where that leads elsewhere (a constant, a scalar, no argument)."""
    for _ in range(256):  # (a chain longer than this: no answer, only a missed pairing)
        fn, specs, treedef = g.nodes[node]
        if not specs:
            return None
        s = specs[0]
        n_out = 1 if treedef is None else treedef.num_leaves
        while s is not None and s[0] == "l":  # a list: down its first elements to the innermost list
            inner = s[1]
            if not inner:
                return None
            if inner[0] is not None and inner[0][0] == "l":
                s = inner[0]
            else:
                s = inner[out] if n_out > 1 and len(inner) == n_out else inner[0]
                break
        if s is None:
            return None
        if s[0] == "i":
            return s[1]
        if s[0] != "n":
            return None
        node, out = s[1], s[2]
    return None


def _alias_order(g: _Graph, alive: list[Pending], donate: tuple[int, ...]) -> list[int] | None:
    """The order to give a fused program's outputs (indices into `alive`) so that each donated input's buffer
    holds the value that replaces it, or None to keep theirs. JAX pairs donated inputs with outputs by shape and
    dtype, first come first served; when an optimizer's graph lists its new moments before its new parameters,
    a parameter's buffer is paired with a moment, and XLA:CPU copies the old values before it overwrites them (the
    issue-12 MLP's AdamW step alone ran 1.85x slower; its whole training step had 24 copies instead of 4)."""
    claims: dict[int, int] = {}  # input position -> index in alive
    for idx, p in enumerate(alive):
        k = _source(g, p.node, p.out)
        if k is not None and k not in claims:
            a = g.inputs[k]
            if type(a) not in _SCALARS and tuple(a.shape) == p.shape and a.dtype == p.dtype:
                claims[k] = idx
    if not claims:
        return None
    taken = set(claims.values())
    spare: dict[tuple, list[int]] = {}  # outputs that update no donated input, by (shape, dtype)
    for idx, p in enumerate(alive):
        if idx not in taken:
            spare.setdefault((p.shape, p.dtype), []).append(idx)
    order = []
    for k in donate:  # ascending: the order JAX pairs donated inputs of one shape and dtype in
        idx = claims.get(k)
        if idx is None:  # donated but updated by no output: pair it with any output of its shape and dtype
            a = g.inputs[k]
            left = spare.get((tuple(a.shape), a.dtype))
            if not left:
                continue
            idx = left.pop(0)
        order.append(idx)
    placed = set(order)
    order.extend(i for i in range(len(alive)) if i not in placed)
    return None if order == list(range(len(alive))) else order


def _fused_program(g: _Graph, outs: tuple, donate: tuple[int, ...]) -> Callable[..., Any]:
    """The compiled program of graph `g`: loaded from the persistent cache (torch_tpu.compile_cache) when every
    op's key is stable and an earlier process compiled the same graph (no tracing, lowering or compiling), else
    traced and compiled (and then stored there)."""
    from torch_tpu import compile_cache

    device = _runtime.device(g.index)
    single = len(g.nodes) == 1
    layout = _Layout(g.inputs, single)
    if single:
        # A one-op graph (sync-heavy code: an op, then a read) runs like the eager op: through jax.jit's own
        # dispatch, which calls faster than a loaded executable, and not written to the disk store.
        replay = _replay(list(g.nodes), outs, layout)
        replay.__name__ = _fused_name(g)
        _metrics.fused_compile()
        return jax.jit(replay, out_shardings=jax.sharding.SingleDeviceSharding(device), donate_argnums=donate)
    args = layout.pack(g.inputs)
    donate = layout.positions(donate)
    texts = [_node_text.get(k) for k in g.keys]
    structure = None
    if all(t is not None for t in texts):
        structure = repr((texts, outs, donate, _checks.enabled))
        loaded = compile_cache.load_program(structure, device, args)
        if loaded is not None:
            return layout.bind(loaded)
    replay = _replay(list(g.nodes), outs, layout)
    replay.__name__ = _fused_name(g)
    jitted = jax.jit(replay, out_shardings=jax.sharding.SingleDeviceSharding(device), donate_argnums=donate)
    _metrics.fused_compile()
    if structure is None:
        return layout.bind(jitted)
    return layout.bind(compile_cache.compile_program(structure, device, jitted, args))


class _Layout:
    """How a fused program takes a graph's inputs: its device arrays one argument each, and its Python scalars
    (the step's learning rate, bias corrections, `x + 1`'s 1: an AdamW step over P parameters gives several per
    parameter) packed into one host array per scalar type. Each scalar argument of an executable is a transfer of
    its own at every call: a small GPT's step of 270 ops with 272 scalars spent 8.6 ms of its 11.6 ms in the call,
    against 5.6 ms for the whole step as one jax.jit. Inside the program each scalar is the value jax.jit makes of
    a Python scalar (the same dtype and weak type), so promotion and results are unchanged; which inputs are
    scalars, of which type, is part of the graph's structure (their values are not), so one layout serves every
    call of a program. A one-op graph keeps jax.jit's own argument handling (`single`)."""

    __slots__ = ("n", "arrays", "groups", "_arrays_of")

    def __init__(self, inputs: list[Any], single: bool) -> None:
        self.n = len(inputs)
        by_type: dict[type, list[int]] = {}
        arrays = []
        for i, a in enumerate(inputs):
            t = type(a)
            if t in _SCALARS and not single:
                by_type.setdefault(t, []).append(i)
            else:
                arrays.append(i)
        self.arrays = tuple(arrays)
        # (positions, host dtype, the traced scalar's dtype and weak type) per scalar type
        avals = {t: jax.typeof(inputs[pos[0]]) for t, pos in by_type.items()}  # what jax.jit makes of one
        self.groups = tuple((tuple(pos), _HOST_DTYPES[t], avals[t].dtype, avals[t].weak_type)
                            for t, pos in by_type.items())
        self._arrays_of = _getter(self.arrays)

    def positions(self, donate: tuple[int, ...]) -> tuple[int, ...]:
        """The argument positions of inputs `donate` (device arrays)."""
        where = {i: k for k, i in enumerate(self.arrays)}
        return tuple(where[i] for i in donate)

    def pack(self, inputs: list[Any]) -> list[Any]:
        import numpy as np

        args = list(self._arrays_of(inputs))
        for pos, host, _, _ in self.groups:
            args.append(np.array([inputs[i] for i in pos], host))
        return args

    def unpack(self, args: tuple) -> list[Any]:
        """Inside the traced program: the graph's inputs in their positions, from the arguments."""
        if not self.groups:
            return list(args)
        from jax._src.lax import lax as lax_internal

        inputs: list[Any] = [None] * self.n
        for k, i in enumerate(self.arrays):
            inputs[i] = args[k]
        for j, (pos, _, dtype, weak) in enumerate(self.groups):
            packed = args[len(self.arrays) + j]
            for k, i in enumerate(pos):
                inputs[i] = lax_internal._convert_element_type(packed[k], dtype, weak_type=weak)
        return inputs

    def bind(self, program: Callable[..., Any]) -> Callable[[list[Any]], Any]:
        """`program` called with a graph's inputs list."""
        if not self.groups:
            return lambda inputs: program(*inputs)
        pack = self.pack
        return lambda inputs: program(*pack(inputs))


def _getter(positions: tuple[int, ...]) -> Callable[[list[Any]], tuple]:
    if len(positions) == 1:
        only = positions[0]
        return lambda xs: (xs[only],)
    if not positions:
        return lambda xs: ()
    return operator.itemgetter(*positions)


def _fused_name(g: _Graph) -> str:
    """The fused program's name (jax.jit names it `jit_<name>`): its op count and its first distinct aten ops in
    graph order, e.g. `torch_tpu_fused_7_ops_mm_add_Tensor_relu` (at most 4 named), so a device
    trace maps back to the code. Made at the compile, the same in every process (JAX's cache key starts with it)."""
    return graph_program_name(f"torch_tpu_fused_{len(g.nodes)}_ops_", (_op_name(fn) for fn, _, _ in g.nodes))


def drop_programs() -> None:
    """Drops every compiled fused program held here (the program collector's hook, torch_tpu/_programs.py)."""
    with _lock:
        _fused.clear()


def _op_name(fn: Any) -> str:
    return getattr(fn, "_torch_tpu_op", None) or getattr(fn, "__qualname__", "op")


def flush_thread(reason: str) -> None:
    """Runs the pending graphs the calling thread records into (its own, or in a backward pass its caller's).
    Other threads' graphs are theirs to run, like ops they have not issued yet: running them from here would
    cut their graphs at arbitrary points, so each flush would have a new structure to compile."""
    _segment_end(None, reason)  # the segment of an op that ran directly, if any (metrics count it as a flush)
    _run_graphs_of(_C._graph_owner(), reason, captured=True)


def thread_graph(index: int) -> _Graph | None:
    """The pending graph (recorded, not run yet) the calling thread records into on tpu:`index`, if any: what an
    event recorded now marks without running it (torch_tpu/_streams.py)."""
    if not _graphs:
        return None
    with _lock:
        g = _graphs.get((_C._graph_owner(), index))
        return g if g is not None and g.nodes and not g.done else None


def graph_values(g: _Graph) -> list[Any]:
    """The device arrays a graph that ran gave its placeholders still alive."""
    return [p.value for r in g.pendings if (p := r()) is not None and p.value is not None]
