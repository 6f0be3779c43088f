"""ProcessGroupTPU: the c10d process group behind `init_process_group(backend="tpu_dist")`.

A Python subclass of `torch.distributed.ProcessGroup` (PyTorch's trampoline lets C++ callers such as DDP's
reducer reach these methods). Each collective reads its inputs' device arrays on the calling thread, then
queues the XLA program on the group's worker thread (its "communication stream") and returns a `TpuWork`;
the worker writes the results into the output tensors and completes the work's future. `wait()` waits up to
the group's timeout: a rank that died or hung makes the others fail with an error naming the collective,
never hang.

Before each collective the ranks exchange a small descriptor (collective, root, dtype, shape) in its own
XLA program, so mismatched shapes or dtypes across ranks are a clear error instead of undefined behaviour
(set TORCH_TPU_DIST_CHECKS=0 to skip it where uneven all_to_all does not need it).
"""

from __future__ import annotations

import atexit
import os
import queue
import sys
import threading
import zlib
from datetime import timedelta
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from torch_tpu import _config, _executor, _runtime, _storage
from torch_tpu._jax import jnp
from torch_tpu.distributed import _programs, _world

BACKEND_NAME = "tpu_dist"

_REDUCE_NAMES = {
    dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "avg", dist.ReduceOp.PRODUCT: "product",
    dist.ReduceOp.MIN: "min", dist.ReduceOp.MAX: "max", dist.ReduceOp.BAND: "band", dist.ReduceOp.BOR: "bor",
    dist.ReduceOp.BXOR: "bxor", dist.ReduceOp.PREMUL_SUM: "premul_sum",
}
_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128]
_COLLECTIVES = ("all_reduce", "all_reduce_coalesced", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
                "gather", "reduce_scatter", "reduce_scatter_tensor", "scatter", "all_to_all_single", "send", "recv",
                "barrier")
_NAMES = {zlib.crc32(name.encode()): name for name in _COLLECTIVES}
_MAX_DIMS = 8
_DESC_LEN = 6 + _MAX_DIMS

_broken: list[str] = []  # groups whose collective timed out or lost a peer: the process must not hang at exit


def _exit_if_broken() -> None:
    # A collective stuck in the transport (a dead or hung peer) would make interpreter shutdown wait on
    # JAX's distributed shutdown barrier; as NCCL's watchdog does, end the process instead.
    if _broken:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


_exit_hook = False


def _register_exit_hook() -> None:
    """Registered after jax.distributed.initialize, so it runs before JAX's own shutdown hook (LIFO)."""
    global _exit_hook
    if not _exit_hook:
        atexit.register(_exit_if_broken)
        _exit_hook = True


def _reduce_name(op: Any, what: str) -> str:
    name = _REDUCE_NAMES.get(op)
    if name is None:
        try:
            name = _REDUCE_NAMES.get(dist.ReduceOp.RedOpType(op.op)) if hasattr(op, "op") else None
        except Exception:
            name = None
    if name is None:
        raise ValueError(
            f"tpu_dist: {what} does not support reduce op {op}; use SUM, AVG, PRODUCT, MIN, MAX, PREMUL_SUM, BAND, "
            "BOR or BXOR."
        )
    return name


# The dtype rules NCCL applies (ProcessGroupNCCL), plus gloo's bitwise ops on integers: a reduction that has no
# meaning for a dtype is an error before anything is sent, never a value computed some other way.
_FLOAT_ONLY = {"avg": "AVG", "premul_sum": "PREMUL_SUM"}
_INTEGER_ONLY = {"band": "BAND", "bor": "BOR", "bxor": "BXOR"}
_NOT_COMPLEX = {"min": "MIN", "max": "MAX", **_INTEGER_ONLY}


def _reduce_op(opts_op: Any, what: str, tensors: Sequence[torch.Tensor]) -> tuple[str, Any]:
    """(op name, PREMUL_SUM factor or None) for `opts_op`, after checking it applies to every tensor's dtype."""
    name = _reduce_name(opts_op, what)
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue  # _check_tensor reports it
        if name in _FLOAT_ONLY and not (t.is_floating_point() or t.is_complex()):
            raise RuntimeError(
                f"tpu_dist: {what} with ReduceOp.{_FLOAT_ONLY[name]} needs floating point tensors, got "
                f"{_describe(t)} (as with NCCL); use SUM and divide or scale yourself, or convert to float."
            )
        if name in _INTEGER_ONLY and (t.is_floating_point() or t.is_complex()):
            raise RuntimeError(
                f"tpu_dist: {what} with ReduceOp.{_INTEGER_ONLY[name]} needs integer or bool tensors, got "
                f"{_describe(t)}; a bitwise reduction of floating point values has no meaning (view the bits as "
                "an integer dtype with .view(torch.int32) if that is what you want)."
            )
        if name in _NOT_COMPLEX and t.is_complex():
            raise RuntimeError(
                f"tpu_dist: {what} with ReduceOp.{_NOT_COMPLEX[name]} does not apply to complex tensors, got "
                f"{_describe(t)}; use SUM, AVG, PRODUCT or PREMUL_SUM, or reduce torch.view_as_real(t)."
            )
    if name != "premul_sum":
        return name, None
    factor = opts_op.factor  # a Python float or a one-element tensor (dist._make_nccl_premul_sum)
    if isinstance(factor, torch.Tensor):
        if factor.numel() != 1 or not factor.is_floating_point():
            raise RuntimeError(
                f"tpu_dist: {what} with ReduceOp.PREMUL_SUM: the factor must be a one-element floating point "
                f"tensor, got {_describe(factor)} on {factor.device}."
            )
        if factor.device.type not in ("tpu", "cpu"):
            raise RuntimeError(f"tpu_dist: {what} with ReduceOp.PREMUL_SUM: the factor tensor is on "
                               f"{factor.device}; pass a tpu (or cpu) tensor or a Python float.")
    return name, factor


def _describe(t: torch.Tensor) -> str:
    return f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}"


class TpuWork(dist._Work):
    """A queued collective. `wait()` blocks until the results are in the output tensors (or raises)."""

    def __init__(self, what: str, timeout_s: float, group: "ProcessGroupTPU") -> None:
        super().__init__()
        self.what = what
        self.timeout_s = timeout_s
        self.group = group
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.outputs: list[torch.Tensor] = []
        self.future: torch.futures.Future = torch.futures.Future()

    def _finish(self, outputs: list[torch.Tensor] | None, error: BaseException | None) -> None:
        self.outputs = outputs or []
        self.error = error
        self.done.set()
        if error is not None:
            self.future.set_exception(error)
        else:
            self.future.set_result(self.outputs)

    def wait(self, timeout: timedelta | None = None) -> bool:
        limit = self.timeout_s
        if isinstance(timeout, timedelta) and timeout.total_seconds() > 0:
            limit = timeout.total_seconds()
        if not self.done.wait(limit):
            msg = (
                f"tpu_dist: {self.what} on rank {self.group.rank()} of group {list(self.group.ranks)} did not "
                f"finish within the timeout ({limit:.0f} s): another rank has probably died, hung, or not called "
                "the same collective. Check the other ranks' logs; raise the timeout with "
                "init_process_group(..., timeout=timedelta(...)) if they are just slow."
            )
            self.group._mark_broken(msg)
            raise RuntimeError(msg)
        if self.error is not None:
            raise self.error
        return True

    def is_completed(self) -> bool:
        return self.done.is_set()

    def is_success(self) -> bool:
        return self.done.is_set() and self.error is None

    def exception(self) -> Any:
        return self.error

    def get_future(self) -> torch.futures.Future:
        return self.future

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self.outputs

    def synchronize(self) -> None:
        self.wait()

    def block_current_stream(self) -> None:
        self.wait()


class _Worker(threading.Thread):
    """Runs a group's collectives in the order they were issued (the group's communication stream)."""

    def __init__(self, name: str) -> None:
        super().__init__(name=name, daemon=True)
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()

    def run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            fn, work = job
            try:
                outputs = fn()
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                work._finish(None, e)
            else:
                work._finish(outputs, None)


class ProcessGroupTPU(dist.ProcessGroup):
    """Collectives over tpu tensors as XLA programs over the group's devices."""

    def __init__(self, store: Any, rank: int, size: int, timeout: timedelta, global_ranks: Sequence[int],
                 group_name: str = "") -> None:
        super().__init__(rank, size)
        self.store = store
        self.ranks = tuple(global_ranks)
        self.timeout_s = _world._seconds(timeout)
        self.broken: str | None = None
        self._name = group_name
        self._desc = ""
        self._worker = _Worker(f"tpu_dist-{group_name or 'group'}")
        self._worker.start()
        self._channels: dict[int, _Worker] = {}  # send/recv: one channel per peer
        self._mailbox: dict[int, list[Any]] = {}  # payloads a peer sent in a swap, waiting for their recv
        self.is_default = False
        self._checks = _config.get("TORCH_TPU_DIST_CHECKS")

    # This one object is both the process group and its tpu backend (c10d asks the group for its backend by
    # device, e.g. when init_process_group gets device_id=).
    supports_splitting = False
    supports_coalescing = False
    supports_time_estimate = False

    def _get_backend(self, device: Any = None) -> "ProcessGroupTPU":
        return self

    @property
    def _device_types(self) -> list[torch.device]:
        # Object collectives (all_gather_object, broadcast_object_list) stage their bytes on this device type.
        return [torch.device("tpu")]

    # -- identity --
    def getBackendName(self) -> str:  # noqa: N802 - c10d's name
        return BACKEND_NAME

    def name(self) -> str:
        return BACKEND_NAME

    # c10d keeps a Python process group's name and description on the object (there is no C++ backend).
    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._name = name

    def getGroupName(self) -> str:  # noqa: N802
        return self._name

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._desc = desc

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._desc

    @property
    def group_name(self) -> str:
        return self._name

    @property
    def group_desc(self) -> str:
        return self._desc

    # -- lifecycle --
    def shutdown(self) -> None:
        """destroy_process_group: stops the worker; destroying the default group forgets the world (meshes,
        compiled programs) so a new default group can start in this process."""
        workers = [self._worker, *self._channels.values()]
        for w in workers:
            w.jobs.put(None)
        if self.broken is None:  # let queued collectives finish first (a broken group's may never finish)
            for w in workers:
                w.join(min(self.timeout_s, 60.0))
        _programs.clear()
        if self.is_default:
            _world.forget_world()

    def abort(self) -> None:
        self.shutdown()

    def _mark_broken(self, msg: str) -> None:
        self.broken = msg
        _broken.append(msg)

    # -- plumbing --
    def _device_index(self) -> int:
        return _world.world().local_index

    def _check_tensor(self, what: str, t: torch.Tensor) -> None:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tpu_dist: {what} expects tensors, got {type(t).__name__}")
        idx = self._device_index()
        if t.device.type != "tpu":
            raise RuntimeError(
                f"tpu_dist: {what} got a {t.device.type} tensor ({_describe(t)}); the tpu_dist backend runs "
                f"collectives on tpu tensors. Move it with .to('tpu:{idx}'), or create a gloo group for CPU "
                "tensors (dist.new_group(backend='gloo'))."
            )
        if t.device.index != idx:
            raise RuntimeError(
                f"tpu_dist: {what} got a tensor on {t.device} ({_describe(t)}) but rank {self.rank()} runs on "
                f"tpu:{idx} (one process per device, chosen by LOCAL_RANK). Move the tensor to tpu:{idx} and "
                f"call torch.tpu.set_device({idx})."
            )

    def _read(self, what: str, tensors: Sequence[torch.Tensor]) -> list[Any]:
        for t in tensors:
            self._check_tensor(what, t)
        return [_executor.concrete(_storage.read(t), "collective") for t in tensors]

    def _zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> Any:
        import jax

        return jax.device_put(jnp.zeros(shape, _runtime.jax_dtype(dtype)), _runtime.device(self._device_index()))

    def _descriptor(self, what: str, root: int, tensors: Sequence[torch.Tensor], extra: int = 0,
                    shape_of: Callable[[torch.Tensor], tuple] = lambda t: tuple(t.shape)) -> np.ndarray:
        code = zlib.crc32(what.split("(")[0].encode())  # the same on every rank, whatever ran before
        sig = ";".join(f"{t.dtype}{shape_of(t)}" for t in tensors)
        first = tensors[0] if tensors else None
        shape = tuple(shape_of(first)) if first is not None else ()
        dims = list(shape[:_MAX_DIMS]) + [0] * (_MAX_DIMS - min(len(shape), _MAX_DIMS))
        dtype_code = _DTYPES.index(first.dtype) if first is not None and first.dtype in _DTYPES else 99
        return np.array([code, root, zlib.crc32(sig.encode()), extra, dtype_code, len(shape)] + dims, np.int64)

    def _exchange(self, what: str, desc: np.ndarray, need: bool = False) -> np.ndarray | None:
        """All-gathers the descriptors (n, _DESC_LEN) and checks the ranks agree; None when checks are off."""
        if not (self._checks or need):
            return None
        local = _runtime.upload(torch.from_numpy(desc), self._device_index())
        (gathered,) = _programs.run("allgather", self.ranks, (False,), [local], _programs.allgather)
        table = np.asarray(gathered)
        mine = table[self.rank()]
        bad = [r for r in range(self.size()) if (table[r][[0, 1, 2, 4]] != mine[[0, 1, 2, 4]]).any()]
        if bad:
            def fmt(row: np.ndarray) -> str:
                dt = _DTYPES[row[4]] if 0 <= row[4] < len(_DTYPES) else "?"
                shape = [int(d) for d in row[6:6 + int(row[5])]]
                return (f"{_NAMES.get(int(row[0]), '?')} {str(dt).replace('torch.', '')}{shape} "
                        f"root {int(row[1])}")

            lines = "; ".join(f"rank {r}: {fmt(table[r])}" for r in range(self.size()))
            raise RuntimeError(
                f"tpu_dist: {what} was called with mismatched arguments across the ranks of group "
                f"{list(self.ranks)} ({lines}). Every rank must call the same collective with the same "
                "shapes, dtypes and root, in the same order."
            )
        return table

    def _submit(self, what: str, fn: Callable[[], list[torch.Tensor]], worker: "_Worker | None" = None
                ) -> TpuWork:
        if self.broken is not None:
            raise RuntimeError(f"tpu_dist: {what}: this process group is no longer usable: {self.broken}")
        work = TpuWork(what, self.timeout_s, self)
        index = self._device_index()
        # A collective is its own XLA program over the group's devices: DEFER_AND_FUSE's pending work on this
        # device runs first, and the group's thread reads and writes tensors eagerly.
        _executor.flush("collective")

        def run() -> list[torch.Tensor]:
            torch.tpu.set_device(index)
            try:
                with _executor.eagerly():
                    return fn()
            except Exception as e:  # XLA reports transport failures as RuntimeError or ValueError
                raise self._wrap_error(what, e) from e

        (worker or self._worker).jobs.put((run, work))
        return work

    def _wrap_error(self, what: str, e: BaseException) -> BaseException:
        text = str(e)
        if text.startswith("tpu_dist:"):
            return e
        lost = any(s in text for s in ("Connection closed by peer", "Connection reset", "Broken pipe",
                                       "Socket closed", "connection", "UNAVAILABLE", "DEADLINE_EXCEEDED"))
        if lost:
            msg = (
                f"tpu_dist: {what} failed on rank {self.rank()} of group {list(self.ranks)}: a peer rank closed "
                f"its connection, so another rank has most likely died (see its log). The group cannot be used "
                f"any more; restart the job (torchrun --max-restarts) or resume from a checkpoint. Transport "
                f"error: {text.splitlines()[0] if text else type(e).__name__}"
            )
            self._mark_broken(msg)
            return RuntimeError(msg)
        return RuntimeError(f"tpu_dist: {what} failed on rank {self.rank()} of group {list(self.ranks)}: {text}")

    def _write(self, t: torch.Tensor, value: Any) -> None:
        _storage.write(t, value)

    # -- allreduce --
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> TpuWork:
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        return self._allreduce("all_reduce", tensors, op)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> TpuWork:
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        return self._allreduce("all_reduce_coalesced", tensors, op)

    def _factor(self, what: str, factor: Any, tensors: Sequence[torch.Tensor]) -> list[Any]:
        """[] or, for PREMUL_SUM, [this rank's factor as a (1,) device array]: the program's last input, which
        multiplies each tensor (cast to its dtype, as NCCL casts the factor) before the sum. float64 when a
        tensor is float64, else float32 (a changing factor is a value, not a recompile)."""
        if factor is None:
            return []
        wide = any(t.dtype in (torch.float64, torch.complex128) for t in tensors)
        fdtype = torch.float64 if wide else torch.float32
        if isinstance(factor, torch.Tensor):
            if factor.device.type == "tpu":
                (array,) = self._read(f"{what} (PREMUL_SUM factor)", [factor])
                return [array.reshape((1,)).astype(_runtime.jax_dtype(fdtype))]
            factor = factor.reshape(1).to(fdtype)
        else:
            factor = torch.tensor([float(factor)], dtype=fdtype)
        return [_runtime.upload(factor, self._device_index())]

    def _allreduce(self, what: str, tensors: list[torch.Tensor], opts_op: Any) -> TpuWork:
        op, factor = _reduce_op(opts_op, what, tensors)
        arrays = self._read(what, tensors) + self._factor(what, factor, tensors)
        desc = self._descriptor(what, 0, tensors)
        n = self.size()

        def fn() -> list[torch.Tensor]:
            self._exchange(what, desc)
            outs = _programs.run("allreduce", self.ranks, (op, n), arrays, lambda: _programs.allreduce(op, n),
                                 n_out=len(tensors))
            for t, v in zip(tensors, outs):
                self._write(t, v)
            return list(tensors)

        return self._submit(f"{what}({op}, {', '.join(_describe(t) for t in tensors)})", fn)

    # -- broadcast / reduce --
    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> TpuWork:
        root = opts.rootRank if opts is not None else 0
        what = "broadcast"
        arrays = self._read(what, tensors)
        desc = self._descriptor(what, root, tensors)

        def fn() -> list[torch.Tensor]:
            self._exchange(what, desc)
            outs = _programs.run("broadcast", self.ranks, (root,), arrays, lambda: _programs.broadcast(root))
            if self.rank() != root:
                for t, v in zip(tensors, outs):
                    self._write(t, v)
            return list(tensors)

        return self._submit(f"broadcast(src={root}, {', '.join(_describe(t) for t in tensors)})", fn)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> TpuWork:
        root = opts.rootRank
        what = "reduce"
        op, factor = _reduce_op(opts.reduceOp, what, tensors)
        arrays = self._read(what, tensors) + self._factor(what, factor, tensors)
        desc = self._descriptor(what, root, tensors)
        n = self.size()

        def fn() -> list[torch.Tensor]:
            self._exchange(what, desc)
            outs = _programs.run("allreduce", self.ranks, (op, n), arrays, lambda: _programs.allreduce(op, n),
                                 n_out=len(tensors))
            if self.rank() == root:
                for t, v in zip(tensors, outs):
                    self._write(t, v)
            return list(tensors)

        return self._submit(f"reduce(dst={root}, {op}, {', '.join(_describe(t) for t in tensors)})", fn)

    # -- all_gather --
    def _gather_stack(self, what: str, root: int, t_in: torch.Tensor,
                      write: Callable[[Any], None], outputs: list[torch.Tensor], tiled: bool = False) -> TpuWork:
        (array,) = self._read(what, [t_in])
        desc = self._descriptor(what, root, [t_in])

        def fn() -> list[torch.Tensor]:
            self._exchange(what, desc)
            (stacked,) = _programs.run("allgather", self.ranks, (tiled,), [array], lambda: _programs.allgather(tiled))
            write(stacked)
            return outputs

        return self._submit(f"{what}({_describe(t_in)})", fn)

    def _check_outputs(self, what: str, outs: Sequence[torch.Tensor], like: torch.Tensor, count: int) -> None:
        if len(outs) != count:
            raise RuntimeError(f"tpu_dist: {what} needs a list of {count} tensors (the group size), got {len(outs)}")
        for o in outs:
            self._check_tensor(what, o)
            if o.shape != like.shape or o.dtype != like.dtype:
                raise RuntimeError(
                    f"tpu_dist: {what}: every tensor in the list must match the input {_describe(like)}, got "
                    f"{_describe(o)}."
                )

    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
                  opts: Any = None) -> TpuWork:
        what = "all_gather"
        t_in, outs = input_tensors[0], output_tensors[0]
        self._check_outputs(what, outs, t_in, self.size())

        def write(stacked: Any) -> None:
            for i, o in enumerate(outs):
                self._write(o, stacked[i])

        return self._gather_stack(what, 0, t_in, write, list(outs))

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> TpuWork:
        what = "all_gather_into_tensor"
        self._check_tensor(what, output)
        n = self.size()
        if output.dtype != input.dtype or output.numel() != n * input.numel():
            raise RuntimeError(
                f"tpu_dist: {what}: the output must hold group size ({n}) x the input {_describe(input)} "
                f"elements of the same dtype, got {_describe(output)}."
            )

        # Gathered along dimension 0 (no reshape copy) when the output is the inputs stacked along dimension 0.
        tiled = input.dim() > 0 and tuple(output.shape) == (n * input.shape[0],) + tuple(input.shape[1:])

        def write(stacked: Any) -> None:
            self._write(output, stacked if tiled else stacked.reshape(tuple(output.shape)))

        return self._gather_stack(what, 0, input, write, [output], tiled)

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                    opts: Any = None) -> TpuWork:
        works = [self.all_gather_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return works[-1] if works else self.barrier()

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                            opts: Any = None) -> TpuWork:
        works = [self.allgather([o], [i], opts) for o, i in zip(output_lists, inputs)]
        return works[-1]

    def gather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
               opts: Any = None) -> TpuWork:
        what = "gather"
        root = opts.rootRank
        t_in = input_tensors[0]
        outs = output_tensors[0] if self.rank() == root and output_tensors else []
        if self.rank() == root:
            self._check_outputs(what, outs, t_in, self.size())

        def write(stacked: Any) -> None:
            for i, o in enumerate(outs):
                self._write(o, stacked[i])

        return self._gather_stack(what, root, t_in, write, list(outs))

    # -- reduce_scatter --
    def _reduce_scatter(self, what: str, stacked_in: Any, in_desc: list[torch.Tensor], out: torch.Tensor,
                        op: str, factor: Any, tiled: bool = False) -> TpuWork:
        desc = self._descriptor(what, 0, in_desc)
        n = self.size()
        arrays = [stacked_in] + self._factor(what, factor, [out])

        def fn() -> list[torch.Tensor]:
            self._exchange(what, desc)
            (v,) = _programs.run("reduce_scatter", self.ranks, (op, n, tiled), arrays,
                                 lambda: _programs.reduce_scatter(op, n, tiled), n_out=1)
            self._write(out, v if tuple(v.shape) == tuple(out.shape) else v.reshape(tuple(out.shape)))
            return [out]

        return self._submit(f"{what}({op}, {_describe(in_desc[0])})", fn)

    def reduce_scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
                       opts: Any = None) -> TpuWork:
        what = "reduce_scatter"
        out, ins = output_tensors[0], input_tensors[0]
        op, factor = _reduce_op(opts.reduceOp, what, [out])
        self._check_tensor(what, out)
        self._check_outputs(what, ins, out, self.size())
        arrays = self._read(what, ins)
        return self._reduce_scatter(what, jnp.stack(arrays), list(ins), out, op, factor)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> TpuWork:
        what = "reduce_scatter_tensor"
        op, factor = _reduce_op(opts.reduceOp, what, [output])
        n = self.size()
        self._check_tensor(what, output)
        if output.dtype != input.dtype or input.numel() != n * output.numel():
            raise RuntimeError(
                f"tpu_dist: {what}: the input must hold group size ({n}) x the output {_describe(output)} "
                f"elements of the same dtype, got {_describe(input)}."
            )
        (array,) = self._read(what, [input])
        if output.dim() > 0 and tuple(input.shape) == (n * output.shape[0],) + tuple(output.shape[1:]):
            return self._reduce_scatter(what, array, [input], output, op, factor, tiled=True)  # no reshape copy
        return self._reduce_scatter(what, array.reshape((n,) + tuple(output.shape)), [input], output, op, factor)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> TpuWork:
        works = [self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return works[-1]

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # -- scatter --
    def scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
                opts: Any = None) -> TpuWork:
        what = "scatter"
        root = opts.rootRank
        out = output_tensors[0]
        self._check_tensor(what, out)
        n = self.size()
        if self.rank() == root:
            ins = input_tensors[0]
            self._check_outputs(what, ins, out, n)
            stacked = jnp.stack(self._read(what, ins))
        else:
            stacked = self._zeros((n,) + tuple(out.shape), out.dtype)
        desc = self._descriptor(what, root, [out])

        def fn() -> list[torch.Tensor]:
            self._exchange(what, desc)
            (v,) = _programs.run("scatter", self.ranks, (root,), [stacked], lambda: _programs.scatter(root))
            self._write(out, v)
            return [out]

        return self._submit(f"scatter(src={root}, {_describe(out)})", fn)

    # -- all_to_all --
    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
                          input_split_sizes: list[int], opts: Any = None) -> TpuWork:
        what = "all_to_all_single"
        n = self.size()
        self._check_tensor(what, output)
        (array,) = self._read(what, [input])
        if input.dtype != output.dtype or input.shape[1:] != output.shape[1:]:
            raise RuntimeError(
                f"tpu_dist: {what}: input {_describe(input)} and output {_describe(output)} must have the same "
                "dtype and the same sizes after dimension 0."
            )
        rows_in, rows_out = int(input.shape[0]) if input.dim() else 1, int(output.shape[0]) if output.dim() else 1
        ins = list(input_split_sizes) or [rows_in // n] * n
        outs = list(output_split_sizes) or [rows_out // n] * n
        if len(ins) != n or len(outs) != n or sum(ins) != rows_in or sum(outs) != rows_out:
            raise RuntimeError(
                f"tpu_dist: {what}: split sizes must have group size ({n}) entries summing to dimension 0 of "
                f"input {_describe(input)} / output {_describe(output)}; got input_split_sizes={ins}, "
                f"output_split_sizes={outs} (empty lists mean equal splits, which need dimension 0 divisible "
                f"by {n})."
            )
        rest = tuple(input.shape[1:])
        even = len(set(ins)) == 1 and len(set(outs)) == 1 and ins[0] == outs[0]
        desc = self._descriptor(what, 0, [input], extra=max(ins) if ins else 0, shape_of=lambda t: rest)

        def fn() -> list[torch.Tensor]:
            table = self._exchange(what, desc, need=not even)
            if even:
                chunks = array.reshape((n, ins[0]) + rest)
                (v,) = _programs.run("all_to_all", self.ranks, (), [chunks], _programs.all_to_all)
                self._write(output, v.reshape(tuple(output.shape)))
                return [output]
            m = int(table[:, 3].max())
            starts = np.cumsum([0] + ins[:-1])
            padded = jnp.stack([
                jnp.pad(array[s:s + k], [(0, m - k)] + [(0, 0)] * len(rest)) for s, k in zip(starts, ins)
            ]) if m > 0 else jnp.zeros((n, 0) + rest, array.dtype)
            (v,) = _programs.run("all_to_all", self.ranks, (), [padded], _programs.all_to_all)
            if rows_out:
                self._write(output, jnp.concatenate([v[j, :k] for j, k in enumerate(outs)]).reshape(output.shape))
            return [output]

        return self._submit(f"{what}({_describe(input)} -> {_describe(output)}, splits {ins} -> {outs})", fn)

    alltoall_base = all_to_all_single

    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                 opts: Any = None) -> TpuWork:
        """all_to_all on lists: flattened into one uneven all_to_all_single (tensors may differ in size)."""
        what = "all_to_all"
        n = self.size()
        if len(input_tensors) != n or len(output_tensors) != n:
            raise RuntimeError(f"tpu_dist: {what} needs lists of group size ({n}) tensors, got "
                               f"{len(input_tensors)} inputs and {len(output_tensors)} outputs")
        dtypes = {t.dtype for t in list(input_tensors) + list(output_tensors)}
        if len(dtypes) != 1:
            raise RuntimeError(f"tpu_dist: {what}: all tensors must have one dtype, got {sorted(map(str, dtypes))}")
        for t in output_tensors:
            self._check_tensor(what, t)
        flat_in = torch.cat([t.reshape(-1) for t in input_tensors])
        flat_out = torch.empty(sum(t.numel() for t in output_tensors), dtype=flat_in.dtype, device=flat_in.device)
        work = self.all_to_all_single(flat_out, flat_in, [t.numel() for t in output_tensors],
                                      [t.numel() for t in input_tensors], opts)
        outs = list(output_tensors)

        def unpack() -> list[torch.Tensor]:
            work.wait()
            value = _executor.concrete(_storage.read(flat_out), "collective")
            start = 0
            for t in outs:
                self._write(t, value[start:start + t.numel()].reshape(tuple(t.shape)))
                start += t.numel()
            return outs

        return self._submit(f"{what}({len(outs)} tensors)", unpack)

    # -- point to point --
    def _p2p(self, what: str, t: torch.Tensor, peer: int, sending: bool) -> TpuWork:
        """send/recv. Each peer has its own channel (a worker thread), so only the order of the operations
        between two ranks matters, as with NCCL and gloo. A step on a channel first exchanges what each side
        posted: a send meeting a recv transfers; two sends meeting (both sides send first, as in
        batch_isend_irecv) swap payloads and each side keeps the other's until its recv is posted."""
        if not 0 <= peer < self.size() or peer == self.rank():
            raise RuntimeError(f"tpu_dist: {what}: peer rank {peer} must be another rank of the group "
                               f"(0..{self.size() - 1}, not this rank {self.rank()})")
        (array,) = self._read(what, [t])
        me_g, peer_g = self.ranks[self.rank()], self.ranks[peer]
        pair = (min(me_g, peer_g), max(me_g, peer_g))
        pos = pair.index(me_g)
        desc = self._descriptor(what, 1 if sending else 2, [t])
        index = self._device_index()
        mailbox = self._mailbox.setdefault(peer, [])

        def fn() -> list[torch.Tensor]:
            if not sending and mailbox:  # the peer's send already arrived in a swap
                got = mailbox.pop(0)
                if tuple(got.shape) != tuple(t.shape) or _runtime.torch_dtype(got.dtype) != t.dtype:
                    raise RuntimeError(
                        f"tpu_dist: recv(src={peer}) into {_describe(t)}, but rank {peer} sent "
                        f"{str(_runtime.torch_dtype(got.dtype)).replace('torch.', '')}{list(got.shape)}; the recv "
                        "tensor must have the shape and dtype of the sent one."
                    )
                self._write(t, got)
                return [t]
            local = _runtime.upload(torch.from_numpy(desc), index)
            (g,) = _programs.run("allgather", pair, (False,), [local], _programs.allgather)
            table = np.asarray(g)
            other = table[1 - pos]

            def described(row: np.ndarray) -> str:
                dt = _DTYPES[row[4]] if 0 <= row[4] < len(_DTYPES) else "?"
                return f"{str(dt).replace('torch.', '')}{[int(d) for d in row[6:6 + int(row[5])]]}"

            other_sends = int(other[1]) == 1
            if sending and not other_sends or not sending and other_sends:
                if (table[0][[2, 4]] != table[1][[2, 4]]).any():
                    raise RuntimeError(
                        f"tpu_dist: {what} between ranks {self.rank()} and {peer}: the sent and received tensors "
                        f"differ (this rank {_describe(t)}, rank {peer} {described(other)}); the recv tensor must "
                        "have the shape and dtype of the sent one."
                    )
                src = pos if sending else 1 - pos
                (v,) = _programs.run("transfer", pair, (src,), [array], lambda: _programs.transfer(src))
                if not sending:
                    self._write(t, v)
                return [t]
            if not sending:
                raise RuntimeError(
                    f"tpu_dist: recv between ranks {self.rank()} and {peer}: both ranks are receiving from each "
                    "other, so neither can go on. Post the matching send first on one side (or use "
                    "batch_isend_irecv with the send listed before the recv)."
                )
            # Both sides send: swap payloads.
            other_zero = self._zeros(tuple(int(d) for d in other[6:6 + int(other[5])]), _DTYPES[int(other[4])])
            inputs = [array, other_zero] if pos == 0 else [other_zero, array]
            outs = _programs.run("swap", pair, (), inputs, _programs.swap)
            mailbox.append(outs[1] if pos == 0 else outs[0])
            return [t]

        if peer not in self._channels:
            self._channels[peer] = _Worker(f"tpu_dist-{self._name or 'group'}-p2p-{peer}")
            self._channels[peer].start()
        return self._submit(f"{what}({'dst' if sending else 'src'}={peer}, {_describe(t)})", fn,
                            self._channels[peer])

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> TpuWork:
        return self._p2p("send", tensors[0], dst, True)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> TpuWork:
        return self._p2p("recv", tensors[0], src, False)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> TpuWork:
        raise RuntimeError("tpu_dist: recv without a source rank is not supported: XLA collectives need both "
                           "ends known; pass src=.")

    # -- barrier --
    def barrier(self, opts: Any = None) -> TpuWork:
        """The descriptor exchange itself (a small all_gather, waited for): it also catches a rank that called
        another collective instead of barrier."""
        desc = self._descriptor("barrier", 0, [])

        def fn() -> list[torch.Tensor]:
            self._exchange("barrier", desc, need=True)
            return []

        return self._submit("barrier", fn)


def create(opts: Any, pg_options: Any = None) -> ProcessGroupTPU:
    """The c10d creator (extended API): joins the JAX world for the default group, then builds the group."""
    store, rank, size, timeout = opts.store, opts.group_rank, opts.group_size, opts.timeout
    ranks = list(opts.global_ranks_in_group or [])
    if not dist.is_initialized():  # the default group: rank and size are the world's
        _world.init_world(store, rank, size, timeout)
        _register_exit_hook()
        ranks = list(range(size))
    elif not ranks:
        ranks = list(range(size))
    w = _world.world()
    if len(ranks) != size or ranks[rank] != w.rank:
        raise RuntimeError(f"tpu_dist: inconsistent group: global ranks {ranks}, group rank {rank} of {size}, "
                           f"world rank {w.rank}")
    pg = ProcessGroupTPU(store, rank, size, timeout, ranks, str(getattr(opts, "group_id", "") or ""))
    pg.is_default = not dist.is_initialized()
    return pg
