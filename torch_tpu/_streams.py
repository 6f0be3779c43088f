"""Streams and events of the tpu device: `torch.tpu.Stream/Event` and what the C++ event handles call.

Honest semantics over PJRT (docs/user_guide.md, "Streams and events"). PJRT gives each device one queue: every
tpu op is enqueued asynchronously and XLA runs a program once its input arrays are computed. A stream is
therefore an id with a per-thread current stream (runtime/TpuStream.cpp), not a second queue: streams give no
concurrency, and a wait between streams (`wait_stream`, `wait_event`) needs no device work, because values
flow from op to op through their device arrays, whatever stream issued them; they can never be reordered.

An event record marks the device work enqueued before it: the device arrays of that device still being
computed at the record (weak references: an array nobody holds any more is no observable work) and, under
DEFER_AND_FUSE, the calling thread's pending graph, which is work enqueued before the record too. The record
does not run that graph (events that are only waited on, as FSDP2's and the autograd engine's cross-stream
events, cost no graph break): `query()` and `synchronize()` run it first (flushes with reasons "event_query",
"event_synchronize"), since an unissued graph would never be done. `query()` is True once every marked array
still alive is computed; `synchronize()` waits for them. A timing event (`enable_timing=True`) runs the pending
graph at its record (reason "event_record") and gets a completion time: the host clock when a waiter thread saw
its marked arrays computed (the record time when nothing was pending), in record order, so `elapsed_time` is
the host-observed completion time of the end event minus that of the start event, in milliseconds.
"""

from __future__ import annotations

import atexit
import collections
import threading
import time
import weakref
from typing import Any, Callable

import torch

from torch_tpu import _C, _checks, _deferred, _runtime

# ---- the marks behind the C++ event handles (runtime/TpuEvent.cpp calls these) ----


class _Mark:
    """One record of an event: the device arrays being computed at the record and, for a timing event, when
    they were seen computed."""

    __slots__ = ("device", "pending", "graph", "timing", "t_record", "t_done", "done", "strong", "error",
                 "__weakref__")

    def __init__(self, device: int, pending: list[Any], timing: bool, graph: Any = None) -> None:
        self.device = device
        self.pending = [weakref.ref(a) for a in pending]
        self.graph = None if graph is None else weakref.ref(graph)  # a DEFER_AND_FUSE graph not run yet
        self.timing = timing
        self.t_record = time.perf_counter_ns()
        self.t_done: int | None = None
        self.done: threading.Event | None = threading.Event() if timing else None
        self.strong: list[Any] | None = pending if timing else None  # the waiter's until it stamps
        self.error: BaseException | None = None


# Arrays seen computed (an array stays computed), by id: a weak reference's callback drops the entry when the array
# dies, before its id can be reused. A record then asks is_ready() only of arrays it has not seen computed.
_seen_ready: dict[int, weakref.ref] = {}


def _forget(key: int) -> Callable[[weakref.ref], None]:
    return lambda _ref: _seen_ready.pop(key, None)


def _computing(device: int) -> list[Any]:
    """The device arrays on tpu:`device` that are not computed yet (work enqueued, not finished)."""
    import jax

    seen = _seen_ready
    out = []
    # The arrays of the platform tpu runs on (JAX's default backend may be another one, e.g. TORCH_TPU_PLATFORM=cpu
    # on a TPU host).
    for a in _C._unseen(jax.live_arrays(_runtime.platform()), seen):
        try:
            if a.is_ready():
                seen[id(a)] = weakref.ref(a, _forget(id(a)))
                continue
        except RuntimeError:  # deleted (donated to a later program) meanwhile: that program's outputs stand for it
            continue
        out.append(a)
    if out and len(_runtime.devices()) > 1:  # a.devices() is slow: asked only of the arrays still computing
        dev = _runtime.device(device)
        out = [a for a in out if dev in a.devices()]
    return out


def _still_computing(ref: weakref.ref) -> Any:
    a = ref()
    if a is None:
        return None
    try:
        return None if a.is_ready() else a
    except RuntimeError:  # deleted: donated to a later program, or freed
        return None


def record(device: int, timing: bool) -> _Mark:
    _runtime.check_not_forked()
    if timing:  # a completion time needs the work issued: this thread's pending graph runs now
        _deferred.flush_thread("event_record")
        graph = None
    else:
        graph = _deferred.thread_graph(device)
    mark = _Mark(device, _computing(device), timing, graph)
    if timing:
        _Waiter.stamp(mark)
        _marks[id(mark)] = mark
    return mark


# The timing marks by address: an event's `event_id` is its mark's address (runtime/TpuEvent.cpp), which is how
# Event.elapsed_time finds the end event's mark (PyTorch's own elapsed_time accepts no subclass of torch.Event).
_marks: weakref.WeakValueDictionary[int, _Mark] = weakref.WeakValueDictionary()


def _issue(mark: _Mark, reason: str) -> None:
    """Runs the pending graph the mark covers (if it has not run yet) and marks the arrays it gave."""
    g = None if mark.graph is None else mark.graph()
    if g is not None:
        _deferred.flush(g, reason)  # any thread may: one runs it, the others wait (no-op once it ran)
        mark.pending += [weakref.ref(a) for a in _deferred.graph_values(g)]
    mark.graph = None


def query(mark: _Mark) -> bool:
    if mark.timing:
        assert mark.done is not None
        return mark.done.is_set()
    _issue(mark, "event_query")
    mark.pending = [r for r in mark.pending if _still_computing(r) is not None]
    return not mark.pending


def synchronize(mark: _Mark) -> None:
    _runtime.check_not_forked()
    if mark.timing:
        assert mark.done is not None
        mark.done.wait()
        if mark.error is not None:
            raise mark.error
    else:
        _issue(mark, "event_synchronize")
        for r in mark.pending:
            a = r()
            if a is not None:
                _block(a)
        mark.pending = []
    _checks.raise_pending()  # a synchronization point: an out-of-range index of an earlier op raises here


def elapsed_ms(start: _Mark, end: _Mark) -> float:
    if not (start.timing and end.timing):
        raise ValueError("tpu Event.elapsed_time: both events must be created with enable_timing=True.")
    if start.t_done is None or end.t_done is None:
        raise RuntimeError("tpu Event.elapsed_time: both events must be completed before calculating elapsed "
                           "time; call end_event.synchronize() (or torch.tpu.synchronize()) first.")
    return (end.t_done - start.t_done) / 1e6


def query_device(device: int) -> bool:
    """True when all work enqueued on tpu:`device` (by any stream of any thread) is done. The calling thread's
    pending DEFER_AND_FUSE graph is enqueued first: unissued, it would never be done."""
    _runtime.check_not_forked()
    _deferred.flush_thread("stream_query")
    return not _computing(device)


def _block(a: Any) -> None:
    try:
        a.block_until_ready()
    except RuntimeError:
        if not a.is_deleted():  # donated meanwhile: its work is that program's outputs
            raise


class _Waiter:
    """One daemon thread that stamps timing marks in record order: it waits for a mark's arrays (without the
    GIL) and takes the host clock. Started on the first timing record that finds work still computing; at exit
    it finishes its marks and ends before the interpreter does (a daemon thread still inside a wait of JAX's when
    the interpreter finalizes aborts the process)."""

    cv = threading.Condition()
    queue: collections.deque[_Mark] = collections.deque()
    busy = False
    stopping = False
    thread: threading.Thread | None = None

    @classmethod
    def stamp(cls, mark: _Mark) -> None:
        assert mark.done is not None
        with cls.cv:
            if not mark.strong and not cls.queue and not cls.busy:  # nothing pending: done at the record
                mark.t_done = mark.t_record
                mark.strong = None
                mark.done.set()
                return
            inline = cls.stopping  # at exit: stamped by the recording thread, no new thread
            if not inline:
                cls.queue.append(mark)
                if cls.thread is None or not cls.thread.is_alive():
                    if cls.thread is None:
                        atexit.register(cls._stop)
                    cls.thread = threading.Thread(target=cls._run, name="torch_tpu event timer", daemon=True)
                    cls.thread.start()
                cls.cv.notify()
        if inline:
            cls._wait_and_stamp(mark)

    @classmethod
    def _stop(cls) -> None:
        with cls.cv:
            cls.stopping = True
            cls.cv.notify()
        if cls.thread is not None:
            cls.thread.join()

    @classmethod
    def _run(cls) -> None:
        while True:
            with cls.cv:
                while not cls.queue:
                    if cls.stopping:
                        return
                    cls.cv.wait()
                mark = cls.queue.popleft()
                cls.busy = True
            cls._wait_and_stamp(mark)
            with cls.cv:
                cls.busy = False

    @classmethod
    def _wait_and_stamp(cls, mark: _Mark) -> None:
        for a in mark.strong or ():
            try:
                _block(a)
            except BaseException as e:  # the program failed: synchronize() raises it
                mark.error = e
        t = time.perf_counter_ns()
        mark.t_done = max(t, mark.t_record)
        mark.strong = None
        assert mark.done is not None
        mark.done.set()


# ---- the public classes and functions (torch.tpu.*, modelled on torch.cuda's) ----

def _device_index(device: Any) -> int:
    if device is None:
        return int(_C._current_device())
    if isinstance(device, int):
        return int(_C._current_device()) if device < 0 else device
    d = torch.device(device)
    if d.type != "tpu":
        raise ValueError(f"torch.tpu: expected a tpu device, got {d}")
    return int(_C._current_device()) if d.index is None else d.index


class Stream(torch.Stream):
    """A tpu stream (like `torch.cuda.Stream`): an id with CUDA's API. All streams of a device share its one
    PJRT queue, so they give no concurrency; waits between them never reorder values (module docstring).
    `priority` is accepted and has no effect."""

    def __new__(cls, device: Any = None, priority: int = 0, **kwargs: Any) -> Stream:
        if "stream_id" in kwargs:
            return super().__new__(cls, priority=priority, **kwargs)
        return super().__new__(cls, torch.device("tpu", _device_index(device)), priority=priority)

    def wait_event(self, event: torch.Event) -> None:
        """Makes future work on this stream wait for `event` (no device work: see the module docstring)."""
        event.wait(self)

    def wait_stream(self, stream: torch.Stream) -> None:
        """Makes future work on this stream wait for the work enqueued on `stream` so far."""
        self.wait_event(stream.record_event())

    def record_event(self, event: torch.Event | None = None) -> Event:
        """Records `event` (a new tpu Event when None) on this stream and returns it."""
        if event is None:
            event = Event()
        event.record(self)
        return event  # type: ignore[return-value]

    def __eq__(self, o: object) -> bool:
        return isinstance(o, torch.Stream) and super().__eq__(o)

    def __hash__(self) -> int:
        return hash((self.stream_id, self.device))

    def __repr__(self) -> str:
        return f"<torch.tpu.Stream device={self.device} stream_id={self.stream_id}>"


class Event(torch.Event):
    """A tpu event (like `torch.cuda.Event`): marks the device work enqueued before its record (module
    docstring). `blocking` and `interprocess` are not supported by PJRT."""

    def __new__(cls, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False,
                external: bool = False) -> Event:
        if interprocess:
            raise ValueError("torch.tpu.Event: interprocess events are not supported (PJRT has no IPC event "
                             "handles); share the tensor's values through torch.distributed instead.")
        self = super().__new__(cls, torch.device("tpu", _device_index(None)), enable_timing=enable_timing,
                               blocking=blocking)
        self._enable_timing = enable_timing
        return self

    def record(self, stream: torch.Stream | None = None) -> None:
        """Records the event on `stream` (default: the current tpu stream)."""
        super().record(current_stream() if stream is None else stream)

    def wait(self, stream: torch.Stream | None = None) -> None:
        """Makes future work on `stream` (default: the current tpu stream) wait for this event."""
        super().wait(current_stream() if stream is None else stream)

    def elapsed_time(self, end_event: torch.Event) -> float:
        """Milliseconds from this event's completion to `end_event`'s, both timing events recorded and completed
        (host-observed completion times: see the module docstring)."""
        start, end = _marks.get(self.event_id), _marks.get(end_event.event_id)
        for e, m in ((self, start), (end_event, end)):
            if not getattr(e, "_enable_timing", m is not None):
                raise ValueError("torch.tpu.Event.elapsed_time: both events must be created with argument "
                                 "'enable_timing=True'.")
        if not (self.event_id and end_event.event_id):
            raise ValueError("torch.tpu.Event.elapsed_time: both events must be recorded before calculating "
                             "elapsed time.")
        assert start is not None and end is not None
        if not (query(start) and query(end)):
            raise RuntimeError("torch.tpu.Event.elapsed_time: both events must be completed before calculating "
                               "elapsed time; call end_event.synchronize() (or torch.tpu.synchronize()) first.")
        return elapsed_ms(start, end)

    def __repr__(self) -> str:
        return f"<torch.tpu.Event {self.event_id:#x}>" if self.event_id else "<torch.tpu.Event uninitialized>"


def _wrap(s: torch.Stream) -> Stream:
    return Stream(stream_id=s.stream_id, device_index=s.device_index, device_type=s.device_type)


def current_stream(device: Any = None) -> Stream:
    """The calling thread's current stream on `device` (default: the current tpu device)."""
    return _wrap(torch._C._accelerator_getStream(_device_index(device)))


def default_stream(device: Any = None) -> Stream:
    """The default stream of `device` (stream id 0)."""
    s = torch._C._accelerator_getStream(_device_index(device))
    return Stream(stream_id=0, device_index=s.device_index, device_type=s.device_type)


def set_stream(stream: torch.Stream | None) -> None:
    """Makes `stream` current on its device for the calling thread, and its device the current device (as
    torch.cuda.set_stream). None does nothing."""
    if stream is None:
        return
    torch._C._accelerator_setStream(stream)


class StreamContext:
    """Context manager that makes `stream` current (and its device the current device) for the block, then
    restores the previous streams and device, as torch.cuda.StreamContext. None makes it a no-op."""

    def __init__(self, stream: torch.Stream | None) -> None:
        self.stream = stream
        self.src_prev: Stream | None = None
        self.dst_prev: Stream | None = None

    def __enter__(self) -> None:
        s = self.stream
        if s is None:
            return
        self.src_prev = current_stream()
        if s.device_index != self.src_prev.device_index:  # the target device's stream is restored too
            self.dst_prev = current_stream(s.device_index)
        set_stream(s)

    def __exit__(self, *exc: Any) -> bool:
        if self.stream is None:
            return False
        if self.dst_prev is not None:
            set_stream(self.dst_prev)
        assert self.src_prev is not None
        set_stream(self.src_prev)
        return False


def stream(s: torch.Stream | None) -> StreamContext:
    """`with torch.tpu.stream(s):` runs the block with `s` as the current stream."""
    return StreamContext(s)
