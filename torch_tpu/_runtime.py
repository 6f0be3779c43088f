"""The PJRT runtime behind the tpu device: platform choice, devices, dtype maps, host transfers, sync.

Nothing here runs at `import torch`: the C++ runtime calls `start()` on the first tpu use.
Platform: the TPU when libtpu finds one, else XLA:CPU. TORCH_TPU_PLATFORM=cpu|tpu|cuda forces one;
TORCH_TPU_NUM_DEVICES=N gives N virtual XLA:CPU devices.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Callable

import numpy as np
import torch

from torch_tpu import _config

_lock = threading.RLock()
_configured = False
_devices: list[Any] | None = None
_platform: str | None = None
# True in a child forked after the runtime started: PJRT (its threads, its connections) does not survive
# fork(), so every tpu use there raises instead of hanging (as CUDA does). Checked at the runtime's choke
# points: here (start, device lookup, synchronize), the executors' entries and the C++ storage accessors.
in_bad_fork = False
_fork_hook = False

PLATFORMS = ("cpu", "tpu", "cuda")


# XLA:CPU flags torch_tpu needs, added to XLA_FLAGS before JAX creates a backend (unless XLA_FLAGS sets the flag).
# This jaxlib's XLA:CPU runs max and min reductions as YNNPACK fusions by default ("individual_dot,reduce"), and
# those drop NaNs: jnp.max over 64 rows of 256 with NaNs in every row returned no NaN, so torch.amax / max / min
# returned the largest number where CPU returns nan (a wrong value, silently). Its dot fusions are kept.
XLA_CPU_FLAGS = {"xla_cpu_experimental_ynn_fusion_type": "individual_dot"}


def _add_xla_flags() -> None:
    import warnings

    from jax._src import xla_bridge

    flags = os.environ.get("XLA_FLAGS", "")
    missing = " ".join(f"--{k}={v}" for k, v in XLA_CPU_FLAGS.items() if f"--{k}=" not in flags)
    if not missing:
        return
    if xla_bridge.backends_are_initialized():
        warnings.warn(
            f"torch_tpu: JAX started its backends before torch_tpu, so XLA:CPU runs without {missing}: its max/min "
            "reductions may drop NaNs. Set XLA_FLAGS to include it before the first JAX use.",
            RuntimeWarning, stacklevel=3)
        return
    os.environ["XLA_FLAGS"] = f"{flags} {missing}" if flags else missing


def configure_jax() -> None:
    """Process-wide JAX settings, applied once before JAX creates a backend."""
    global _configured
    if _configured:
        return
    with _lock:
        if _configured:
            return
        from torch_tpu import _topology

        # Before libtpu starts: each torchrun worker on a multi-chip TPU host gets its own chips.
        _topology.apply()
        _add_xla_flags()
        import jax

        # int64 and float64 tensors need JAX's x64 mode.
        jax.config.update("jax_enable_x64", True)
        count = _config.get("TORCH_TPU_NUM_DEVICES")
        if count:
            jax.config.update("jax_num_cpu_devices", count)
        _configured = True


def _pick_devices() -> tuple[str, list[Any]]:
    import jax

    forced = _config.get("TORCH_TPU_PLATFORM")
    if forced:
        if forced not in PLATFORMS:
            raise RuntimeError(
                f"TORCH_TPU_PLATFORM={forced!r} is not one of {', '.join(PLATFORMS)}; unset it to use the TPU "
                "when one is present and XLA:CPU otherwise."
            )
        try:
            devs = jax.local_devices(backend=forced)
        except RuntimeError as e:
            hint = {
                "tpu": "install libtpu (pip install 'torch_tpu[tpu]') on a TPU VM",
                "cuda": "install a CUDA build of jaxlib (pip install 'jax[cuda12]')",
                "cpu": "",
            }[forced]
            raise RuntimeError(f"TORCH_TPU_PLATFORM={forced} but JAX found no {forced} devices ({e}). {hint}") from e
        return forced, devs
    # This process's devices: with jax.distributed (torch_tpu.distributed) jax.devices() spans all processes.
    if _config.get("TORCH_TPU_NUM_DEVICES"):
        return "cpu", jax.local_devices(backend="cpu")
    try:
        return "tpu", jax.local_devices(backend="tpu")
    except RuntimeError:
        return "cpu", jax.local_devices(backend="cpu")


def _after_fork_in_child() -> None:
    global in_bad_fork
    in_bad_fork = True
    from torch_tpu import _C

    _C._mark_bad_fork(str(fork_error()))  # the C++ checks raise the same error


def fork_error() -> RuntimeError:
    return RuntimeError(
        "torch_tpu: cannot re-initialize tpu in a forked subprocess; to use tpu with multiprocessing, you must "
        "use the 'spawn' start method (multiprocessing.set_start_method('spawn'), or DataLoader(..., "
        "multiprocessing_context='spawn')). This process was forked after the tpu runtime started in its "
        "parent, and PJRT does not survive fork(); fork before the first tpu use, or keep tpu work out of the "
        "forked processes."
    )


def check_not_forked() -> None:
    if in_bad_fork:
        raise fork_error()


def start() -> int:
    """Starts the PJRT client; returns the device count. Called by the C++ runtime on first tpu use."""
    global _devices, _platform, _fork_hook
    from torch_tpu import _config

    check_not_forked()
    _config.check()  # bad TORCH_TPU_* values read at `import torch` stop the first (and every) tpu use
    with _lock:
        if _devices is None:
            configure_jax()
            for fn in _before_start:
                fn()
            _platform, _devices = _pick_devices()
            if not _JAX_TO_TORCH:
                _build_dtype_maps()
            from jax._src.array import ArrayImpl

            from torch_tpu import _C, _metrics

            _C._set_dtype_map(dict(_JAX_TO_TORCH))
            _C._set_array_type(ArrayImpl)  # what storages hold when not an executor's placeholder (TpuPython.cpp)
            _metrics.install_listener()
            for fn in _after_start:
                fn()
            if not _fork_hook:  # only now: a child forked before the first tpu use starts its own runtime
                os.register_at_fork(after_in_child=_after_fork_in_child)
                _fork_hook = True
        return len(_devices)


# What runs around the PJRT start, registered by the wiring (torch_tpu/__init__.py) so that this module imports
# nothing above it: before, joining torchrun's JAX world (torch_tpu.distributed); after, the program collector and
# the persistent compilation cache.
_before_start: list[Callable[[], None]] = []
_after_start: list[Callable[[], None]] = []


def on_start(before: Callable[[], None] | None = None, after: Callable[[], None] | None = None) -> None:
    """Runs `before` just before the PJRT client starts (JAX configured, no backend yet) and `after` once it has
    started, in the order registered."""
    if before is not None:
        _before_start.append(before)
    if after is not None:
        _after_start.append(after)


def devices() -> list[Any]:
    if in_bad_fork:
        raise fork_error()
    if _devices is None:
        from torch_tpu import _C

        _C._device_count()  # starts the runtime through the C++ side, which caches the count
    assert _devices is not None
    return _devices


def device(index: int) -> Any:
    return devices()[index]


_index_of: dict[Any, int] = {}


def index_of(arr: Any) -> int:
    """The tpu index of the device holding the (single-device) array `arr`."""
    d = next(iter(arr.devices()))
    i = _index_of.get(d)
    if i is None:
        i = _index_of[d] = devices().index(d)
    return i


def platform() -> str:
    devices()
    assert _platform is not None
    return _platform


# ---- dtypes ----

_TORCH_TO_JAX: dict[torch.dtype, Any] = {}
_JAX_TO_TORCH: dict[Any, torch.dtype] = {}


def _build_dtype_maps() -> None:
    import ml_dtypes

    pairs = [
        (torch.bool, np.bool_),
        (torch.uint8, np.uint8),
        (torch.int8, np.int8),
        (torch.int16, np.int16),
        (torch.int32, np.int32),
        (torch.int64, np.int64),
        (torch.uint16, np.uint16),
        (torch.uint32, np.uint32),
        (torch.uint64, np.uint64),
        (torch.float16, np.float16),
        (torch.float32, np.float32),
        (torch.float64, np.float64),
        (torch.bfloat16, ml_dtypes.bfloat16),
        (torch.complex64, np.complex64),
        (torch.complex128, np.complex128),
        (torch.float8_e4m3fn, ml_dtypes.float8_e4m3fn),
        (torch.float8_e5m2, ml_dtypes.float8_e5m2),
        (torch.float8_e4m3fnuz, ml_dtypes.float8_e4m3fnuz),
        (torch.float8_e5m2fnuz, ml_dtypes.float8_e5m2fnuz),
    ]
    for t, j in pairs:
        jd = np.dtype(j)
        _TORCH_TO_JAX[t] = jd
        _JAX_TO_TORCH[jd] = t


def jax_dtype(dtype: torch.dtype) -> Any:
    if not _TORCH_TO_JAX:
        _build_dtype_maps()
    try:
        return _TORCH_TO_JAX[dtype]
    except KeyError:
        # A RuntimeError, as CPU kernels raise for dtypes they lack (a TypeError would turn `x + 1` into
        # Python's "unsupported operand type(s)").
        names = ", ".join(str(t).removeprefix("torch.") for t in _TORCH_TO_JAX)
        hint = {torch.complex32: " Use torch.complex64 instead (.to(torch.complex64) on CPU first)."}.get(dtype, "")
        raise RuntimeError(f"torch_tpu: dtype {dtype} is not supported on tpu (XLA has no such type). The tpu "
                           f"dtypes are: {names}.{hint}") from None


def torch_dtype(dtype: Any) -> torch.dtype:
    if not _JAX_TO_TORCH:
        _build_dtype_maps()
    try:
        return _JAX_TO_TORCH[np.dtype(dtype)]
    except KeyError:
        raise TypeError(f"torch_tpu: the XLA dtype {dtype} has no torch equivalent") from None


# ---- host transfers ----

_VIEW_AS_INT = {torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.int8, torch.float8_e5m2: torch.int8,
                torch.float8_e4m3fnuz: torch.int8, torch.float8_e5m2fnuz: torch.int8,
                torch.uint16: torch.int16, torch.uint32: torch.int32, torch.uint64: torch.int64}


def host_to_numpy(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor's values (dtypes numpy lacks are reinterpreted, not converted)."""
    t = t.detach().resolve_conj().resolve_neg().contiguous()
    as_int = _VIEW_AS_INT.get(t.dtype)
    if as_int is not None:
        return t.view(as_int).numpy().view(jax_dtype(t.dtype))
    return t.numpy()


def put(arr: np.ndarray, index: int) -> Any:
    """A device array on tpu:`index` with the values of the C-contiguous host array `arr`, which nothing else may
    hold (XLA:CPU can alias it; see upload): what `jax.device_put(arr, device(index))` makes (committed, one device,
    the array's own dtype), through the C++ transfer that `jax.device_put` ends in. jax.device_put's Python path
    around it (argument checks, sharding and copy-semantics dispatch) costs about 70 us per call on this machine
    against about 7 us for the transfer of a small array; every host tensor a program reads (a batch's `.to("tpu")`,
    `torch.tensor(..., device="tpu")`) pays it."""
    fast, shaped, shardings = _put_to or _put_start()
    sharding = shardings.get(index)
    if sharding is None:
        import jax

        sharding = shardings[index] = jax.sharding.SingleDeviceSharding(device(index))
    key = (arr.shape, arr.dtype)
    aval = _avals.get(key)
    if aval is None:
        if len(_avals) >= 4096:
            _avals.clear()
        aval = _avals[key] = shaped(arr.shape, arr.dtype)
    return fast(aval, sharding, [arr], [device(index)], True)


_put_to: tuple = ()  # (xla_client.batched_device_put, core.ShapedArray, {index: SingleDeviceSharding})


def _put_start() -> tuple:
    """put's callables, looked up once (threads racing here each make the same tuple; one is kept)."""
    global _put_to
    from jax._src import core
    from jax._src.lib import xla_client

    _put_to = (xla_client.batched_device_put, core.ShapedArray, {})  # (jaxlib is pinned: tools/requirements.txt)
    return _put_to


_avals: dict[tuple, Any] = {}  # (shape, numpy dtype) -> its jax ShapedArray, for put


def upload(t: torch.Tensor, index: int) -> Any:
    """A device array holding a copy of the CPU tensor `t` on tpu:`index`."""
    # A private host copy first: XLA:CPU aliases suitably aligned host buffers (even with may_alias=False in
    # jax 0.10.2), and torch may later mutate its own memory.
    jax_dtype(t.dtype)  # a dtype tpu lacks fails here, naming it, rather than in numpy
    arr = np.array(host_to_numpy(t), copy=True)
    try:
        return put(arr, index)
    except RuntimeError:  # PJRT's RESOURCE_EXHAUSTED becomes torch.OutOfMemoryError
        from torch_tpu import _memory

        _memory.raise_if_oom(index, f"a transfer of {arr.nbytes} bytes from the host")
        raise


_sync_hooks: tuple = ()  # (_metrics.tick, _checks.raise_pending): what every host read calls first


def _sync_start() -> tuple:
    """host_array's hooks, looked up once (modules above this one: imported when the first value is read)."""
    global _sync_hooks
    from torch_tpu import _checks, _metrics

    _sync_hooks = (_metrics.tick, _checks.raise_pending)
    return _sync_hooks


def host_array(arr: Any) -> np.ndarray:
    """The values of the device array `arr` as a numpy array (waits for it; read-only: it may be JAX's cached host
    copy). A synchronization point: an out-of-range index of an earlier op raises here (torch_tpu/_checks.py).
    `arr` is a concrete array: a value an executor has not computed yet (a DEFER_AND_FUSE placeholder) is resolved
    by the caller first."""
    if not hasattr(arr, "__array__"):
        raise TypeError(f"torch_tpu: internal error: a host read needs a concrete device array, got {arr!r} "
                        "(resolve an executor's placeholder before reading it)")
    tick, raise_pending = _sync_hooks or _sync_start()
    tick()
    try:
        out = np.asarray(arr)
    except RuntimeError:  # PJRT's RESOURCE_EXHAUSTED (of the work that computes it) becomes torch.OutOfMemoryError
        _raise_if_oom(arr)
        raise
    # Then the checks: every program `arr` depends on has finished now, so their errors are all known; the checks
    # of programs still running (which `arr` cannot depend on) stay pending for a later synchronization point.
    raise_pending(computed_only=True)
    return out


def download(arr: Any) -> torch.Tensor:
    """A CPU tensor of its own with the values of the device array `arr` (see host_array)."""
    np_arr = host_array(arr)
    dtype = torch_dtype(np_arr.dtype)
    as_int = _VIEW_AS_INT.get(dtype)
    if as_int is not None:
        np_arr = np_arr.view(jax_dtype(as_int))
    if not np_arr.flags.writeable:
        np_arr = np_arr.copy()
    out = torch.from_numpy(np_arr)
    return out.view(dtype) if as_int is not None else out


def _raise_if_oom(arr: Any) -> None:
    """In an `except` block for waiting on `arr`: PJRT's RESOURCE_EXHAUSTED raised as torch.OutOfMemoryError. An
    asynchronously dispatched program reports its failed allocation when its result is waited for."""
    from torch_tpu import _memory

    _memory.raise_if_oom(index_of(arr), f"the queued work that computes a result of {arr.nbytes} bytes")


def synchronize(index: int | None = None) -> None:
    """Waits for all work queued on tpu devices (or on tpu:`index`) by every thread. Work an executor holds back
    (DEFER_AND_FUSE's pending graphs) is not device work yet: torch.tpu.synchronize issues the calling thread's
    first (torch_tpu/device_module.py), then calls this."""
    if _devices is None:
        return
    check_not_forked()
    import jax

    from torch_tpu import _checks, _metrics

    _metrics.tick()
    want = None if index is None or index < 0 else _devices[index]
    arrays = jax.live_arrays(_platform)  # (tpu's platform: JAX's default backend may be another, as in _streams)
    if want is not None and len(_devices) > 1:
        arrays = [a for a in arrays if want in a.devices()]
    if len(arrays) > 1:
        # One C++ wait for all of them (a Python loop over a model's parameters and optimizer state cost about
        # 1 us per array: 2 ms per synchronize with 2,000 live arrays); if one of them was donated meanwhile (it
        # raises), the loop below tells that apart from a failed program.
        from jax._src.lib import xla_client

        try:
            xla_client.batched_block_until_ready(arrays)
            arrays = ()
        except RuntimeError:
            pass
    for a in arrays:
        try:
            if want is None or want in a.devices():
                a.block_until_ready()
        except RuntimeError:
            # Another thread's program consumed (donated) it meanwhile: its work is that program's outputs.
            if not a.is_deleted():
                _raise_if_oom(a)
                raise
    _checks.raise_pending()  # an out-of-range index of an earlier op raises here (torch_tpu/_checks.py)
