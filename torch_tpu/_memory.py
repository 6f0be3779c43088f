"""Memory statistics and out-of-memory errors of tpu devices (the front of runtime/TpuAllocator.cpp's accounting).

What is counted: every live tpu storage, by its byte size, on its device, from its allocation to its deleter
(runtime/TpuAllocator.cpp). Views share their storage's bytes; an in-place op swaps in an array of the same size.
There is no caching allocator between PyTorch and PJRT, so "allocated", "active" and "requested" bytes are the
same number, and "reserved" is that number again on XLA:CPU (each buffer is its own host allocation). On a
platform whose PJRT client keeps statistics (TPU: `jax.Device.memory_stats()`), reserved current/peak are PJRT's
`bytes_in_use`/`peak_bytes_in_use` (PJRT's peak is the process's: reset_peak_memory_stats cannot reset it).

Out of memory, two ways, both `torch.OutOfMemoryError` counted in `num_ooms`:
- the accounting's limit (TORCH_TPU_MEMORY_LIMIT, or set_per_process_memory_fraction): checked when a storage is
  made, before it holds anything, so nothing leaks (runtime/TpuAllocator.cpp raises it);
- PJRT's own RESOURCE_EXHAUSTED from a transfer or a program run: `oom_error` converts it where the executors call
  into JAX (the eager kernels, the C++ eager cache hit, a fused or compiled graph's run, a host-to-device transfer)
  and, since programs are dispatched asynchronously (XLA:CPU allocates a result when the program runs), where a
  result is waited for (torch_tpu/_runtime.py: synchronize, download).
"""

from __future__ import annotations

import collections
import os
from typing import Any

import torch

from torch_tpu import _C, _config

__all__ = [
    "empty_cache", "get_per_process_memory_fraction", "max_memory_allocated", "max_memory_reserved",
    "mem_get_info", "memory_allocated", "memory_reserved", "memory_stats", "memory_stats_as_nested_dict",
    "memory_summary", "reset_accumulated_memory_stats", "reset_max_memory_allocated", "reset_peak_memory_stats",
    "set_per_process_memory_fraction",
]

_fractions: dict[int, float] = {}  # device -> the fraction set by set_per_process_memory_fraction


def install() -> None:
    """Wires the C++ accounting (torch_tpu/__init__.py, at import): PJRT's statistics callback and the limit."""
    _C._set_memory_info(platform_info)
    _C._set_oom_error(oom_error)
    limit = _config.get("TORCH_TPU_MEMORY_LIMIT")
    if limit is not None:
        _C._set_memory_limit(-1, int(limit), "TORCH_TPU_MEMORY_LIMIT")


def _index(device: Any) -> int:
    if device is None:
        return int(_C._current_device())
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device):
        if device.type != "tpu":
            raise ValueError(f"torch.tpu: expected a tpu device, got {device}")
        return int(_C._current_device()) if device.index is None else int(device.index)
    if isinstance(device, int):
        return device
    raise TypeError(f"torch.tpu: expected a device index, string or torch.device, got {type(device).__name__}")


def _checked(device: Any) -> int:
    idx = _index(device)
    _C._check_device(idx)
    return idx


def _host_memory() -> tuple[int, int]:
    """(available, total) bytes of host memory: what XLA:CPU's buffers come from."""
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.split()[1:]}
        return info["MemAvailable"], info["MemTotal"]
    except (OSError, KeyError, ValueError):
        page = os.sysconf("SC_PAGE_SIZE")
        return page * os.sysconf("SC_AVPHYS_PAGES"), page * os.sysconf("SC_PHYS_PAGES")


def _pjrt_stats(index: int) -> dict[str, int] | None:
    from torch_tpu import _runtime

    try:
        stats = _runtime.device(index).memory_stats()
    except Exception:  # noqa: BLE001 - platforms without statistics raise or return None (XLA:CPU)
        return None
    return stats if stats and "bytes_in_use" in stats else None


def platform_info(index: int) -> tuple[int | None, int | None, int, int]:
    """(reserved bytes, reserved peak, free bytes, total bytes) of tpu:index as its platform reports them;
    reserved is None where PJRT keeps no statistics (XLA:CPU: free/total are the host's memory)."""
    stats = _pjrt_stats(index)
    if stats is None:
        free, total = _host_memory()
        return None, None, free, total
    total = int(stats.get("bytes_limit", 0)) or _host_memory()[1]
    used = int(stats["bytes_in_use"])
    return used, int(stats.get("peak_bytes_in_use", used)), max(total - used, 0), total


# ---- statistics (CUDA's names: torch.cuda.memory_stats) ----

def memory_stats_as_nested_dict(device: Any = None) -> dict[str, Any]:
    """The statistics as nested dicts ({"allocated_bytes": {"all": {"current": ...}}}), {} before the first
    tpu use (as torch.cuda before its first use)."""
    if not _C._runtime_started():
        return {}
    return _C._memory_stats(_checked(device))


def memory_stats(device: Any = None) -> collections.OrderedDict[str, Any]:
    """torch.cuda.memory_stats's dictionary for tpu: "allocated_bytes.all.current", "active_bytes.all.peak",
    "reserved_bytes.all.current", "requested_bytes.all.allocated", "allocation.all.freed", "num_ooms", ...,
    sorted by key. See the module doc for what each counts on tpu."""
    flat: list[tuple[str, Any]] = []

    def flatten(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                flatten(f"{prefix}.{k}" if prefix else k, v)
        else:
            flat.append((prefix, value))

    flatten("", memory_stats_as_nested_dict(device))
    flat.sort()
    return collections.OrderedDict(flat)


def memory_allocated(device: Any = None) -> int:
    """Bytes held by live tpu storages on the device (views count nothing of their own)."""
    return memory_stats(device).get("allocated_bytes.all.current", 0)


def max_memory_allocated(device: Any = None) -> int:
    """Peak of memory_allocated since the start or reset_peak_memory_stats."""
    return memory_stats(device).get("allocated_bytes.all.peak", 0)


def memory_reserved(device: Any = None) -> int:
    """Device memory in use by this process: PJRT's bytes_in_use where it reports it (TPU), else (XLA:CPU) the
    same as memory_allocated."""
    return memory_stats(device).get("reserved_bytes.all.current", 0)


def max_memory_reserved(device: Any = None) -> int:
    return memory_stats(device).get("reserved_bytes.all.peak", 0)


def reset_peak_memory_stats(device: Any = None) -> None:
    """Peaks start again from the current values (PJRT's own peak, reserved on TPU, is not resettable)."""
    _C._reset_peak_memory_stats(_checked(device))


def reset_accumulated_memory_stats(device: Any = None) -> None:
    """The "allocated"/"freed" totals and the event counters (num_ooms, ...) start again from 0."""
    _C._reset_accumulated_memory_stats(_checked(device))


def reset_max_memory_allocated(device: Any = None) -> None:
    """As torch.cuda.reset_max_memory_allocated: resets every peak (reset_peak_memory_stats)."""
    reset_peak_memory_stats(device)


def mem_get_info(device: Any = None) -> tuple[int, int]:
    """(free, total) bytes of the device: PJRT's bytes_limit minus bytes_in_use on TPU; the host's available and
    total memory on XLA:CPU (its buffers are host memory)."""
    _, _, free, total = platform_info(_checked(device))
    return free, total


def empty_cache() -> None:
    """Nothing to release: a tpu storage gives its device buffer back to PJRT when it dies; no cache of freed
    blocks is kept in between (PJRT's own allocator is not reachable from here)."""


def set_per_process_memory_fraction(fraction: float, device: Any = None) -> None:
    """Limits what live tpu storages may hold on the device to `fraction` of its total memory (mem_get_info's
    total); an allocation past it raises torch.OutOfMemoryError. The limit is this backend's accounting (a TPU's
    PJRT allocator has its own, the chip's memory); a fraction of 1 removes it (also TORCH_TPU_MEMORY_LIMIT's)."""
    idx = _checked(device)
    if not isinstance(fraction, float | int) or not 0 <= fraction <= 1:
        raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
    total = platform_info(idx)[3]
    _fractions[idx] = float(fraction)
    if fraction >= 1:  # the whole device: no limit of ours (PJRT's allocator has the device's own)
        _C._set_memory_limit(idx, -1, "")
        return
    _C._set_memory_limit(idx, int(total * fraction),
                         f"torch.tpu.set_per_process_memory_fraction({fraction}) of {total} bytes")


def get_per_process_memory_fraction(device: Any = None) -> float:
    """The fraction set by set_per_process_memory_fraction (1.0 when none was)."""
    return _fractions.get(_index(device), 1.0)


# ---- out of memory reported by PJRT ----

def _is_resource_exhausted(e: BaseException) -> bool:
    return isinstance(e, RuntimeError) and type(e).__name__ in ("JaxRuntimeError", "XlaRuntimeError") and \
        str(e).lstrip().startswith("RESOURCE_EXHAUSTED")


def oom_error(e: BaseException, index: int, what: str) -> BaseException | None:
    """torch.OutOfMemoryError for PJRT's RESOURCE_EXHAUSTED `e` (counted in num_ooms of tpu:index), else None.
    `what` says what ran (an op name, "a transfer of 4.00 MiB", ...). Raise it `from e`."""
    if not _is_resource_exhausted(e):
        return None
    if index < 0:
        index = int(_C._current_device())
    _C._count_oom(index)
    held = _C._memory_stats(index)["allocated_bytes"]["all"]["current"]
    detail = str(e).strip().splitlines()[0].rstrip(".")
    return torch.OutOfMemoryError(
        f"tpu out of memory running {what} on tpu:{index}: PJRT reported {detail}. "
        f"{held / (1 << 20):.2f} MiB are allocated by live tpu tensors (torch.tpu.memory_allocated), "
        f"{(platform_info(index)[3]) / (1 << 20):.2f} MiB is the device's total. Free tensors you no longer need "
        "(del them, drop references such as stored losses or outputs), or use smaller batches; "
        "torch.tpu.memory_summary() shows what is held.")


def raise_if_oom(index: int, what: str) -> None:
    """Inside an `except` block: raises torch.OutOfMemoryError from the exception being handled when it is PJRT's
    RESOURCE_EXHAUSTED (the caller re-raises the original otherwise). The C++ eager path calls it too."""
    import sys

    e = sys.exc_info()[1]
    oom = oom_error(e, index, what) if e is not None else None
    if oom is not None:
        raise oom from e


# ---- the summary (torch.cuda.memory_summary's layout) ----

def _fmt_bytes(n: int) -> str:
    for unit in ("B  ", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 * 10 or unit == "TiB":
            return f"{n:6d} {unit}"
        n //= 1024
    return f"{n:6d} TiB"


def _fmt_count(n: int) -> str:
    for unit in (" ", "K", "M"):
        if abs(n) < 1000 * 10 or unit == "M":
            return f"{n:7d} {unit}"
        n //= 1000
    return f"{n:7d} M"


def memory_summary(device: Any = None, abbreviated: bool = False) -> str:
    """A table of the statistics, as torch.cuda.memory_summary prints it."""
    idx = _index(device)
    stats = memory_stats(idx)
    rule = "=" * 75
    thin = "-" * 75
    lines = [rule, " {:^73} ".format("PyTorch tpu memory summary, device ID " + str(idx)), thin,
             "  tpu OOMs: {:<12d}  |  alloc retries: {:<8d} (no caching allocator)".format(
                 stats.get("num_ooms", 0), stats.get("num_alloc_retries", 0)),
             rule, "        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  ", thin]
    rows = [("allocated_bytes", "Allocated memory", _fmt_bytes), ("active_bytes", "Active memory", _fmt_bytes),
            ("requested_bytes", "Requested memory", _fmt_bytes), ("reserved_bytes", "tpu reserved memory", _fmt_bytes),
            ("allocation", "Allocations", _fmt_count), ("active", "Active allocs", _fmt_count),
            ("segment", "tpu reserved segments", _fmt_count)]
    pools = ("all",) if abbreviated else ("all", "large_pool", "small_pool")
    for key, name, fmt in rows:
        for pool in pools:
            label = name if pool == "all" else "      from " + pool.replace("_pool", " pool")
            vals = [stats.get(f"{key}.{pool}.{m}", 0) for m in ("current", "peak", "allocated", "freed")]
            lines.append(" {:<21} | {} | {} | {} | {} ".format(label, *(fmt(v) for v in vals)))
        lines.append(thin)
    limit = int(_C._memory_limit(idx))
    lines.append(" limit (TORCH_TPU_MEMORY_LIMIT / set_per_process_memory_fraction): "
                 + ("none" if limit < 0 else _fmt_bytes(limit).strip()))
    lines.append(rule)
    return "|" + "|\n|".join(lines) + "|\n"
