"""Counters behind `torch.tpu.metrics()`, and the recompilation-storm warning.

Compiles are observed through JAX's own monitoring events (one per XLA compilation, persistent-cache
retrievals included); flushes and fused graphs are counted by torch_tpu/_deferred.py; the persistent cache
counts its hits in torch_tpu.compile_cache; CPU fallbacks are counted in C++ (runtime/TpuFallback.cpp).

A call site (the first frame outside torch, JAX and torch_tpu) whose op or deferred graph keeps compiling for
new input shapes gets one warning naming the shapes that changed (TORCH_TPU_RECOMPILE_WARN=N sets how many
compiles of one op at one site trigger it, default 8; 0 turns it off).
"""

from __future__ import annotations

import collections
import dataclasses
import os
import sys
import threading
import warnings
from typing import Any

_lock = threading.Lock()
_flushes: collections.Counter[str] = collections.Counter()
_counts = {"compiles": 0, "compile_seconds": 0.0, "fused_graph_compiles": 0, "fused_graph_runs": 0,
           "fused_ops": 0, "fused_outputs": 0, "fused_replays": 0, "persistent_cache_hits": 0}
_listening = False

# The doctor's switch (torch_tpu/doctor): None, or an object whose `on_sync(reason)`, `on_compile(what, shapes,
# file, line, seconds)` and `on_trace(seconds)` this module calls with the facts it already computes, so the doctor
# reads the one metrics path instead of instrumenting the runtime a second time. Off (None) it costs one global
# read per host synchronisation and per compile.
observer: Any = None


class RecompilationWarning(UserWarning):
    """The same op or graph at one call site keeps compiling because its input shapes change."""


@dataclasses.dataclass
class Metrics:
    compiles: int  # XLA compilations (persistent-cache retrievals excluded)
    compile_seconds: float  # time in XLA compilation (and cache retrieval)
    persistent_cache_hits: int  # executables loaded from the on-disk cache instead of compiled
    fused_graph_compiles: int  # distinct DEFER_AND_FUSE graphs compiled
    fused_graph_runs: int  # DEFER_AND_FUSE graphs run
    fused_ops: int  # ops recorded into fused graphs
    fused_outputs: int  # values fused graphs materialised (results no tensor refers to any more are not)
    fused_replays: int  # DEFER_AND_FUSE graphs recorded by replaying the trace of an earlier graph to its end
    flushes: dict[str, int]  # DEFER_AND_FUSE flushes by reason
    cpu_fallbacks: dict[str, int]  # ops run through the opt-in CPU fallback, by aten overload

    def __str__(self) -> str:
        lines = [f"{k}: {v}" for k, v in dataclasses.asdict(self).items() if not isinstance(v, dict)]
        lines.append("flushes: " + (", ".join(f"{k}={v}" for k, v in sorted(self.flushes.items())) or "none"))
        lines.append("cpu_fallbacks: " + (", ".join(f"{k}={v}" for k, v in sorted(self.cpu_fallbacks.items()))
                                          or "none"))
        return "\n".join(lines)


def metrics() -> Metrics:
    from torch_tpu import _C

    with _lock:
        c = dict(_counts)
        flushes = dict(_flushes)
        # DEFER_AND_FUSE's one-op segments that ran directly (runtime/TpuMode.cpp), each the one-op flush it
        # stands for
        for reason, n in _C._fuse_direct_ends(False).items():
            flushes[reason] = flushes.get(reason, 0) + n
            for k in ("fused_ops", "fused_graph_runs", "fused_outputs"):
                c[k] += n
    return Metrics(
        compiles=max(0, c["compiles"] - c["persistent_cache_hits"]),
        compile_seconds=round(c["compile_seconds"], 6),
        persistent_cache_hits=c["persistent_cache_hits"],
        fused_graph_compiles=c["fused_graph_compiles"],
        fused_graph_runs=c["fused_graph_runs"],
        fused_ops=c["fused_ops"],
        fused_outputs=c["fused_outputs"],
        fused_replays=c["fused_replays"],
        flushes=flushes,
        cpu_fallbacks=dict(_C._fallback_counts()),
    )


def reset() -> None:
    from torch_tpu import _C

    with _lock:
        for k in _counts:
            _counts[k] = 0.0 if isinstance(_counts[k], float) else 0
        _flushes.clear()
        _C._fuse_direct_ends(True)
        _sites.clear()
        _warned.clear()


def tick(reason: str = "") -> None:
    """A host synchronisation: the end of a step, as far as the recompilation warning is concerned."""
    global epoch
    epoch += 1
    if observer is not None:
        observer.on_sync(reason)


# Flushes the host does not wait for (torch_tpu/_deferred.py runs the graphs as a backward pass or an optimizer
# step ends): not a step's end, nor a synchronization for the doctor.
_NOT_SYNCS = frozenset(("backward_start", "backward_end", "optimizer_step"))


def flush(reason: str, n_ops: int, n_outputs: int, replayed: bool = False) -> None:
    if reason not in _NOT_SYNCS:
        tick(reason)
    with _lock:
        _flushes[reason] += 1
        _counts["fused_ops"] += n_ops
        if replayed:
            _counts["fused_replays"] += 1
        if n_outputs:
            _counts["fused_graph_runs"] += 1
            _counts["fused_outputs"] += n_outputs


def fused_compile() -> None:
    with _lock:
        _counts["fused_graph_compiles"] += 1


def cache_hit() -> None:
    with _lock:
        _counts["persistent_cache_hits"] += 1


# ---- compile events ----

def install_listener() -> None:
    """Registers the JAX monitoring listener (once, when the runtime starts)."""
    global _listening
    if _listening:
        return
    import jax.monitoring

    from jax._src import dispatch

    event_name = dispatch.BACKEND_COMPILE_EVENT
    trace_events = {getattr(dispatch, n) for n in ("JAXPR_TRACE_EVENT", "JAXPR_TO_MLIR_MODULE_EVENT")
                    if hasattr(dispatch, n)}

    def on_duration(event: str, duration: float, **kwargs: Any) -> None:
        if event != event_name:
            if observer is not None and event in trace_events:
                observer.on_trace(duration)
            return
        with _lock:
            _counts["compiles"] += 1
            _counts["compile_seconds"] += duration
        _check_storm(duration)

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    _listening = True


# A warm-up compiles many shapes at one site within one step (an optimizer's parameters); a storm compiles new
# shapes step after step. Steps are counted by host synchronisations (`.item()`, `.cpu()`, synchronize(),
# DEFER_AND_FUSE flushes): a site warns once it compiled new shapes in TORCH_TPU_RECOMPILE_WARN different ones.
epoch = 0
_sites: dict[tuple[str, str], list[Any]] = {}  # (call site, what) -> [epochs with compiles, previous shapes]
_warned: set[tuple[str, str]] = set()
_KERNEL_CODES: set[Any] = set()


def _skip_dirs() -> tuple[str, ...]:
    """Library folders that are not a user's call site: torch, JAX, jaxlib and torch_tpu itself."""
    return tuple(
        os.path.dirname(os.path.abspath(m.__file__)) + os.sep
        for m in (sys.modules.get("torch"), sys.modules.get("jax"), sys.modules.get("jaxlib"))
        if m is not None and getattr(m, "__file__", None)
    ) + tuple(folder + os.sep for folder, _ in sys.modules["torch_tpu"]._SOURCE_FOLDERS)


def _threshold() -> int:
    from torch_tpu import _config

    return _config.get("TORCH_TPU_RECOMPILE_WARN")


def _shapes(values: Any) -> list[Any]:
    out = []
    for v in values:
        shape = getattr(v, "shape", None)
        if shape is not None:
            out.append(tuple(shape))
        elif isinstance(v, (list, tuple)):
            out.append(_shapes(v))
    return out


def _check_storm(seconds: float = 0.0) -> None:
    threshold = _threshold()
    if threshold <= 0 and observer is None:
        return
    what = shapes = None
    site = None
    site_file, site_line = "", 0
    f = sys._getframe(2)
    skip = _skip_dirs()
    while f is not None:
        code = f.f_code
        if what is None:
            if code in _KERNEL_CODES:
                what = f"aten::{f.f_locals['self'].name}"
                shapes = _shapes(f.f_locals.get("args", ()))
            elif code.co_name == "flush" and "g" in f.f_locals and hasattr(f.f_locals["g"], "inputs"):
                what = "the DEFER_AND_FUSE graph"
                shapes = _shapes(f.f_locals["g"].inputs)
        if not code.co_filename.startswith(skip) and not code.co_filename.startswith("<"):
            site = f"{code.co_filename}:{f.f_lineno}"
            site_file, site_line = code.co_filename, f.f_lineno
            break
        f = f.f_back
    if what is None:
        from torch_tpu import _C

        running = _C._eager_running()  # a cache hit of the C++ eager path (runtime/TpuDispatch.cpp) compiling
        if running is not None:
            what, shapes = f"aten::{running[0]}", _shapes(running[1])
    if observer is not None:  # every compile, with its call site and shapes (None: not an op or fused graph)
        observer.on_compile(what, shapes, site_file, site_line, seconds)
    if what is None or site is None or threshold <= 0:
        return
    key = (site, what)
    with _lock:
        entry = _sites.setdefault(key, [set(), None])
        entry[0].add(epoch)
        previous, entry[1] = entry[1], shapes
        fire = len(entry[0]) >= threshold and key not in _warned and previous != shapes
        if fire:
            _warned.add(key)
    if fire:
        warnings.warn_explicit(
            f"torch_tpu: {what} called from {site} compiled again in {len(entry[0])} steps because its input "
            f"shapes keep changing (now {shapes}, before {previous}). Every new shape costs an XLA compilation: pad inputs "
            "to a few fixed sizes (bucketing) or keep shapes static. TORCH_TPU_RECOMPILE_WARN=N sets the "
            "threshold, 0 silences this.",
            RecompilationWarning,
            site_file,  # reported at the user's line, not inside torch_tpu
            site_line,
        )


def register_kernel_code(code: Any) -> None:
    """Frames running this code object are op kernels (`self.name` is the op, `args` its arguments)."""
    _KERNEL_CODES.add(code)
