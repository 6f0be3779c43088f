"""What the doctor records while a script runs.

The runtime's own metrics (torch_tpu/_metrics.py: compiles and their call sites and shapes, host
synchronisations, persistent-cache hits, fused-graph flushes; the C++ fallback counts; the memory statistics) are
read through `_metrics.observer`, the switch this module turns on for the run and off after it. The aten-level view
of the program (which ops ran on tpu tensors, with what shapes and dtypes, and which of them were transfers or
matmuls) comes from one `TorchDispatchMode` that is active only during the doctor's run: it sees every op below
autograd, outside `torch.compile` programs (which run as one XLA program each), and costs nothing when the doctor
is not running.

Steps are optimizer steps (`torch.optim.Optimizer` step post hooks); a script without an optimizer is one step.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import sys
import sysconfig
import threading
import time
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from torch.optim import optimizer as _optim

from torch_tpu import _metrics


class StopRun(BaseException):
    """Raised at a step boundary when the --steps/--seconds bound is reached (a BaseException, so a script's
    `except Exception` does not swallow it)."""


# Ops whose output shape depends on values: the host waits for the device to learn the shape.
DATA_DEPENDENT = {"nonzero", "masked_select", "_unique2", "unique_dim", "unique_consecutive", "_unique",
                  "repeat_interleave.Tensor", "bincount", "masked_scatter", "nonzero_numpy"}
SYNC_OPS = {"_local_scalar_dense": ".item() (aten::_local_scalar_dense)", "item": ".item()",
            "equal": "torch.equal (aten::equal)", "is_nonzero": "bool(tensor) (aten::is_nonzero)"}
METADATA = {"detach", "empty", "empty_strided", "lift_fresh", "_reshape_alias", "set_", "resize_", "as_strided",
            "_unsafe_view", "view", "t", "transpose", "expand", "permute", "alias", "_local_scalar_dense"}
MATMUL_OPS = {"mm", "addmm", "bmm", "baddbmm", "convolution", "_convolution", "convolution_overrideable",
              "addbmm", "linear", "matmul", "_grouped_mm"}


def _op_name(func: Any) -> str:
    name = func._schema.name.split("::", 1)[-1]
    ov = func._schema.overload_name
    return f"{name}.{ov}" if ov else name


def _base(name: str) -> str:
    return name.split(".", 1)[0]


class Sites:
    """Maps the Python stack to the user's line: the first frame outside torch, JAX, torch_tpu and the standard
    library; `script` is the file the doctor runs (its own frame is given too when the first user frame is in a
    library such as transformers)."""

    def __init__(self, script: str | None) -> None:
        self.script = os.path.abspath(script) if script else None
        skip = list(_metrics._skip_dirs())
        for key in ("stdlib", "platstdlib"):
            p = sysconfig.get_paths().get(key)
            if p:
                skip.append(os.path.abspath(p) + os.sep)
        skip.append(os.path.dirname(os.path.abspath(__file__)) + os.sep)
        self.skip = tuple(skip)
        self._user: dict[str, bool] = {}

    def is_user(self, filename: str) -> bool:
        u = self._user.get(filename)
        if u is None:
            u = self._user[filename] = not (filename.startswith("<") or os.path.abspath(filename).startswith(self.skip))
        return u

    def here(self, depth: int = 1) -> str | None:
        """'file:line' of the first user frame (plus ' (via script:line)' when that is not the script itself)."""
        f = sys._getframe(depth)
        first = None
        while f is not None:
            fn = f.f_code.co_filename
            if self.is_user(fn):
                if first is None:
                    first = f"{fn}:{f.f_lineno}"
                    if self.script is None or os.path.abspath(fn) == self.script:
                        return first
                elif os.path.abspath(fn) == self.script:
                    return f"{first} (via {fn}:{f.f_lineno})"
            f = f.f_back
        return first


@dataclasses.dataclass
class Step:
    index: int
    start: float
    seconds: float = 0.0
    compiles: int = 0
    compile_seconds: float = 0.0
    trace_seconds: float = 0.0
    cache_hits: int = 0
    syncs: int = 0
    ops: int = 0
    unfused_ops: int = 0
    tiny_unfused_ops: int = 0
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    peak_bytes: int = 0


class Recorder(TorchDispatchMode):
    """Active during the doctor's run: records op use through dispatch and the runtime's facts through
    `_metrics.observer`."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:  # torch.compile still compiles while the doctor watches
        return True

    def __init__(self, script: str | None, steps: int | None = None, seconds: float | None = None,
                 record_losses: int = 0) -> None:
        super().__init__()
        self.sites = Sites(script)
        self.max_steps, self.max_seconds = steps, seconds
        self.record_losses = record_losses
        self.losses: list[torch.Tensor] = []
        self.t0 = time.perf_counter()
        self.steps: list[Step] = []
        self.optimizer_steps = 0
        self.op_counts: collections.Counter[str] = collections.Counter()
        self.cpu_op_counts: collections.Counter[str] = collections.Counter()
        self.no_kernel: collections.Counter[tuple[str, str | None]] = collections.Counter()
        self.unfused: collections.Counter[str] = collections.Counter()
        self.syncs: collections.Counter[tuple[str, str | None]] = collections.Counter()
        self.sync_steps: dict[tuple[str, str | None], set[int]] = collections.defaultdict(set)
        self.transfers: collections.Counter[tuple[str, str | None]] = collections.Counter()  # bytes
        self.transfer_calls: collections.Counter[tuple[str, str | None]] = collections.Counter()
        self.matmuls: collections.Counter[tuple[str, tuple, str, str | None]] = collections.Counter()
        self.int64_ops: collections.Counter[tuple[str, str | None]] = collections.Counter()
        self.compiles: list[dict[str, Any]] = []
        self.largest: list[tuple[int, str, str, str | None]] = []  # (bytes, op, shape/dtype, site)
        self.exception: BaseException | None = None
        self._tls = threading.local()  # .stack: [op name, synced in this call] of the ops running on a thread
        self._kernel: dict[str, bool] = {}
        self._fusable: set[str] | None = None
        self._internal = 0
        self._thread = threading.get_ident()
        self._hook_handles: list[Any] = []
        self._ops_since_check = 0
        self._backward_site: str | None = None
        self.first_step_start: float | None = None
        self.before_first_step = 0.0

    # ---- life cycle ----
    def start(self) -> None:
        from torch_tpu import device_module

        self._metrics0 = device_module.metrics()
        self._hook_handles.append(_optim.register_optimizer_step_post_hook(self._after_step))
        self._hook_handles.append(_optim.register_optimizer_step_pre_hook(self._before_step))
        self._orig_backward = torch.Tensor.backward
        rec = self

        def backward(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            rec._backward_site = rec.sites.here()
            if len(rec.losses) < rec.record_losses and t.numel() == 1 and len(rec.losses) <= rec.optimizer_steps:
                rec._internal += 1
                try:
                    rec.losses.append(t.detach().clone())  # read at the end: no host sync during the run
                finally:
                    rec._internal -= 1
            return rec._orig_backward(t, *args, **kwargs)

        torch.Tensor.backward = backward  # type: ignore[method-assign]
        self._new_step()
        _metrics.observer = self
        self.__enter__()

    def stop(self) -> None:
        self.__exit__(None, None, None)
        _metrics.observer = None
        torch.Tensor.backward = self._orig_backward  # type: ignore[method-assign]
        for h in self._hook_handles:
            h.remove()
        self._end_step(final=True)
        from torch_tpu import device_module

        self.metrics_end = device_module.metrics()

    # ---- steps ----
    def _new_step(self) -> None:
        from torch_tpu import device_module

        if torch.tpu.is_initialized():
            device_module.reset_peak_memory_stats()
        self.steps.append(Step(index=len(self.steps), start=time.perf_counter()))

    def _sync_device(self) -> None:
        from torch_tpu import device_module

        if device_module.is_initialized():
            self._internal += 1
            try:
                device_module.synchronize()
            finally:
                self._internal -= 1

    def _end_step(self, final: bool = False) -> None:
        from torch_tpu import device_module

        s = self.steps[-1]
        if not final:
            self._sync_device()  # step times include the device's work
        s.seconds = time.perf_counter() - s.start
        if device_module.is_initialized():
            s.peak_bytes = int(device_module.max_memory_allocated())

    def _before_step(self, opt: Any, args: Any, kwargs: Any) -> None:
        if self.first_step_start is None:
            self.first_step_start = self.steps[0].start

    def _after_step(self, opt: Any, args: Any, kwargs: Any) -> None:
        if threading.get_ident() != self._thread:
            return
        if torch.tpu.is_current_stream_capturing():
            return  # a step recorded into a tpu graph runs nothing (and a wait for the device would end the capture)
        self.optimizer_steps += 1
        self._end_step()
        if self.max_steps is not None and self.optimizer_steps >= self.max_steps:
            raise StopRun(f"--steps {self.max_steps} reached")
        if self.max_seconds is not None and time.perf_counter() - self.t0 >= self.max_seconds:
            raise StopRun(f"--seconds {self.max_seconds:g} reached")
        self._new_step()

    # ---- the runtime's metrics (torch_tpu/_metrics.py observer) ----
    def on_sync(self, reason: str) -> None:
        if self._internal:
            return
        stack = self._stack()
        if stack:
            top = stack[-1]
            if top[1]:
                return  # one sync per op call (a fused flush and the read it serves)
            top[1] = True
            what = self._sync_what(top[0], reason)
        elif reason:
            what = f"DEFER_AND_FUSE flush ({reason})"
        else:
            what = self._caller_sync_name()
        self._record_sync(what, self._site())

    def _caller_sync_name(self) -> str:
        f = sys._getframe(3)
        while f is not None:
            if f.f_code.co_name == "synchronize":
                return "torch.tpu.synchronize()"
            f = f.f_back
        return "a host read"

    def _sync_what(self, op: str, reason: str) -> str:
        base = _base(op)
        if op in SYNC_OPS or base in SYNC_OPS:
            what = SYNC_OPS.get(op, SYNC_OPS.get(base))
        elif base in ("_to_copy", "copy_", "to", "_copy_from", "_copy_from_and_resize"):
            what = f".cpu() / .to('cpu') (aten::{op})"
        elif op in DATA_DEPENDENT or base in DATA_DEPENDENT:
            what = f"data-dependent shape (aten::{op})"
        elif not self._kernel.get(op, True):
            what = f"the CPU fallback of aten::{op} (copies to the host and back)"
        else:
            what = f"aten::{op}" + (f" (flush: {reason})" if reason else "")
        if self._printing():
            what = f"printing a tensor ({what})"
        return what

    @staticmethod
    def _printing() -> bool:
        f = sys._getframe(3)
        while f is not None:
            if f.f_code.co_filename.endswith(os.sep + "_tensor_str.py"):
                return True
            f = f.f_back
        return False

    def _record_sync(self, what: str, site: str | None) -> None:
        key = (what, site)
        self.syncs[key] += 1
        self.sync_steps[key].add(len(self.steps) - 1)
        self.steps[-1].syncs += 1

    def on_compile(self, what: str | None, shapes: Any, file: str, line: int, seconds: float) -> None:
        site = f"{file}:{line}" if file else None
        if site is None or (self.sites.script and not os.path.abspath(file) == self.sites.script):
            site = self._site() or site  # the script's own line too, or the backward's
        self.compiles.append({"what": what or "an XLA program", "shapes": _jsonable(shapes), "site": site,
                              "step": len(self.steps) - 1, "seconds": seconds})
        s = self.steps[-1]
        s.compiles += 1
        s.compile_seconds += seconds

    def on_trace(self, seconds: float) -> None:
        self.steps[-1].trace_seconds += seconds

    def _site(self) -> str | None:
        site = self.sites.here()
        if site is None and threading.get_ident() != self._thread and self._backward_site:
            return f"{self._backward_site} (backward)"  # the autograd thread runs no user frame
        return site

    # ---- ops ----
    def _stack(self) -> list[list[Any]]:
        st = getattr(self._tls, "stack", None)
        if st is None:
            st = self._tls.stack = []
        return st

    def _has_kernel(self, func: Any, name: str) -> bool:
        k = self._kernel.get(name)
        if k is None:
            qual = f"aten::{name}"
            has = torch._C._dispatch_has_kernel_for_dispatch_key
            k = any(has(qual, key) for key in ("PrivateUse1", "CompositeExplicitAutograd",
                                              "CompositeImplicitAutograd", "CompositeExplicitAutogradNonFunctional"))
            self._kernel[name] = k
        return k

    def _is_fusable(self, name: str) -> bool:
        if self._fusable is None:
            from torch_tpu import _eager
            from torch_tpu.kernels._schema import _find_variants, _overload
            from torch_tpu.kernels.registry import DEFERRABLE

            fus = set(DEFERRABLE)
            for n, k in _eager.KERNELS.items():
                if k.lowering.jit:
                    fus.add(n)
                    if k.lowering.variants:
                        for v in _find_variants(_overload(n)):
                            if v is not None:
                                fus.add(f"{v._schema.name.split('::')[-1]}"
                                        + (f".{v._schema.overload_name}" if v._schema.overload_name else ""))
            self._fusable = fus
        return name in self._fusable

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self._internal:
            return func(*args, **kwargs)
        name = _op_name(func)
        flat, _ = tree_flatten((args, kwargs))
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        on_tpu = any(t.device.type == "tpu" for t in tensors)
        dev_kw = kwargs.get("device")
        to_tpu = dev_kw is not None and torch.device(dev_kw).type == "tpu"
        if not on_tpu and not to_tpu:
            self.cpu_op_counts[name] += 1
            return func(*args, **kwargs)
        if not self._has_kernel(None, name):
            self.no_kernel[(name, self._site())] += 1  # before the call: the strict default raises in it
        stack = self._stack()
        stack.append([name, False])
        try:
            out = func(*args, **kwargs)
        finally:
            entry = stack.pop()
        self._observe(name, args, kwargs, tensors, out, synced=entry[1],
                      metadata=func.is_view or _base(name) in METADATA)
        self._ops_since_check += 1
        if self.max_seconds is not None and self._ops_since_check >= 256:
            self._ops_since_check = 0
            if time.perf_counter() - self.t0 >= self.max_seconds and self.optimizer_steps == 0:
                raise StopRun(f"--seconds {self.max_seconds:g} reached")
        return out

    def _observe(self, name: str, args: Any, kwargs: Any, tensors: list, out: Any, synced: bool,
                 metadata: bool) -> None:
        self.op_counts[name] += 1
        step = self.steps[-1]
        step.ops += 1
        base = _base(name)
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        from torch_tpu import _deferred

        fused = _deferred.current_mode() == 2 and self._is_fusable(name)  # DEFER_AND_FUSE records it
        if not fused and not metadata:  # (views and metadata kernels touch no data: no program runs)
            self.unfused[name] += 1
            step.unfused_ops += 1
            if outs and max(o.numel() for o in outs) < 4096:
                step.tiny_unfused_ops += 1
        if not synced and (name in DATA_DEPENDENT or base in DATA_DEPENDENT or
                           (base == "index" and any(t.dtype == torch.bool for t in tensors[1:]))):
            self._record_sync(f"data-dependent shape (aten::{name})", self._site())
        if base in ("_to_copy", "copy_", "_copy_from", "_copy_from_and_resize"):
            self._transfer(base, args, kwargs, outs)
        if base in MATMUL_OPS and len(tensors) >= 2:
            key = (name, tuple(tuple(t.shape) for t in tensors[:3]), str(tensors[0].dtype).replace("torch.", ""),
                   self._site())
            self.matmuls[key] += 1
        if outs and tensors and all(t.dtype == torch.int64 for t in tensors) and \
                all(o.dtype == torch.int64 for o in outs) and base not in ("_to_copy", "copy_", "clone", "view",
                                                                            "_unsafe_view", "lift_fresh", "detach"):
            self.int64_ops[(name, self._site())] += 1
        for o in outs:
            if o.device.type != "tpu":
                continue
            nbytes = o.numel() * o.element_size()
            if len(self.largest) < 8 or nbytes > self.largest[-1][0]:
                self.largest.append((nbytes, name, f"{list(o.shape)} {str(o.dtype).replace('torch.', '')}",
                                     self._site()))
                self.largest.sort(key=lambda e: -e[0])
                del self.largest[8:]

    def _transfer(self, base: str, args: Any, kwargs: Any, outs: list) -> None:
        if base == "_to_copy":
            src, dst = args[0], outs[0] if outs else None
        else:
            dst, src = args[0], args[1] if len(args) > 1 else None
        if not isinstance(src, torch.Tensor) or not isinstance(dst, torch.Tensor):
            return
        a, b = src.device.type, dst.device.type
        if a == b:
            return
        direction = "host to device" if b == "tpu" else "device to host"
        nbytes = src.numel() * src.element_size()
        key = (direction, self._site())
        self.transfers[key] += nbytes
        self.transfer_calls[key] += 1
        if b == "tpu":
            self.steps[-1].h2d_bytes += nbytes
        else:
            self.steps[-1].d2h_bytes += nbytes


def _jsonable(v: Any) -> Any:
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, (int, float, str)) or v is None:
        return v
    return str(v)
