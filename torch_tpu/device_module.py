"""`torch.tpu`: the device module of the tpu backend (the public API, modelled on `torch.cuda`)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Any, Iterator

import torch

from torch_tpu import _C, _deferred, _metrics, _rng, _runtime, compile_cache
from torch_tpu._deferred import EagerMode
from torch_tpu._metrics import RecompilationWarning

__all__ = [
    "device", "device_count", "current_device", "set_device", "is_available", "is_initialized", "synchronize",
    "get_device_name", "get_device_properties", "manual_seed", "manual_seed_all", "seed", "seed_all",
    "initial_seed", "get_rng_state", "set_rng_state", "get_rng_state_all", "set_rng_state_all",
    "default_generators", "get_amp_supported_dtype", "is_bf16_supported", "set_cpu_fallback",
    "fallback_report", "platform", "memory_allocated", "live_storages", "EagerMode", "eager_mode",
    "set_eager_mode", "set_default_eager_mode", "default_eager_mode", "metrics", "reset_metrics",
    "compile_cache", "RecompilationWarning",
]

DeviceLike = int | str | torch.device | None


def _index(d: DeviceLike, optional: bool = True) -> int:
    """The device index of `d` (current device when None or a bare 'tpu')."""
    if d is None:
        return _C._current_device()
    if isinstance(d, str):
        d = torch.device(d)
    if isinstance(d, torch.device):
        if d.type != "tpu":
            raise ValueError(f"Expected a tpu device, but got: {d}")
        return _C._current_device() if d.index is None else d.index
    if isinstance(d, int):
        return d
    raise TypeError(f"torch.tpu: expected a device index, string or torch.device, got {type(d).__name__}")


def is_available() -> bool:
    """True when at least one tpu device exists (a TPU, or XLA:CPU when no TPU is present). A bad TORCH_TPU_*
    value raises here rather than sending a `"tpu" if is_available() else "cpu"` script to the CPU."""
    from torch_tpu import _config

    _config.check()
    try:
        return device_count() > 0
    except RuntimeError:
        return False


def is_initialized() -> bool:
    """True once the PJRT client has started (it starts on the first tpu use, not at import)."""
    return bool(_C._runtime_started())


def _is_in_bad_fork() -> bool:
    """True in a child forked after the tpu runtime started in its parent (tpu use raises there), as
    torch.cuda._is_in_bad_fork."""
    return _runtime.in_bad_fork


def _lazy_init() -> None:
    _C._device_count()


def device_count() -> int:
    return int(_C._device_count())


def current_device() -> int:
    return int(_C._current_device())


def set_device(d: DeviceLike) -> None:
    """Sets the current tpu device of this thread. Raises for an index out of range."""
    idx = _index(d)
    if idx >= 0:
        _C._set_device(idx)


class device:
    """Context manager that changes the current tpu device (like `torch.cuda.device`)."""

    def __init__(self, d: DeviceLike) -> None:
        self.idx = -1 if d is None else _index(d)
        self.prev = -1

    def __enter__(self) -> None:
        self.prev = _C._current_device()
        if self.idx >= 0:
            _C._set_device(self.idx)

    def __exit__(self, *exc: Any) -> bool:
        if self.idx >= 0:
            _C._set_device(self.prev)
        return False


class device_of(device):
    """Context manager that makes the device of tensor `obj` current."""

    def __init__(self, obj: torch.Tensor) -> None:
        super().__init__(obj.get_device() if obj.device.type == "tpu" else None)


def synchronize(d: DeviceLike = None) -> None:
    """Waits until all queued work on the tpu device (default: the current one) has finished."""
    if not is_initialized():
        return
    _synchronize(_index(d))


def _synchronize(index: int) -> None:
    """The synchronization point of the front (torch.tpu.synchronize, and the C++ device guard's
    synchronizeDevice, wired in torch_tpu/__init__.py): the calling thread's pending graphs become device work,
    then the runtime waits for the device work of every thread (other threads' graphs are theirs to run)."""
    _runtime.check_not_forked()
    _deferred.flush_thread("synchronize")
    _runtime.synchronize(index)


def platform() -> str:
    """The PJRT platform that really runs tpu tensors: 'tpu', 'cpu' (XLA:CPU) or 'cuda'."""
    return _runtime.platform()


_PLATFORM_NAMES = {"cpu": "XLA:CPU", "tpu": "TPU", "cuda": "CUDA"}


def get_device_name(d: DeviceLike = None) -> str:
    """The device's name and the platform that really runs it, e.g. 'TPU v5 lite (tpu)' or 'XLA:CPU (cpu)'."""
    dev = _runtime.device(_checked(d))
    kind = dev.device_kind
    plat = _runtime.platform()
    if plat == "cpu":
        kind = "XLA:CPU"
    return f"{kind} ({plat})"


@dataclasses.dataclass(frozen=True)
class _TpuDeviceProperties:
    name: str
    platform: str
    device_kind: str
    index: int
    total_memory: int
    process_index: int
    # CUDA's name for the compute units a kernel spreads over; Inductor reads it for any device (its reduction
    # split heuristic, torch/_inductor/runtime/hints.py): the TensorCores PJRT drives as this device.
    multi_processor_count: int = 1

    def __repr__(self) -> str:
        return (f"_TpuDeviceProperties(name='{self.name}', platform='{self.platform}', "
                f"total_memory={self.total_memory // (1024 * 1024)}MB, index={self.index})")


def _checked(d: DeviceLike) -> int:
    idx = _index(d)
    _C._check_device(idx)
    return idx


def get_device_properties(d: DeviceLike = None) -> _TpuDeviceProperties:
    idx = _checked(d)
    dev = _runtime.device(idx)
    total = 0
    try:
        stats = dev.memory_stats() or {}
        total = int(stats.get("bytes_limit", 0))
    except Exception:  # XLA:CPU has no memory stats
        total = 0
    if not total:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return _TpuDeviceProperties(
        name=get_device_name(idx), platform=_runtime.platform(), device_kind=dev.device_kind,
        index=idx, total_memory=total, process_index=int(getattr(dev, "process_index", 0)),
        multi_processor_count=int(getattr(dev, "num_cores", 1) or 1),
    )


# ---- RNG ----

def __getattr__(name: str) -> Any:
    if name == "default_generators":  # (kept by the RNG module, torch_tpu/_rng.py, which random kernels use)
        return _rng.default_generators()
    if name == "doctor":  # torch.tpu.doctor: imported on first use (a top layer; nothing below imports it)
        import importlib

        return importlib.import_module("torch_tpu.doctor")
    raise AttributeError(f"module 'torch.tpu' has no attribute '{name}'")


def manual_seed(seed: int) -> None:
    """Seeds the current tpu device's default generator."""
    _rng.default_generators()[current_device()].manual_seed(int(seed))


def manual_seed_all(seed: int) -> None:
    """Seeds every tpu device's default generator (torch.manual_seed calls this)."""
    for g in _rng.default_generators():
        g.manual_seed(int(seed))


def seed() -> None:
    _rng.default_generators()[current_device()].seed()


def seed_all() -> None:
    s = _rng.default_generators()[0].seed()
    for g in _rng.default_generators()[1:]:
        g.manual_seed(s)


def initial_seed() -> int:
    return _rng.default_generators()[current_device()].initial_seed()


def get_rng_state(d: DeviceLike = "tpu") -> torch.Tensor:
    return _rng.default_generators()[_checked(d)].get_state()


def set_rng_state(new_state: torch.Tensor, d: DeviceLike = "tpu") -> None:
    _rng.default_generators()[_checked(d)].set_state(new_state)


def get_rng_state_all() -> list[torch.Tensor]:
    return [g.get_state() for g in _rng.default_generators()]


def set_rng_state_all(new_states: list[torch.Tensor]) -> None:
    for g, s in zip(_rng.default_generators(), new_states):
        g.set_state(s)


# ---- AMP ----

def get_amp_supported_dtype() -> list[torch.dtype]:
    return [torch.bfloat16, torch.float16, torch.float32]


def is_bf16_supported(including_emulation: bool = True) -> bool:
    return True


# ---- streams and events (torch_tpu/_streams.py; semantics: docs/user_guide.md, "Streams and events") ----

from torch_tpu._streams import (  # noqa: E402
    Event, Stream, StreamContext, current_stream, default_stream, set_stream, stream,
)

__all__ += ["Event", "Stream", "StreamContext", "current_stream", "default_stream", "set_stream", "stream"]


# ---- missing operators ----

def set_cpu_fallback(enabled: bool) -> None:
    """Opt in to running operators that have no tpu kernel on the CPU (warns once per op, counts uses)."""
    _C._set_fallback_mode(1 if enabled else 0)


def fallback_report(reset: bool = False) -> dict[str, int]:
    """{aten overload: times it ran on CPU through the opt-in fallback}, most used first."""
    counts = dict(sorted(_C._fallback_counts(), key=lambda kv: (-kv[1], kv[0])))
    if reset:
        _C._reset_fallback_counts()
    return counts


@contextlib.contextmanager
def cpu_fallback(enabled: bool = True) -> Iterator[None]:
    """Context manager form of set_cpu_fallback."""
    prev = _C._fallback_mode()
    _C._set_fallback_mode(1 if enabled else 0)
    try:
        yield
    finally:
        _C._set_fallback_mode(prev)


# ---- memory ----

def live_storages() -> int:
    """Number of live tpu storages (device arrays owned by tensors) in this process."""
    return int(_C._live_buffers())


# Memory statistics with CUDA's names, limits and torch.OutOfMemoryError (torch_tpu/_memory.py; the C++
# accounting is runtime/TpuAllocator.cpp's, which torch.accelerator.memory_* read too).
from torch_tpu._memory import (  # noqa: E402
    empty_cache,
    get_per_process_memory_fraction,
    max_memory_allocated,
    max_memory_reserved,
    mem_get_info,
    memory_allocated,
    memory_reserved,
    memory_stats,
    memory_stats_as_nested_dict,
    memory_summary,
    reset_accumulated_memory_stats,
    reset_max_memory_allocated,
    reset_peak_memory_stats,
    set_per_process_memory_fraction,
)

__all__ += [
    "empty_cache", "get_per_process_memory_fraction", "max_memory_allocated", "max_memory_reserved",
    "mem_get_info", "memory_reserved", "memory_stats", "memory_stats_as_nested_dict", "memory_summary",
    "reset_accumulated_memory_stats", "reset_max_memory_allocated", "reset_peak_memory_stats",
    "set_per_process_memory_fraction",
]


# ---- execution modes and metrics ----

def _get_eager_mode() -> EagerMode:
    return EagerMode(_deferred.mode_now())


class set_eager_mode:
    """Sets the calling thread's own mode to `mode` (an EagerMode or its name), as torch.set_grad_enabled sets grad
    mode: used as `with torch.tpu.set_eager_mode(mode):` the block runs in `mode` and the thread's previous mode comes
    back when it ends; called on its own, the thread keeps `mode` as its own (in the main thread too, where assigning
    `torch.tpu.eager_mode` sets the process default instead, and clears this). The mode changes when this is called, not
    when the block is entered: as a bare generator-based context manager, a plain call silently changed nothing, and a
    loop meant for DEFER_AND_FUSE ran op by op. The thread's pending DEFER_AND_FUSE work runs when it leaves
    DEFER_AND_FUSE."""

    __slots__ = ("_own",)

    def __init__(self, mode: EagerMode | str) -> None:
        self._own = _deferred.set_thread_mode(mode)

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        _deferred.restore_thread_mode(self._own)


def set_default_eager_mode(mode: EagerMode | str) -> EagerMode:
    """Sets the process default mode, which threads without a mode of their own run in (new threads, and the
    main thread unless set_eager_mode gave it a mode of its own); returns the previous default. TORCH_TPU_EAGER_MODE
    sets it at start-up."""
    return _deferred.set_default_mode(mode)


def default_eager_mode() -> EagerMode:
    """The process default mode (see set_default_eager_mode)."""
    return EagerMode(_C._default_mode())


def metrics() -> _metrics.Metrics:
    """Counters since start (or reset_metrics()): XLA compiles and their time, persistent-cache hits, fused
    graphs compiled and run, DEFER_AND_FUSE flushes by reason, CPU fallbacks by op."""
    return _metrics.metrics()


def reset_metrics() -> None:
    _metrics.reset()
    _C._reset_fallback_counts()


class _DeviceModule(type(contextlib)):  # the module type, with `eager_mode` as a settable property
    @property
    def eager_mode(self) -> EagerMode:
        """The calling thread's execution mode: `torch.tpu.eager_mode = torch.tpu.EagerMode.DEFER_AND_FUSE`.
        Assigned in the main thread it sets the process default (what every thread without a mode of its own
        runs in); assigned in another thread, that thread's own mode. Backward runs in the mode of the thread
        that called it."""
        return _get_eager_mode()

    @eager_mode.setter
    def eager_mode(self, mode: EagerMode | str) -> None:
        _deferred.set_mode(mode)


import sys as _sys  # noqa: E402

_sys.modules[__name__].__class__ = _DeviceModule

# ---- profiling: torch.tpu.profiler (device traces of the XLA programs; torch_tpu/_profiler.py) ----
from torch_tpu import _profiler as profiler  # noqa: E402

# ---- the JAX bridge: torch.tpu.jax_op (torch_tpu/_jax_op.py) ----
__all__ += ["jax_op"]


def jax_op(fn: Any = None, **kwargs: Any) -> Any:
    """A JAX (or Pallas) function as a torch custom op on tpu tensors: `torch.tpu.jax_op(fn)` or
    `@torch.tpu.jax_op(name=..., static_argnames=..., backward=...)`; see torch_tpu/_jax_op.py and the user guide,
    "Calling JAX and Pallas from torch"."""
    from torch_tpu._jax_op import jax_op as make

    return make(fn, **kwargs)

# ---- custom ops: torch.tpu.ops (torch_tpu/ops.py: paged attention, grouped matmul) ----
__all__ += ["ops"]
from torch_tpu import ops  # noqa: E402

# ---- graph capture and replay: torch.tpu.TPUGraph, torch.tpu.graph (torch_tpu/_graphs.py; CUDA graphs' API) ----
__all__ += ["TPUGraph", "graph", "is_current_stream_capturing", "graphs"]
from torch_tpu import _graphs as graphs  # noqa: E402
from torch_tpu._graphs import TPUGraph, graph, is_current_stream_capturing  # noqa: E402
