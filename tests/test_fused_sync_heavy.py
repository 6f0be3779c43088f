"""DEFER_AND_FUSE on sync-heavy code: after a few graphs of one op in a row, a thread runs the first op of each
segment (the ops between two synchronization points) through the eager cache hit, the program its one-op flush
would have run (torch_tpu/_deferred.py `_DIRECT_AFTER`, runtime/TpuMode.cpp). The values must be exactly those
of recording every op (the policy off) and of DEFER_NEVER, CPU is the oracle, metrics count each such segment as
the flush it stands for, and a segment that grows records again from its second op."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch

from torch_tpu import _C, _deferred

FUSE = torch.tpu.EagerMode.DEFER_AND_FUSE


@pytest.fixture(autouse=True)
def _fresh_state():
    _deferred.reset_direct()
    yield
    _deferred.reset_direct()
    torch.tpu.eager_mode = torch.tpu.EagerMode.DEFER_NEVER


def _ops(x: torch.Tensor, y: torch.Tensor, s: torch.Tensor) -> list:
    """One-op segments: each op, then a read of its result."""
    return [(x + y).cpu(), (x * y).cpu(), torch.sin(x).cpu(), torch.exp(y).cpu(), (x @ y).cpu(),
            (x - 2.5).cpu(), torch.tanh(x).cpu(), (s * 3).item(), (s + s).item()]


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(16, 16, generator=g), torch.randn(16, 16, generator=g)
    return x, y, torch.randn((), generator=g)


def _run(mode, direct_after: int, monkeypatch, steps: int = 6) -> tuple[list, list]:
    monkeypatch.setattr(_deferred, "_DIRECT_AFTER", direct_after)
    x, y, s = (t.tpu() for t in _inputs())
    out, direct = [], []
    # (every op of _ops is its own graph called from one line: not the storm the warning is about)
    with torch.tpu.set_eager_mode(mode), warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.tpu.RecompilationWarning)
        # One pass first, so that every op has its cache entries whatever earlier tests installed: when the
        # direct path engages then depends on this test alone (an op without an entry records, which leaves it).
        _ops(x, y, s)
        _deferred.reset_direct()
        for _ in range(steps):
            out.append(_ops(x, y, s))
            direct.append(_C._fuse_direct())
    return out, direct


def _same(a, b) -> None:
    for ra, rb in zip(a, b):
        for va, vb in zip(ra, rb):
            if isinstance(va, torch.Tensor):
                assert va.dtype == vb.dtype and torch.equal(va, vb)
            else:
                assert va == vb


def test_one_op_segments_run_directly_with_the_values_of_recording(monkeypatch) -> None:
    policy, direct = _run(FUSE, 3, monkeypatch)
    assert direct[0] and direct[-1], "segments of one op must engage the direct path"
    recorded, direct_off = _run(FUSE, 0, monkeypatch)
    assert not any(direct_off)
    never, _ = _run(torch.tpu.EagerMode.DEFER_NEVER, 3, monkeypatch)
    _same(policy, recorded)  # bit for bit: the same one-op programs
    _same(policy, never)
    x, y, s = _inputs()
    cpu = _ops(x, y, s)
    for row in policy:
        for got, want in zip(row, cpu):
            torch.testing.assert_close(torch.as_tensor(got), torch.as_tensor(want), rtol=1e-5, atol=1e-5)


def test_metrics_count_direct_segments_as_the_flushes_they_stand_for() -> None:
    x = torch.randn(8, device="tpu")
    with torch.tpu.set_eager_mode(FUSE):
        for _ in range(4):
            (x + 1).cpu()
        assert _C._fuse_direct()
        torch.tpu.reset_metrics()
        for i in range(5):
            assert (x + i).cpu().tolist() == (x.cpu() + i).tolist()
        (x * 2).sum().item()  # two ops: the second leaves the direct path and is recorded
        assert not _C._fuse_direct()
        m = torch.tpu.metrics()
    assert m.flushes == {"to_cpu": 5, "item": 1}, m.flushes
    assert m.fused_graph_runs == 6


def test_reads_of_views_stay_direct_and_record_nothing() -> None:
    # A host read of a view (`(x + i)[2].cpu()`, `x[i, 3].item()`) computes the storage's array and reads the view
    # eagerly (torch_tpu/_storage.py `read_for_host`): the segment of the op that made the array ends as a read of
    # its whole result would, and a read of a computed tensor's view flushes nothing.
    x = torch.randn(8, 8, device="tpu")
    xc = x.cpu()
    (x + 1)[0].cpu()  # (DEFER_NEVER: the op's cache entry, which the direct path runs)
    with torch.tpu.set_eager_mode(FUSE):
        for _ in range(4):
            (x + 1)[0].cpu()
        assert _C._fuse_direct()
        torch.tpu.reset_metrics()
        for i in range(5):
            assert torch.equal((x + i)[2].cpu(), (xc + i)[2])
            assert x[i, 3].item() == xc[i, 3].item()
        assert _C._fuse_direct()
        m = torch.tpu.metrics()
    assert m.flushes == {"to_cpu": 5}, m.flushes
    assert m.fused_graph_runs == 5


def test_a_segment_that_grows_records_and_fuses_again() -> None:
    x, w = torch.randn(8, 8), torch.randn(8, 8)
    xt, wt = x.tpu(), w.tpu()
    with torch.tpu.set_eager_mode(FUSE):
        for _ in range(4):
            (xt + 1).cpu()
        assert _C._fuse_direct()
        out = []
        for _ in range(3):  # one segment of five ops per step: only the first step's first op ran directly
            y = torch.relu(xt @ wt + 1.0) * 2.0 - xt
            out.append(y.cpu())
            assert not _C._fuse_direct()
        torch.tpu.reset_metrics()
        y = torch.relu(xt @ wt + 1.0) * 2.0 - xt
        last = y.cpu()
        m = torch.tpu.metrics()
    assert m.fused_graph_runs == 1 and m.fused_ops == 5 and m.flushes == {"to_cpu": 1}
    want = torch.relu(x @ w + 1.0) * 2.0 - x
    for got in out + [last]:
        torch.testing.assert_close(got, want)


def test_backs_off_after_leaving() -> None:
    x = torch.randn(4, device="tpu")
    with torch.tpu.set_eager_mode(FUSE):
        n = 0
        while not _C._fuse_direct():
            (x + 1).cpu()
            n += 1
            assert n < 10
        ((x + 1) * 2).cpu()  # leaves
        assert not _C._fuse_direct()
        m = 0
        while not _C._fuse_direct():
            (x + 1).cpu()
            m += 1
            assert m < 40
    assert m > n, "after leaving, more one-op flushes are needed to go direct again"


def test_mode_switch_mid_way() -> None:
    x = torch.randn(6)
    xt = x.tpu()
    with torch.tpu.set_eager_mode(FUSE):
        for _ in range(4):
            (xt * 2).cpu()
        assert _C._fuse_direct()
        pending = xt + 3  # ran directly; its segment is open
        torch.tpu.reset_metrics()
    # leaving DEFER_AND_FUSE ends the segment: the mode-change flush it stands for
    assert torch.tpu.metrics().flushes == {"mode_change": 1}
    assert torch.tpu.eager_mode is torch.tpu.EagerMode.DEFER_NEVER
    a = (pending * 2).cpu()
    with torch.tpu.set_eager_mode(FUSE):
        assert torch.tpu.eager_mode is FUSE
        b = (pending - 1).cpu()
        torch.tpu.eager_mode = torch.tpu.EagerMode.DEFER_NEVER  # switched inside the block
        c = (pending + pending).cpu()
    torch.testing.assert_close(a, (x + 3) * 2)
    torch.testing.assert_close(b, x + 2)
    torch.testing.assert_close(c, (x + 3) * 2)


def test_an_input_pending_in_another_thread() -> None:
    x = torch.randn(5)
    xt = x.tpu()
    made: dict[str, torch.Tensor] = {}

    def other() -> None:
        with torch.tpu.set_eager_mode(FUSE):
            made["p"] = xt * 4 + 1  # recorded in that thread's graph, not read there

    with torch.tpu.set_eager_mode(FUSE):
        for _ in range(4):
            (xt + 1).cpu()
        assert _C._fuse_direct()
        t = threading.Thread(target=other)
        t.start()
        t.join()
        got = (made["p"] - 1).cpu()  # a placeholder input: recorded (it transfers), not run directly
    torch.testing.assert_close(got, x * 4)


@pytest.mark.parametrize("attempt", range(2))
def test_threads_each_keep_their_own_state(attempt: int) -> None:
    errors: list[BaseException] = []
    states: dict[str, list[bool]] = {}

    def sync_heavy(name: str, seed: int) -> None:
        try:
            g = torch.Generator().manual_seed(seed)
            x = torch.randn(8, 8, generator=g)
            xt = x.tpu()
            seen = []
            with torch.tpu.set_eager_mode(FUSE):
                for i in range(30):
                    got = (xt * float(i)).cpu()
                    assert torch.equal(got, x * float(i)), (name, i)
                    seen.append(_C._fuse_direct())
            states[name] = seen
        except BaseException as e:  # noqa: BLE001  (reported by the main thread)
            errors.append(e)

    def long_segments(seed: int) -> None:
        try:
            g = torch.Generator().manual_seed(seed)
            x, w = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
            xt, wt = x.tpu(), w.tpu()
            seen = []
            with torch.tpu.set_eager_mode(FUSE):
                for _ in range(10):
                    got = (torch.tanh(xt @ wt) * 0.5 + xt).sum(0).cpu()
                    torch.testing.assert_close(got, (torch.tanh(x @ w) * 0.5 + x).sum(0), rtol=1e-5, atol=1e-5)
                    seen.append(_C._fuse_direct())
            states["long"] = seen
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=sync_heavy, args=(f"s{i}", i)) for i in range(2)]
    threads.append(threading.Thread(target=long_segments, args=(7,)))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    if errors:
        raise errors[0]
    assert states["s0"][-1] and states["s1"][-1]
    assert not any(states["long"])
