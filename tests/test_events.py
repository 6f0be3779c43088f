"""Events (CUDA's API, torch.Event("tpu")): query is False while the work recorded before it computes and True
after, synchronize waits for it, elapsed_time is positive and ordered, a re-record marks the new work, a
DEFER_AND_FUSE record issues the pending graph, and the errors CUDA's events raise. Semantics over PJRT:
docs/user_guide.md, "Streams and events"."""

from __future__ import annotations

import pytest
import torch

EagerMode = torch.tpu.EagerMode


@pytest.fixture(autouse=True)
def _restore():
    yield
    torch.tpu.set_stream(torch.tpu.default_stream())
    torch.tpu.eager_mode = EagerMode.DEFER_NEVER


def _long_work(n: int = 12) -> torch.Tensor:
    """Device work of a few hundred milliseconds on XLA:CPU (dispatched asynchronously)."""
    a = torch.randn(768, 768, device="tpu") / 30
    for _ in range(n):
        a = torch.tanh(a @ a)
    return a


@pytest.fixture(scope="module", autouse=True)
def _compiled():
    _long_work().cpu()  # compiled once, so a later run only enqueues work


def test_query_false_then_true_and_synchronize() -> None:
    e = torch.tpu.Event()
    assert e.query()  # never recorded: True, as CUDA's
    e.synchronize()  # and a no-op
    y = _long_work()
    e.record()
    assert not e.query()  # the matmuls recorded before it are still computing
    e.synchronize()
    assert e.query() and e.query()  # True from then on
    assert torch.tpu.current_stream().query()  # nothing else was enqueued: the device is idle
    expect = y.cpu()
    assert torch.isfinite(expect).all()


def test_event_sees_only_work_before_its_record() -> None:
    e = torch.tpu.Event()
    e.record()  # nothing computing yet
    _long_work()
    assert e.query()  # work enqueued after the record is not the event's
    torch.tpu.synchronize()


def test_rerecord_marks_the_new_work() -> None:
    e = torch.tpu.Event()
    e.record()
    assert e.query()
    y = _long_work()
    e.record()
    assert not e.query()
    e.synchronize()
    assert e.query()
    del y


def test_torch_event_generic_api() -> None:
    e = torch.Event("tpu")
    y = _long_work()
    e.record()
    assert e.device == torch.device("tpu:0") and e.event_id != 0
    assert not e.query()
    torch.tpu.current_stream().wait_event(e)
    e.synchronize()
    assert e.query()
    del y
    with pytest.raises(ValueError, match="enable_timing"):
        e.elapsed_time(torch.Event("tpu"))


def test_elapsed_time_positive_and_ordered() -> None:
    start, mid, end = (torch.tpu.Event(enable_timing=True) for _ in range(3))
    start.record()
    y = _long_work()
    mid.record()
    z = _long_work(4) + y
    end.record()
    end.synchronize()
    assert start.query() and mid.query() and end.query()
    t_mid, t_end = start.elapsed_time(mid), start.elapsed_time(end)
    assert t_mid > 0  # the matmuls between the records took time to compute
    assert t_end >= t_mid and mid.elapsed_time(end) >= 0  # completion times in record order
    assert abs(start.elapsed_time(mid) + mid.elapsed_time(end) - t_end) < 1e-6 * max(t_end, 1)
    del z


def test_elapsed_time_errors() -> None:
    a, b = torch.tpu.Event(enable_timing=True), torch.tpu.Event(enable_timing=True)
    a.record()
    with pytest.raises(ValueError, match="recorded"):
        a.elapsed_time(b)  # b never recorded
    with pytest.raises(ValueError, match="enable_timing"):
        a.elapsed_time(torch.tpu.Event())
    y = _long_work()
    b.record()
    with pytest.raises(RuntimeError, match="completed"):
        a.elapsed_time(b)  # b's work is still computing, as CUDA's cudaErrorNotReady
    b.synchronize()
    assert a.elapsed_time(b) > 0
    del y
    with pytest.raises(ValueError, match="interprocess"):
        torch.tpu.Event(interprocess=True)


def test_timing_event_with_torch_event() -> None:
    a, b = torch.Event("tpu", enable_timing=True), torch.Event("tpu", enable_timing=True)
    a.record()
    y = _long_work(4)
    b.record()
    b.synchronize()
    assert a.elapsed_time(b) > 0
    c = torch.tpu.Event(enable_timing=True)  # a torch.tpu.Event measures up to a torch.Event
    c.record()
    z = _long_work(4) * 2
    b.record()
    b.synchronize()
    assert c.elapsed_time(b) > 0 and c.elapsed_time(b) < a.elapsed_time(b)
    del y, z


def test_stream_record_event_and_wait_event() -> None:
    s = torch.tpu.Stream()
    with torch.tpu.stream(s):
        y = _long_work() * 2
    e = s.record_event()
    assert isinstance(e, torch.tpu.Event) and not e.query()
    torch.tpu.current_stream().wait_event(e)  # returns at once: only future work waits
    assert not e.query()
    z = y + 1  # ordered after y by its data dependence
    e.synchronize()
    torch.testing.assert_close(z.cpu(), y.cpu() + 1)


def test_fused_record_marks_the_pending_graph() -> None:
    torch.tpu.reset_metrics()
    with torch.tpu.set_eager_mode(EagerMode.DEFER_AND_FUSE):
        x = torch.arange(12.0, device="tpu").reshape(3, 4)
        y = (x * 2 + 1).sum(0)
        e = torch.tpu.Event()
        e.record()  # marks the pending graph without cutting it
        s = torch.tpu.Stream()
        s.wait_event(e)
        with torch.tpu.stream(s):
            z = y * 3  # recorded into the same graph
        torch.tpu.current_stream().wait_stream(s)  # a record and a wait: still no flush
        assert torch.tpu.metrics().flushes == {}
        e.synchronize()  # runs the graph it marks, then waits for it
        assert torch.tpu.metrics().flushes == {"event_synchronize": 1}
        assert e.query()
        w = z + 1
        e.record()
        first = e.query()  # runs the graph (an unissued graph would never be done), then answers
        assert torch.tpu.metrics().flushes.get("event_query") == 1
        e.synchronize()
        assert e.query() and isinstance(first, bool)
        v = w * 2
        assert s.query()  # a stream query issues this thread's pending graph too
        assert torch.tpu.metrics().flushes.get("stream_query") == 1
        t = torch.tpu.Event(enable_timing=True)
        u = v - 1
        t.record()  # a timing event runs the pending graph at its record: its completion time needs the work issued
        assert torch.tpu.metrics().flushes.get("event_record") == 1
        t.synchronize()
        got = torch.stack([z, w, v, u]).cpu()
    zc = (torch.arange(12.0).reshape(3, 4) * 2 + 1).sum(0) * 3
    torch.testing.assert_close(got, torch.stack([zc, zc + 1, (zc + 1) * 2, (zc + 1) * 2 - 1]))


def test_fused_event_from_another_thread() -> None:
    """An event marking one thread's pending graph is synchronized by another thread: the graph runs (once) and
    the values are right; nothing hangs."""
    import threading

    out: dict[str, object] = {}
    with torch.tpu.set_eager_mode(EagerMode.DEFER_AND_FUSE):
        y = torch.arange(6.0, device="tpu") * 5
        e = torch.tpu.Event()
        e.record()

        def other() -> None:
            e.synchronize()
            out["done"] = e.query()

        t = threading.Thread(target=other)
        t.start()
        t.join(120)
        assert not t.is_alive() and out["done"] is True
        got = (y + 1).cpu()
    torch.testing.assert_close(got, torch.arange(6.0) * 5 + 1)


def test_synchronize_raises_a_pending_index_error() -> None:
    x = torch.arange(4.0, device="tpu")
    bad = torch.tensor([7], device="tpu")
    y = x[bad]  # out of range: detected on the device, raised at the next synchronization point
    e = torch.tpu.Event()
    e.record()
    with pytest.raises(IndexError):
        e.synchronize()
    del y



def test_a_record_asks_only_arrays_it_has_not_seen_computed() -> None:
    # An event record scans every live array (_streams._computing); the filter against the arrays already seen
    # computed is one C loop (_C._unseen), which must keep exactly what the Python comprehension kept, in order.
    import jax

    from torch_tpu import _C, _runtime, _streams

    keep = [torch.randn(8, device="tpu") for _ in range(300)]
    torch.tpu.synchronize()
    torch.tpu.Event().record()  # every array so far is computed: seen
    fresh = [k * 2 for k in keep[:5]]
    live = jax.live_arrays(_runtime.platform())
    seen = _streams._seen_ready
    want = [a for a in live if id(a) not in seen]
    got = _C._unseen(live, seen)
    assert [id(a) for a in got] == [id(a) for a in want]
    assert {id(_C._array(t)) for t in fresh} <= {id(a) for a in got}
    assert len(got) < len(live) // 2
    assert _C._unseen([], {}) == [] and _C._unseen(live, {}) == live
    with pytest.raises(TypeError, match="_unseen"):
        _C._unseen(tuple(live), seen)
