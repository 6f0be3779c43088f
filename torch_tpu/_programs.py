"""How many compiled programs a process keeps alive: bounded by the memory mappings it may still make.

XLA:CPU JIT-compiles each kernel of an executable into mappings of its own (code, read-only data, data: about
three per kernel, so 10 to 60 for one eager program), and an executable lives as long as a cache holds it:
JAX's per-function jit caches (the per-op callables of torch_tpu/_eager.py, the storage readers and writers,
the random samplers, one per shape), and the fused programs of _deferred. A process that compiles thousands of
programs (PyTorch's own test/test_view_ops.py run whole against tpu) reaches the kernel's limit on mappings per
process (`vm.max_map_count`, 65530 by default); LLVM's next mapping then fails ("LLVM compilation error: Cannot
allocate memory") and XLA crashes with a segfault inside the compile.

So compiled programs are collected like garbage. Every XLA compilation (JAX's backend-compile event, loads from
the persistent cache included) is counted, and every so many compiles (more often as the limit nears) the
process's mappings are counted. When less than a quarter of the limit is left, the next safe point waits for
queued device work and drops every compiled program from memory: JAX's caches (`jax.clear_caches()`) and the
fused programs. Programs still in use compile again on their next call (from the persistent compile cache when
it is on). The safe point is the C++ accessor that stores an op's result (`_C._wrap`, `_set_array`,
`_set_whole`), reached after the JAX call that made the result returned: no JAX cache is cleared while one of
its own calls runs (the compile listener itself runs inside one).
"""

from __future__ import annotations

import threading
from typing import Any, Callable

_lock = threading.Lock()
_installed = False
# Compiled programs an executor keeps in a cache of its own (DEFER_AND_FUSE's fused programs): each registers the
# function that drops them (`register_cache`, wired in torch_tpu/__init__.py), so this runtime module imports no
# executor.
_executor_caches: list[Callable[[], None]] = []


def register_cache(clear: Callable[[], None]) -> None:
    """`clear()` drops an executor's own compiled programs; a collection calls it before clearing JAX's caches."""
    _executor_caches.append(clear)

# Mappings per compile assumed when spacing the checks: pessimistic (one large fused program of ~130 kernels),
# so a check comes before the headroom can be used up.
_WORST_MAPS_PER_COMPILE = 400
_MAX_INTERVAL = 256  # compiles between two checks at most


class _State:
    limit = 65530  # vm.max_map_count
    headroom = 65530 // 4  # collect when fewer mappings than this are left
    since_check = 0  # compiles since the mappings were last counted
    interval = 1  # compiles between two counts
    after_collect = 0  # mappings counted right after the last collection
    collections = 0
    compiles = 0


state = _State()


def _max_map_count() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return max(1024, int(f.read().strip()))
    except (OSError, ValueError):
        return 0  # not Linux (or no procfs): nothing to watch


def mappings() -> int:
    """Memory mappings this process holds now (lines of /proc/self/maps); 0 where that is not available."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return f.read().count(b"\n")
    except OSError:
        return 0


def set_limit(limit: int, headroom: int | None = None) -> None:
    """Sets the mapping limit watched (default: vm.max_map_count) and the headroom below it that triggers a
    collection (default: a quarter of the limit). For tests; the next compile counts again."""
    with _lock:
        state.limit = limit
        state.headroom = headroom if headroom is not None else limit // 4
        state.interval = 1
        state.since_check = 0


def _on_compile() -> None:
    """Called after every XLA compilation (inside JAX's compile path: only decides, never collects here)."""
    with _lock:
        state.compiles += 1
        state.since_check += 1
        if state.since_check < state.interval or state.limit <= 0:
            return
        state.since_check = 0
        used = mappings()
        free = state.limit - used
        reserve = state.headroom // 8
        # Collect once less than the headroom is left and this process's compiles since the last collection hold a
        # good part of it (else the mappings are someone else's: collecting again would only recompile); collect
        # anyway when only the last reserve is left.
        due = (free < state.headroom and used - state.after_collect > state.headroom // 2) or free < reserve
        state.interval = max(1, min(_MAX_INTERVAL, (free - reserve) // _WORST_MAPS_PER_COMPILE))
    if due:
        from torch_tpu import _C

        _C._set_collect_due()


def note_loaded() -> None:
    """Called when an executable is loaded whole from the compile cache (no compile event): counted as a compile."""
    _on_compile()


def collect() -> None:
    """Drops every compiled program from memory (run by the C++ accessors at a safe point once a collection is
    due; callable directly). Queued device work is waited for first."""
    import jax

    from jax._src import core

    if not core.trace_state_clean():  # inside a trace (torch.compile lowering): not a safe point
        from torch_tpu import _C

        _C._set_collect_due()
        return
    for a in jax.live_arrays():
        if not a.is_deleted():  # another thread's program may have consumed (donated) it meanwhile
            try:
                a.block_until_ready()
            except RuntimeError:
                if not a.is_deleted():
                    raise
    for clear in _executor_caches:
        clear()  # compiled fused graphs hold their executables directly
    jax.clear_caches()
    with _lock:
        state.collections += 1
        state.after_collect = mappings()
        state.since_check = 0
        free = state.limit - state.after_collect
        state.interval = max(1, min(_MAX_INTERVAL, (free - state.headroom // 8) // _WORST_MAPS_PER_COMPILE))
        limit = state.limit
    if free < state.headroom // 8:
        raise RuntimeError(
            f"torch_tpu: this process holds {limit - free} of the {limit} memory mappings the kernel allows it "
            "(vm.max_map_count), even with every compiled program dropped; XLA would crash compiling the next "
            "program. Raise the limit (sudo sysctl -w vm.max_map_count=262144) or map fewer files/threads."
        )


def install() -> None:
    """Registers the compile listener and the collector (once, when the runtime starts)."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
        state.limit = _max_map_count()
        state.headroom = state.limit // 4
    import jax.monitoring

    from jax._src import dispatch

    from torch_tpu import _C

    event_name = dispatch.BACKEND_COMPILE_EVENT

    def on_duration(event: str, duration: float, **kwargs: Any) -> None:
        if event == event_name:
            _on_compile()

    _C._set_collector(collect)
    jax.monitoring.register_event_duration_secs_listener(on_duration)
