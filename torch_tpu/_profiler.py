"""`torch.tpu.profiler`: device traces of the XLA programs the tpu device runs (docs/user_guide.md, "Profiling").

Two profilers look at a tpu program, each at its own side:
- `torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.PrivateUse1])` records the host side:
  every aten op called on tpu tensors, `record_function` ranges, Python stacks, exported as a Chrome trace; and,
  through the Kineto plugin runtime/TpuProfiler.cpp (which calls `_device_session_*` below), one device row per
  XLA program execution, taken from the same XLA tracer `trace` uses.
- `trace(log_dir)` records the device side with JAX's profiler (XLA/PJRT's own): a TensorBoard/XProf trace
  directory in which every XLA program execution is named after what it runs — `jit_aten_<op>` for an eager op,
  `jit_torch_tpu_fused_<n>_ops_<ops>` for a DEFER_AND_FUSE graph, `jit_torch_tpu_<kind>_graph_<n>_ops_<ops>` for a
  `torch.compile(backend="tpu")` graph, `jit_aten__foreach_<op>_<overload>` for a `_foreach_*` op
  (`program_name`, below) — so the device timeline maps back to the Python code.
`annotate(name)` marks a range in both at once (a `record_function` and a JAX `TraceAnnotation`).
`device_programs(log_dir)` reads the programs' device time back from a trace written by `trace`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import os
import re
import shutil
import tempfile
import time
import warnings
from typing import Any, Iterable, Iterator

import torch

__all__ = ["program_name", "trace", "start_trace", "stop_trace", "annotate", "device_programs", "ProgramTime",
           "latest_trace"]


def program_name(op: str, prefix: str = "aten_") -> str:
    """The name of the XLA program that runs `op` ("add.Tensor" -> "aten_add_Tensor"; jax.jit calls the module
    `jit_<name>`), set by every executor when it builds a program, never per call. A valid identifier and the same
    in every process: JAX's persistent cache key starts with it."""
    return prefix + re.sub(r"[^0-9A-Za-z_]", "_", op)


def graph_program_name(prefix: str, ops: Iterable[str]) -> str:
    """The name of a program that runs a graph of ops (a fused graph, a compiled graph): `prefix` and the first 4
    distinct op names in graph order, e.g. `torch_tpu_fused_7_ops_mm_add_Tensor_relu`."""
    names: list[str] = []
    for op in ops:
        op = op.removeprefix("aten::")
        if op not in names:
            names.append(op)
            if len(names) == 4:
                break
    return program_name("_".join(names), prefix)


_active: list[str] = []  # the log directory of the trace in progress (JAX allows one per process)


def start_trace(log_dir: str | os.PathLike, create_perfetto_trace: bool = False,
                python_tracer: bool = False) -> None:
    """Starts a device trace written to `log_dir` (by `stop_trace`), as `jax.profiler.start_trace` does: open it
    with TensorBoard's profile plugin or XProf (`xprof --logdir log_dir`); with `create_perfetto_trace`, a
    `perfetto_trace.json.gz` for ui.perfetto.dev is written beside it. One trace at a time per process.
    `python_tracer`: also record every Python call (JAX's default; off here because PyTorch's Python-heavy paths,
    torch.compile's tracing above all, then run many times slower and the host timeline stops meaning much)."""
    from torch_tpu._jax import jax

    if _active:
        if _active[0] == _KINETO:
            raise RuntimeError(f"torch.tpu.profiler.start_trace({str(log_dir)!r}): the running {_KINETO} holds the "
                               "process's one device trace (for its tpu device rows); leave that profile first, or "
                               "profile with ProfilerActivity.CPU alone")
        raise RuntimeError(f"torch.tpu.profiler.start_trace({str(log_dir)!r}): a trace into {_active[0]!r} is "
                           "already running; call torch.tpu.profiler.stop_trace() first (one trace per process)")
    _synchronize()  # work queued before the trace is not charged to it
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 1 if python_tracer else 0
    jax.profiler.start_trace(os.fspath(log_dir), create_perfetto_trace=create_perfetto_trace,
                             profiler_options=options)
    _active.append(os.fspath(log_dir))


def stop_trace() -> None:
    """Waits for the device work queued so far (and the pending DEFER_AND_FUSE graphs: they run now), so the
    trace holds every program issued inside it, then stops the trace and writes it."""
    from torch_tpu._jax import jax

    if not _active or _active[0] == _KINETO:
        raise RuntimeError("torch.tpu.profiler.stop_trace(): no trace is running; start one with "
                           "torch.tpu.profiler.start_trace(log_dir) or `with torch.tpu.profiler.trace(log_dir):`")
    try:
        _synchronize()
    finally:
        _active.clear()
        jax.profiler.stop_trace()


@contextlib.contextmanager
def trace(log_dir: str | os.PathLike, create_perfetto_trace: bool = False,
          python_tracer: bool = False) -> Iterator[str]:
    """`with torch.tpu.profiler.trace("/tmp/trace"):` — a device trace of the block (see `start_trace`); yields
    the log directory."""
    start_trace(log_dir, create_perfetto_trace, python_tracer)
    try:
        yield os.fspath(log_dir)
    finally:
        stop_trace()


class annotate(contextlib.ContextDecorator):
    """A named range in both profilers: a `torch.profiler.record_function` range (host trace, key_averages) and a
    `jax.profiler.TraceAnnotation` (device trace). A context manager or a decorator. JAX's annotation costs nothing
    while no device trace runs."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._stack: list[tuple[Any, Any]] = []

    def __enter__(self) -> annotate:
        from torch_tpu._jax import jax

        rf = torch.profiler.record_function(self.name)
        ta = jax.profiler.TraceAnnotation(self.name)
        rf.__enter__()
        try:
            ta.__enter__()
        except BaseException:
            rf.__exit__(None, None, None)
            raise
        self._stack.append((rf, ta))
        return self

    def __exit__(self, *exc: Any) -> None:
        rf, ta = self._stack.pop()
        try:
            ta.__exit__(*exc)
        finally:
            rf.__exit__(*exc)


@dataclasses.dataclass(frozen=True)
class ProgramTime:
    """One XLA program's executions in a device trace: `name` its module name (`jit_aten_add_Tensor`...),
    `count` the executions, `device_ns` the summed time of its device-side events (on XLA:CPU: the compiled
    code running on the host's threads; on a TPU: the TPU's own timeline)."""

    name: str
    count: int
    device_ns: float


def latest_trace(log_dir: str | os.PathLike) -> str:
    """The newest `.xplane.pb` file a trace wrote under `log_dir` (JAX writes
    `plugins/profile/<run>/<host>.xplane.pb`)."""
    files = glob.glob(os.path.join(os.fspath(log_dir), "plugins", "profile", "*", "*.xplane.pb"))
    if not files:
        raise FileNotFoundError(f"torch.tpu.profiler: no trace (plugins/profile/*/*.xplane.pb) under "
                                f"{os.fspath(log_dir)!r}; write one with `with torch.tpu.profiler.trace(log_dir):`")
    return max(files, key=os.path.getmtime)


def device_programs(log_dir: str | os.PathLike) -> dict[str, ProgramTime]:
    """The XLA programs a trace (`trace(log_dir)`, the newest one there) saw run, by module name: how often and
    how long on the device. Read from the device-side events JAX's profiler tags with `hlo_module` (one per
    compiled kernel or thunk the program ran); a program whose events carry no such tag is not listed."""
    from torch_tpu._jax import jax

    data = jax.profiler.ProfileData.from_file(latest_trace(log_dir))
    runs: dict[str, set] = {}
    times: dict[str, float] = {}
    for plane in data.planes:
        for line in plane.lines:
            for event in line.events:
                stats = dict(event.stats)
                module = stats.get("hlo_module")
                if not isinstance(module, str):
                    continue
                runs.setdefault(module, set()).add(stats.get("run_id", (plane.name, line.name, event.start_ns)))
                times[module] = times.get(module, 0.0) + float(event.duration_ns)
    return {m: ProgramTime(m, len(runs[m]), times[m]) for m in sorted(runs)}


def _synchronize() -> None:
    if torch.tpu.is_initialized():
        for i in range(torch.tpu.device_count()):
            torch.tpu.synchronize(i)


# ---- the device rows of torch.profiler (ProfilerActivity.PrivateUse1): the Kineto plugin runtime/TpuProfiler.cpp
# calls these three around the profiled region. They run JAX's device trace into a temporary directory and return
# one activity per XLA program execution, on the wall clock Kineto uses.

_KINETO = "torch.profiler.profile (ProfilerActivity.PrivateUse1)"
_device: dict[str, Any] = {}
_CLOCK_MARK = "torch_tpu_profiler_clock"


def _device_session_start() -> None:
    from torch_tpu._jax import jax

    if _active:
        warnings.warn(f"torch.profiler: no tpu device rows in this profile, because a torch.tpu.profiler trace into "
                      f"{_active[0]!r} is running (one device trace per process); that trace has them",
                      stacklevel=2)
        return
    directory = tempfile.mkdtemp(prefix="torch_tpu_profile_")
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    jax.profiler.start_trace(directory, profiler_options=options)
    _active.append(_KINETO)
    # The trace's times count from its own start: one marker whose wall time is known places them on Kineto's clock.
    wall = time.time_ns()
    with jax.profiler.TraceAnnotation(_CLOCK_MARK):
        pass
    _device.update(dir=directory, wall=wall, done=False)


def _device_session_stop() -> None:
    from torch_tpu._jax import jax

    if _device.get("done", True) or _active[:1] != [_KINETO]:
        return
    _device["done"] = True
    try:
        jax.profiler.stop_trace()
    finally:
        _active.clear()


def _device_session_events() -> list[tuple[str, int, int, int, int, list[tuple[str, str]]]]:
    """(program name, start ns, end ns, device, row, metadata) per XLA program execution in the trace, on the
    wall clock: the span from its first to its last device-side event tagged with its `hlo_module` and `run_id`."""
    from torch_tpu._jax import jax

    directory = _device.pop("dir", None)
    if directory is None or not _device.get("done"):
        return []
    try:
        data = jax.profiler.ProfileData.from_file(latest_trace(directory))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    offset = None
    runs: dict[tuple, list] = {}
    rows: dict[str, int] = {}
    for plane in data.planes:
        for line in plane.lines:
            for event in line.events:
                if event.name == _CLOCK_MARK:
                    offset = _device["wall"] - int(event.start_ns)
                    continue
                stats = dict(event.stats)
                module = stats.get("hlo_module")
                if not isinstance(module, str):
                    continue
                device = int(stats.get("device_ordinal", 0))
                key = (module, stats.get("run_id", id(event)), device)
                row = rows.setdefault(line.name, len(rows))
                entry = runs.get(key)
                if entry is None:
                    runs[key] = [int(event.start_ns), int(event.end_ns), row, 1]
                else:
                    entry[0] = min(entry[0], int(event.start_ns))
                    entry[1] = max(entry[1], int(event.end_ns))
                    entry[3] += 1
    if offset is None:
        warnings.warn("torch.profiler: the tpu device trace has no clock marker; its device rows are left out",
                      stacklevel=2)
        return []
    out = []
    for (module, run, device), (start, end, row, kernels) in runs.items():
        meta = [("hlo_module", module), ("run_id", str(run)), ("kernels", str(kernels))]
        out.append((module, start + offset, end + offset, device, row, meta))
    out.sort(key=lambda e: e[1])
    return out
