"""Graph capture and replay on tpu: `torch.tpu.TPUGraph`, `torch.tpu.graph` and `torch.accelerator.Graph`.

CUDA graphs' contract, on the fused executor (torch_tpu/_deferred.py). A capture records the tpu work the capturing
thread issues (and the autograd threads working for it) into one pending graph and does not run it; `capture_end`
compiles that graph into one XLA program; `replay()` runs the program, with no Python per op: one call that reads
its inputs from the storages the captured ops read and writes its results into the storages they wrote.

- Static memory: CUDA kernels in a graph read and write fixed addresses. Here a storage holds an immutable array,
  so the capture binds storages instead: when it begins, every live tpu storage's array is swapped for a `Bound`
  placeholder (the array plus its storage); a captured op that reads the storage records an input bound to it,
  so each replay reads that storage's array of the moment (new data `copy_`'d into a static input, the parameters
  the previous replay updated). A storage that holds a result of the captured graph when it ends (the static
  outputs, parameters, gradients and optimizer state updated in place) is written by each replay.
- The capture does not run anything: when it ends, every bound storage holds its array from before it again
  (a captured `optimizer.step()` has not updated the parameters yet), and new tensors made inside it hold
  zeros until the first replay (CUDA's are uninitialized).
- Host values are constants of the program, as CUDA kernels' arguments are: Python numbers, and values computed on
  the host from tensors (an optimizer's step count on the host: Adam, AdamW and the others with a `capturable`
  option must be made with `capturable=True`; a capture checks). Random ops draw new numbers at each replay (the
  generator advances per replay, in capture order, as CUDA's Philox offsets do).
- What needs a value inside the capture raises and names the way out: `.item()`, `.cpu()`, printing, a
  synchronization, a data-dependent op or a kernel that runs eagerly, a copy from the host to tpu (as CUDA's
  capture rejects synchronizing calls). Memory pools do not exist here (XLA owns device memory): `pool()` is a
  token that `capture_begin(pool=...)` accepts and ignores.
- Each replay donates the arrays of state it overwrites (parameters, optimizer state) when nothing else holds
  them, so the step updates them in place as CUDA's does; otherwise it runs a copy of the program that keeps them.

Storages are found with the garbage collector (every tpu tensor Python can reach, and its `.grad`). A storage held
only in C++ when the capture begins (no Python tensor reaches it) is not bound: an op that reads it inside the
capture reads the array it held then, as a constant.
"""

from __future__ import annotations

import gc
import itertools
import sys
from typing import Any

import numpy as np
import torch

from torch_tpu import _C, _checks, _deferred, _memory, _rng, _runtime
from torch_tpu._deferred import Bound, EagerMode, Pending
from torch_tpu._jax import jax

_pool_ids = itertools.count(1)
_MODES = ("default", "global", "thread_local", "relaxed")


def _tpu_storages(index: int) -> dict[int, torch.UntypedStorage]:
    """Every tpu:`index` storage a Python tensor (or its `.grad`) reaches, by StorageImpl address."""
    found: dict[int, torch.UntypedStorage] = {}
    tensor = torch.Tensor
    for o in gc.get_objects():
        if not issubclass(type(o), tensor):  # (type(): isinstance would read lazy objects' __class__)
            continue
        try:
            grad = o.grad if o.is_leaf and o.requires_grad else None
        except Exception:  # noqa: BLE001  (tensor subclasses whose attributes raise)
            grad = None
        for t in (o, grad):
            if t is None:
                continue
            try:
                st = t.untyped_storage()
            except Exception:  # noqa: BLE001  (wrapper subclasses without a storage of their own)
                continue
            # (a storage that says tpu without a torch_tpu buffer, a functionalization wrapper's left alive by a
            # compile, holds no array to bind: the tensor it wraps is found on its own)
            if st.device.type == "tpu" and st.device.index == index and _C._is_tpu_buffer(st):
                found.setdefault(st._cdata, st)
    return found


def _array_of(st: torch.UntypedStorage) -> Any:
    """The storage's array (a placeholder of a pending graph computed first), or None when it holds none."""
    a = _C._storage_array(st)[0]
    if type(a) is Pending:
        a = a.concrete("graph_replay")
    return a


class _Capture:
    """One capture in progress: its graph, the storages it bound and the generator steps it drew."""

    def __init__(self, index: int, owner: int, mode: str = "global") -> None:
        self.index = index
        self.owner = owner
        self.mode = mode
        self.graph: Any = None
        self.bound: dict[int, Bound] = {}
        self.draws: list[tuple[Any, Any]] = []
        self.error: BaseException | None = None
        self.hook: Any = None
        self.own_mode = -1  # the thread's own mode before the capture (restored when it ends)

    def needs_value(self, reason: str) -> RuntimeError:
        """The error of anything that needs a value (runs work) while this capture records (`_deferred.flush`).
        On the capturing thread it fails the capture; on another thread (a result of the capture has no value
        yet) it fails the capture only in capture_error_mode "global" (the default), as CUDA's does."""
        if _C._graph_owner() != self.owner:
            e = RuntimeError(
                f"torch_tpu: another thread needed the value of a tensor ({reason}) that a tpu graph capture is "
                "recording on its own thread: it has no value until that graph's replay(). Read it after the "
                "capture ends and the graph replays."
            )
            if self.error is None and self.mode in ("global", "default"):
                self.error = e
            return e
        e = RuntimeError(
            f"torch_tpu: a value was needed while a tpu graph was being captured ({reason}): a capture records "
            "work and runs none of it until replay(). Reading a tensor (.item(), .cpu(), printing, a Python "
            "branch on it), torch.tpu.synchronize(), ops with data-dependent shapes and kernels that run eagerly "
            "cannot be captured; move them out of the captured region (CUDA graphs forbid the same "
            "synchronizations), or set TORCH_TPU_EAGER_MODE=DEFER_NEVER_AND_LAUNCH_BLOCKING outside capture to "
            "find the op."
        )
        if self.error is None:
            self.error = e
        return e

    def check_optimizer(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Optimizer step pre-hook while capturing: PyTorch's own graph-capture check runs for CUDA and XPU only."""
        if _C._graph_owner() != self.owner:
            return
        groups = opt.param_groups
        if any("capturable" in g and not g["capturable"] for g in groups) and any(
                p.device.type == "tpu" for g in groups for p in g["params"]):
            raise RuntimeError(
                f"Attempting TPU graph capture of step() for an instance of {type(opt).__name__} but "
                "param_groups' capturable is False: its step count lives on the host, so every replay would "
                "repeat this step's bias corrections. Construct it with capturable=True (as for CUDA graphs)."
            )


class TPUGraph:
    """A captured sequence of tpu work that `replay()` runs again as one program (`torch.cuda.CUDAGraph` for tpu).

    Use it as CUDA graphs are used: warm up, capture with `with torch.tpu.graph(g):` (or `torch.accelerator.Graph`),
    then fill the static inputs with `copy_` and call `g.replay()`; the static outputs hold each replay's results."""

    def __init__(self, keep_graph: bool = False) -> None:
        self.keep_graph = keep_graph
        self._cap: _Capture | None = None
        self._pool = (0, next(_pool_ids))
        self._debug = False
        self._failed: BaseException | None = None
        self._reset_program()

    def _reset_program(self) -> None:
        self._programs: dict[tuple, Any] = {}  # donated input positions -> compiled program
        self._graph: Any = None  # the captured graph (nodes, inputs with their bindings)
        self._template: list[Any] = []
        self._reads: list[tuple[int, torch.UntypedStorage, tuple]] = []
        self._writes: list[tuple[torch.UntypedStorage, int, torch.dtype]] = []
        self._draws: list[tuple[Any, int | None, int | None]] = []
        self._outs: tuple = ()
        self._single = False
        self._donate: tuple[int, ...] = ()
        self._captured = False

    # -- capture --
    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
        if capture_error_mode not in _MODES:
            raise ValueError(f"TPUGraph.capture_begin: capture_error_mode must be one of {_MODES}, not "
                             f"{capture_error_mode!r}")
        if self._cap is not None:
            raise RuntimeError("TPUGraph.capture_begin: this graph is capturing already")
        if self._captured:
            raise RuntimeError("TPUGraph.capture_begin: this graph holds a capture; call reset() before capturing "
                               "again")
        owner = _C._graph_owner()
        if _rng.capturing():
            raise RuntimeError("TPUGraph.capture_begin: this thread is capturing another tpu graph already")
        index = _C._current_device()
        _deferred.flush_thread("graph_capture")  # work issued before the capture runs now, outside it
        cap = _Capture(index, owner, capture_error_mode)
        own = _deferred.set_thread_mode(EagerMode.DEFER_AND_FUSE)
        try:
            _deferred.reset_direct()  # every op is recorded (no one-op segment runs directly)
            with _deferred._lock:
                g = _deferred._graph(index)
                g.limit = sys.maxsize
                g.trace = None
                g.capture = cap
            cap.graph = g
            for cdata, st in _tpu_storages(index).items():
                a = _array_of(st)
                if a is None or type(a) is Bound:
                    continue
                b = Bound(st, a, g)
                _C._set_array(st, b, _runtime.torch_dtype(a.dtype))
                cap.bound[cdata] = b
            _rng._capturing[owner] = cap.draws
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            cap.hook = register_optimizer_step_pre_hook(cap.check_optimizer)
        except BaseException:
            self._undo(cap, own)
            raise
        cap.own_mode = own
        self._cap = cap

    def _undo(self, cap: _Capture, own: int, outputs: list | None = None) -> None:
        """Ends capture `cap`: its graph leaves the thread, bound storages get their arrays back, new storages
        written inside it get zeros, its other results raise when read, and the thread's mode is restored."""
        try:
            if cap.hook is not None:
                cap.hook.remove()
            _rng._capturing.pop(cap.owner, None)
            g = cap.graph
            if g is not None:
                with _deferred._lock:
                    key = (g.owner, g.index)
                    if _deferred._graphs.get(key) is g:
                        del _deferred._graphs[key]
                    g.done = True
                bound = set(cap.bound)
                for b in cap.bound.values():
                    _C._set_array(b.storage, b.array, _runtime.torch_dtype(b.dtype))
                cap.bound.clear()  # (a Bound holds its array: replays could not donate it)
                g.capture = None
                for st, p in outputs or ():
                    if st._cdata not in bound:
                        _C._set_array(st, jax.device_put(np.zeros(p.shape, p.dtype), _runtime.device(g.index)),
                                      _runtime.torch_dtype(p.dtype))
                lost = RuntimeError(
                    "this tensor was made inside a tpu graph capture and is not one of the graph's outputs "
                    "that replay() writes (no Python tensor held it when the capture ended)")
                for r in g.pendings:
                    p = r()
                    if p is not None and p.value is None and p.error is None:
                        p.error = lost
        finally:
            _deferred.restore_thread_mode(own)

    def capture_end(self) -> None:
        cap = self._cap
        if cap is None:
            raise RuntimeError("TPUGraph.capture_end: this graph is not capturing (call capture_begin first)")
        if _C._graph_owner() != cap.owner:
            raise RuntimeError("TPUGraph.capture_end: called from another thread than capture_begin")
        self._cap = None
        g = cap.graph
        outputs: list[tuple[torch.UntypedStorage, Pending]] = []
        try:
            for st in _tpu_storages(cap.index).values():
                a = _C._storage_array(st)[0]  # (still recording: a placeholder stays one)
                if type(a) is Pending and a.graph is g and a.value is None:
                    outputs.append((st, a))
            if cap.error is None and g.nodes:
                self._compile(cap, outputs)
        finally:
            self._undo(cap, cap.own_mode, outputs)
        self._captured = True
        if cap.error is not None:
            self._failed = cap.error

    def _compile(self, cap: _Capture, outputs: list[tuple[torch.UntypedStorage, Pending]]) -> None:
        g = cap.graph
        inputs = g.inputs
        pos = {id(a): i for i, a in enumerate(inputs)}
        self._single = len(g.nodes) == 1
        if self._single:  # (_deferred's one-op program: all of the op's outputs, called with the inputs unpacked)
            self._outs = tuple((0, j) for j in range(len(g.entries[0][3][1])))
            where = {o: o[1] for o in self._outs}
        self._reads = [(i, a.storage, (a.shape, a.dtype)) for i, a in enumerate(inputs) if type(a) is Bound]
        # Donated: the arrays of bound storages the program overwrites, matched to outputs of their shape and dtype
        # (XLA can reuse no others).
        written = {st._cdata: p for st, p in outputs}
        wanted: dict[tuple, int] = {}
        for st, p in outputs:
            if st._cdata in cap.bound:
                k = (p.shape, p.dtype)
                wanted[k] = wanted.get(k, 0) + 1
        donate = []
        for i, st, sig in self._reads:
            if st._cdata in written and wanted.get(sig, 0) > 0:
                wanted[sig] -= 1
                donate.append(i)
        self._donate = tuple(donate)
        if not self._single:
            # The outputs written into donated storages first, in the donated inputs' order, each of its storage's
            # shape and dtype: JAX pairs donated inputs with outputs of their shape and dtype in order, so each
            # storage's old buffer then takes its own new value (paired with another output, XLA:CPU copies the old
            # values before overwriting them: 27 copies in the issue-12 MLP's captured AdamW step instead of 4).
            distinct: dict[tuple, int] = {}
            for i in donate:
                p = written[inputs[i].storage._cdata]
                if (p.shape, p.dtype) == (inputs[i].shape, inputs[i].dtype):
                    distinct.setdefault((p.node, p.out), len(distinct))
            for _, p in outputs:
                distinct.setdefault((p.node, p.out), len(distinct))
            self._outs = tuple(distinct)
            where = distinct
        self._writes = [(st, where[(p.node, p.out)], _runtime.torch_dtype(p.dtype)) for st, p in outputs]
        self._draws = [(s.generator, pos.get(id(s)), pos.get(id(o))) for s, o in cap.draws]
        # What the program is compiled with: a Bound's array of the capture, a Drawn's draw of the capture.
        concrete = [a.array if type(a) is Bound else a.value if type(a) is _rng.Drawn else a for a in inputs]
        self._template = [None if type(a) is Bound else c for a, c in zip(inputs, concrete)]
        self._graph = g
        self._program(self._donate, concrete)

    def _program(self, donate: tuple[int, ...], inputs: list[Any]) -> Any:
        """The program donating inputs `donate`, compiled (or loaded from the persistent cache) for `inputs` on
        first use. The graph keeps no inputs between uses: the arrays of the capture would stay alive."""
        fn = self._programs.get(donate)
        if fn is None:
            g = self._graph
            g.inputs = inputs
            try:
                fn = self._programs[donate] = _deferred._fused_program(g, self._outs, donate)
            finally:
                g.inputs = []
                g.input_pos = {}
        return fn

    def instantiate(self) -> None:
        """Compiled when the capture ends already (nothing to do; kept for torch.accelerator.Graph's API)."""

    # -- replay --
    def replay(self) -> None:
        if self._cap is not None:
            raise RuntimeError("TPUGraph.replay: the graph is still capturing (call capture_end first)")
        failed = self._failed
        if failed is not None:
            raise RuntimeError(f"TPUGraph.replay: the capture failed, so there is nothing to replay: {failed}")
        if not self._captured:
            raise RuntimeError("TPUGraph.replay: nothing was captured; capture with `with torch.tpu.graph(g):` "
                               "(or capture_begin/capture_end) first")
        if self._graph is None:
            return  # an empty capture
        inputs = list(self._template)
        for i, st, sig in self._reads:
            a = _array_of(st)
            if a is not None and type(a) is not Bound and a.dtype == sig[1] and tuple(a.shape) != tuple(sig[0]) \
                    and np.prod(a.shape) == np.prod(sig[0]):
                # the same bytes in another shape: the storage was read or written whole through a view of another
                # shape since (torch_tpu/_storage.py keeps the array in that view's shape)
                a = a.reshape(sig[0])
            if a is None or type(a) is Bound or (a.shape, a.dtype) != sig:
                now = "no array" if a is None else "a capture in progress" if type(a) is Bound else \
                    f"shape {tuple(a.shape)} dtype {a.dtype}"
                raise RuntimeError(
                    f"TPUGraph.replay: a storage the captured graph reads held shape {tuple(sig[0])} dtype "
                    f"{sig[1]} at capture and holds {now} now. A graph reads its static tensors in place: copy_ "
                    "new values into them, do not resize or set_ them (or capture again after reset())."
                )
            inputs[i] = a
        a = None  # (the loop's last array: a reference that would keep it from being donated)
        for gen, si, oi in self._draws:
            seed, offset = _C._philox_step(gen, 1)
            if si is not None:
                inputs[si] = np.uint64(seed)
            if oi is not None:
                inputs[oi] = np.uint64(offset)
        donate = self._donate
        # References of a donated array: its storage, `inputs` and getrefcount's argument; any other (another
        # storage sharing it, a pending graph's inputs, a Python variable) keeps it: run the copy that keeps all.
        if donate and any(sys.getrefcount(inputs[i]) > 3 for i in donate):
            donate = ()
        fn = self._program(donate, inputs)
        try:
            if self._single:
                out, checks = fn(*inputs)
                results = [out[j] for _, j in self._outs]
            else:
                results, checks = fn(inputs)
        except RuntimeError as e:
            oom = _memory.oom_error(e, self._graph.index, f"a tpu graph replay of {len(self._graph.nodes)} ops")
            if oom is not None:
                raise oom from e
            raise
        del inputs
        for st, k, dtype in self._writes:
            _C._set_array(st, results[k], dtype)
        _checks.register(checks)

    # -- the rest of CUDAGraph's API --
    def reset(self) -> None:
        if self._cap is not None:
            raise RuntimeError("TPUGraph.reset: the graph is capturing (call capture_end first)")
        self._reset_program()
        self._failed = None

    def pool(self) -> tuple[int, int]:
        """A token for `capture_begin(pool=...)`: XLA owns device memory, so graphs have no pools to share."""
        return self._pool

    def enable_debug_mode(self) -> None:
        self._debug = True

    def debug_dump(self, path: str) -> None:
        """Writes the captured ops, in order, and what the program reads and writes (with enable_debug_mode)."""
        if not self._debug:
            raise RuntimeError("TPUGraph.debug_dump: call enable_debug_mode() before capturing")
        g = self._graph
        with open(path, "w") as f:
            if g is None:
                f.write("empty tpu graph\n")
                return
            f.write(f"tpu graph on tpu:{g.index}: {len(g.nodes)} ops, {len(self._reads)} bound inputs, "
                    f"{len(self._writes)} written storages, {len(self._draws)} generator steps\n")
            for n, (fn, specs, _) in enumerate(g.nodes):
                f.write(f"%{n} = {_deferred._op_name(fn)}{specs}\n")
            f.write(f"outputs: {self._outs}\n")

    def __repr__(self) -> str:
        state = "capturing" if self._cap is not None else "captured" if self._captured else "empty"
        n = len(self._graph.nodes) if self._graph is not None else 0
        return f"TPUGraph({state}, {n} ops)"


is_current_stream_capturing = _rng.capturing  # (`torch.cuda.is_current_stream_capturing`)


class graph:
    """`with torch.tpu.graph(g):` captures the tpu work of the block into `g` (`torch.cuda.graph`). Accepts a
    TPUGraph or a torch.accelerator.Graph; `pool` and `stream` are accepted for CUDA code and not needed here."""

    def __init__(self, tpu_graph: Any, pool: Any = None, stream: Any = None,
                 capture_error_mode: str = "global") -> None:
        self.tpu_graph = tpu_graph
        self.pool = pool
        self.capture_error_mode = capture_error_mode

    def __enter__(self) -> None:
        torch.tpu.synchronize()
        if isinstance(self.tpu_graph, TPUGraph):
            self.tpu_graph.capture_begin(self.pool, self.capture_error_mode)
        else:
            self.tpu_graph.capture_begin()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        g = self.tpu_graph
        if exc is not None and isinstance(g, TPUGraph) and g._cap is not None and g._cap.error is None:
            g._cap.error = exc  # the block did not finish: a partial step must not replay
        g.capture_end()
