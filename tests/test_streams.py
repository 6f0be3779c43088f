"""Streams (CUDA's API, torch.Stream("tpu") and torch.accelerator): ids, identity, the current stream per thread,
context managers that restore, and the values of cross-stream code (wait_stream, an FSDP-like side-stream copy)
equal CPU's in DEFER_NEVER and DEFER_AND_FUSE. Semantics over PJRT: docs/user_guide.md, "Streams and events"."""

from __future__ import annotations

import threading

import pytest
import torch

from conftest import run_python

EagerMode = torch.tpu.EagerMode
MODES = [EagerMode.DEFER_NEVER, EagerMode.DEFER_AND_FUSE]


@pytest.fixture(autouse=True)
def _default_stream_after():
    yield
    torch.tpu.set_stream(torch.tpu.default_stream())
    torch.tpu.eager_mode = EagerMode.DEFER_NEVER


def test_default_and_new_streams() -> None:
    d = torch.tpu.default_stream()
    assert isinstance(d, torch.tpu.Stream) and isinstance(d, torch.Stream)
    assert d.stream_id == 0 and d.device == torch.device("tpu:0")
    assert torch.tpu.current_stream() == d  # a thread starts on the default stream
    a, b = torch.tpu.Stream(), torch.tpu.Stream(priority=-1)
    assert a != b and a != d and len({a.stream_id, b.stream_id, d.stream_id}) == 3
    assert a == torch.tpu.Stream(stream_id=a.stream_id, device_index=a.device_index, device_type=a.device_type)
    assert hash(a) != hash(b) and len({a, b, d, a}) == 3
    assert a.device == torch.device("tpu:0") and "stream_id" in repr(a)


def test_set_stream_and_context_manager_restore() -> None:
    d = torch.tpu.current_stream()
    s1, s2 = torch.tpu.Stream(), torch.tpu.Stream()
    with torch.tpu.stream(s1):
        assert torch.tpu.current_stream() == s1
        with torch.tpu.stream(s2):
            assert torch.tpu.current_stream() == s2
        assert torch.tpu.current_stream() == s1
        with torch.tpu.stream(None):  # no-op, as torch.cuda.stream(None)
            assert torch.tpu.current_stream() == s1
    assert torch.tpu.current_stream() == d
    with pytest.raises(ZeroDivisionError):
        with torch.tpu.stream(s1):
            1 / 0
    assert torch.tpu.current_stream() == d  # restored on the way out of an exception too
    torch.tpu.set_stream(s2)
    assert torch.tpu.current_stream() == s2
    assert torch.tpu.current_stream(0) == s2 and torch.tpu.current_stream("tpu:0") == s2
    assert torch.tpu.default_stream() == d


def test_current_stream_is_per_thread() -> None:
    main_s, other_s = torch.tpu.Stream(), torch.tpu.Stream()
    torch.tpu.set_stream(main_s)
    seen: dict[str, object] = {}

    def other() -> None:
        seen["start"] = torch.tpu.current_stream()
        torch.tpu.set_stream(other_s)
        seen["after_set"] = torch.tpu.current_stream()
        seen["value"] = (torch.arange(4, device="tpu") * 2).cpu()

    t = threading.Thread(target=other)
    t.start()
    t.join(60)
    assert not t.is_alive()
    assert seen["start"] == torch.tpu.default_stream()  # a new thread starts on the default stream, as CUDA
    assert seen["after_set"] == other_s
    assert torch.equal(seen["value"], torch.arange(4) * 2)
    assert torch.tpu.current_stream() == main_s  # the other thread's set_stream did not touch this thread's


def test_torch_stream_and_accelerator() -> None:
    assert torch.accelerator.current_accelerator() == torch.device("tpu")
    s = torch.Stream("tpu")  # PyTorch's generic stream, through the device guard's getNewStream
    assert s.device_type == torch.tpu.default_stream().device_type and s.stream_id != 0
    assert torch.accelerator.current_stream().stream_id == 0
    with s:
        assert torch.accelerator.current_stream() == s
        assert torch.tpu.current_stream().stream_id == s.stream_id
        x = torch.ones(3, device="tpu") + 1
    assert torch.accelerator.current_stream().stream_id == 0
    torch.accelerator.set_stream(s)
    assert torch.tpu.current_stream().stream_id == s.stream_id
    torch.accelerator.synchronize()
    assert s.query() and torch.tpu.current_stream().query()
    e = s.record_event()
    assert isinstance(e, torch.Event) and e.query()
    torch.accelerator.current_stream().wait_stream(s)
    assert torch.equal(x.cpu(), torch.full((3,), 2.0))


def _long_work() -> torch.Tensor:
    """Device work of a few hundred milliseconds on XLA:CPU (dispatched asynchronously)."""
    a = torch.randn(768, 768, device="tpu") / 30
    for _ in range(12):
        a = torch.tanh(a @ a)
    return a


def test_stream_query_and_synchronize() -> None:
    _long_work().cpu()  # compiled, so the next run only enqueues
    s = torch.tpu.Stream()
    with torch.tpu.stream(s):
        y = _long_work()
    assert not s.query()  # still computing
    s.synchronize()
    assert s.query() and torch.tpu.current_stream().query()
    assert torch.isfinite(y.cpu()).all()


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_wait_stream_values_like_cpu(mode: EagerMode) -> None:
    torch.manual_seed(0)
    w_cpu, x_cpu = torch.randn(16, 16), torch.randn(8, 16)

    def run(device: str) -> torch.Tensor:
        w, x = w_cpu.to(device), x_cpu.to(device)
        side = torch.tpu.Stream() if device == "tpu" else None
        main = torch.tpu.current_stream() if device == "tpu" else None
        out = []
        for step in range(3):
            if side is not None:
                side.wait_stream(main)
            with torch.tpu.stream(side):  # a no-op context on CPU (None)
                h = torch.relu(x @ w) + step
                w.mul_(0.5)  # in place on the side stream
            if main is not None:
                main.wait_stream(side)
            out.append(h.sum(1) + w.sum())
        return torch.stack(out).cpu()

    with torch.tpu.set_eager_mode(mode):
        got = run("tpu")
    torch.testing.assert_close(got, run("cpu"))


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_fsdp_like_side_stream_copy(mode: EagerMode) -> None:
    """FSDP2's overlap: on a side stream, copy the shards into one flat buffer (all-gather's copy-in/out), record
    an event; the compute stream waits on it and uses the unflattened parameters; the shards are then updated
    in place for the next step while the side stream prefetches. Values must equal CPU's."""
    torch.manual_seed(1)
    shards_cpu = [torch.randn(6, 4) for _ in range(3)]
    x_cpu = torch.randn(5, 4)

    def run(device: str) -> torch.Tensor:
        shards = [s.to(device) for s in shards_cpu]
        x = x_cpu.to(device)
        tpu = device == "tpu"
        ag_stream = torch.tpu.Stream(priority=-1) if tpu else None
        compute = torch.tpu.current_stream() if tpu else None
        flat = torch.empty(sum(s.numel() for s in shards), device=device)
        losses = []
        for step in range(3):
            if tpu:
                ag_stream.wait_stream(compute)  # the copy-in must see the previous step's updates
            with torch.tpu.stream(ag_stream):
                torch.cat([s.reshape(-1) for s in shards], out=flat)
                params = [p.view(6, 4) for p in flat.split([s.numel() for s in shards])]
                event = ag_stream.record_event() if tpu else None
            if tpu:
                compute.wait_event(event)
            h = x
            for p in params:
                h = torch.tanh(h @ p.t() @ p)
            loss = h.square().mean()
            losses.append(loss)
            with torch.no_grad():
                for i, s in enumerate(shards):
                    s.sub_(0.1 * (step + 1) * params[i])  # an "optimizer step" on the sharded parameters
        return torch.stack(losses + [torch.cat([s.reshape(-1) for s in shards]).sum()]).cpu()

    with torch.tpu.set_eager_mode(mode):
        got = run("tpu")
    torch.testing.assert_close(got, run("cpu"))


def test_streams_on_two_devices() -> None:
    """A stream's context on another device makes that device current and restores both devices' streams; the
    process exits cleanly with timing events still pending."""
    code = """
import torch
assert torch.tpu.device_count() == 2
s1 = torch.tpu.Stream("tpu:1")
assert s1.device == torch.device("tpu:1")
s0 = torch.tpu.Stream()
torch.tpu.set_stream(s0)
with torch.tpu.stream(s1):
    assert torch.tpu.current_device() == 1
    assert torch.tpu.current_stream() == s1
    assert torch.tpu.current_stream(0) == s0
    y = torch.arange(3.0, device="tpu") * 3
assert y.device == torch.device("tpu:1")
assert torch.tpu.current_device() == 0 and torch.tpu.current_stream() == s0
assert torch.tpu.current_stream(1) == torch.tpu.default_stream(1)
e = torch.tpu.Event()
e.record(s1)
s0.wait_event(e)
assert torch.equal((y.to("tpu:0") + 1).cpu(), torch.arange(3.0) * 3 + 1)
torch.accelerator.set_stream(s1)
assert torch.tpu.current_device() == 1  # set_stream makes the stream's device current, as CUDA's
# The script ends while timing events still wait for their work: it exits cleanly (the event timer thread ends
# before the interpreter does).
a = torch.randn(512, 512, device="tpu:1")
t0 = torch.tpu.Event(enable_timing=True)
t0.record()
for _ in range(6):
    a = torch.tanh(a @ a)
t1 = torch.Event("tpu", enable_timing=True)
t1.record()
print("ok")
"""
    r = run_python(code, env={"TORCH_TPU_NUM_DEVICES": "2"}, timeout=120)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def test_backward_across_streams_like_cpu_without_graph_breaks() -> None:
    """The autograd engine synchronizes a backward node with the stream its forward ran on (an event record and a
    wait per crossing): gradients equal CPU's and, under DEFER_AND_FUSE, those events cut no graph."""
    torch.manual_seed(0)
    wc = torch.randn(4, 4, requires_grad=True)
    w = wc.detach().to("tpu").requires_grad_()
    s = torch.tpu.Stream()
    torch.tpu.reset_metrics()
    with torch.tpu.set_eager_mode(EagerMode.DEFER_AND_FUSE):
        with torch.tpu.stream(s):
            h = (w @ w).tanh()
        torch.tpu.current_stream().wait_stream(s)
        (h * 3).sum().backward()
        g = w.grad.cpu()
    assert torch.tpu.metrics().flushes == {"backward_start": 1, "backward_end": 1}  # (.cpu(): nothing pending)
    ((wc @ wc).tanh() * 3).sum().backward()
    torch.testing.assert_close(g, wc.grad)


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_record_stream_keeps_values(mode: EagerMode) -> None:
    """Tensor.record_stream (a CUDA allocator hint) is accepted and needs nothing: a tensor made on a side stream,
    recorded on the compute stream and dropped there, still gives CPU's values where it is used."""
    s = torch.tpu.Stream()
    with torch.tpu.set_eager_mode(mode):
        with torch.tpu.stream(s):
            t = torch.arange(8.0, device="tpu") * 3
        t.record_stream(torch.tpu.current_stream())
        u = t.flip(0) + 1
        del t
        got = u.cpu()
    torch.testing.assert_close(got, (torch.arange(8.0) * 3).flip(0) + 1)
