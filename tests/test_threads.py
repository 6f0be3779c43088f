"""Threads: the runtime starts once when two threads touch tpu at the same time, the execution mode is per thread
with a process default, each thread records its own DEFER_AND_FUSE graph, a value pending in one thread is
computed right when another reads it, and two models train concurrently in every mode exactly like CPU.

Every case runs in a fresh interpreter with a timeout (conftest.run_python), so a deadlock fails the test
instead of hanging the suite."""

from __future__ import annotations

import textwrap

import pytest

from conftest import run_python

MODES = ["DEFER_NEVER", "DEFER_NEVER_AND_LAUNCH_BLOCKING", "DEFER_AND_FUSE"]


def _run(code: str, timeout: int = 240, env: dict[str, str] | None = None) -> str:
    out = run_python(textwrap.dedent(code), env=env, timeout=timeout)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


@pytest.mark.parametrize("attempt", range(3))
def test_first_touch_from_two_threads_at_once(attempt: int) -> None:
    out = _run("""
        import threading, torch
        start = threading.Barrier(2)
        results, errors = {}, []
        def touch(i):
            try:
                start.wait()
                results[i] = (torch.ones(3, device="tpu") * (i + 1)).cpu()
            except BaseException as e:
                errors.append(repr(e))
        threads = [threading.Thread(target=touch, args=(i,), daemon=True) for i in range(2)]
        for t in threads: t.start()
        for t in threads: t.join(120)
        assert not any(t.is_alive() for t in threads), "deadlock: a thread is still starting the runtime"
        assert not errors, errors
        assert torch.equal(results[0], torch.ones(3)) and torch.equal(results[1], torch.full((3,), 2.0))
        print("ok", torch.tpu.device_count())
    """, timeout=180)
    assert out.startswith("ok")


def test_first_touch_from_backward_thread_and_main() -> None:
    # The autograd engine starts its device threads (asking the device count without the GIL) while another
    # thread starts the runtime.
    _run("""
        import threading, torch
        x = torch.randn(4, 4, requires_grad=True)
        go = threading.Barrier(2)
        def other():
            go.wait()
            torch.zeros(2, device="tpu").cpu()
        t = threading.Thread(target=other, daemon=True); t.start()
        go.wait()
        y = (x.to("tpu") * 2).sum()
        y.backward()
        t.join(120)
        assert not t.is_alive()
        assert torch.equal(x.grad, torch.full((4, 4), 2.0))
    """)


def test_mode_is_per_thread_with_a_process_default() -> None:
    _run("""
        import threading, torch
        M = torch.tpu.EagerMode
        seen = {}
        def run(fn):
            t = threading.Thread(target=fn); t.start(); t.join(60); assert not t.is_alive()

        # Assigned in the main thread: the process default, which new threads start in.
        torch.tpu.eager_mode = M.DEFER_AND_FUSE
        assert torch.tpu.default_eager_mode() is M.DEFER_AND_FUSE
        run(lambda: seen.__setitem__("new", torch.tpu.eager_mode))
        assert seen["new"] is M.DEFER_AND_FUSE

        # Assigned in another thread: that thread's own mode only.
        def own():
            torch.tpu.eager_mode = M.DEFER_NEVER_AND_LAUNCH_BLOCKING
            seen["own"] = torch.tpu.eager_mode
        run(own)
        assert seen["own"] is M.DEFER_NEVER_AND_LAUNCH_BLOCKING
        assert torch.tpu.eager_mode is M.DEFER_AND_FUSE and torch.tpu.default_eager_mode() is M.DEFER_AND_FUSE

        # set_eager_mode is per thread: a block in the main thread does not change what other threads run in.
        with torch.tpu.set_eager_mode(M.DEFER_NEVER):
            assert torch.tpu.eager_mode is M.DEFER_NEVER
            run(lambda: seen.__setitem__("during", torch.tpu.eager_mode))
        assert seen["during"] is M.DEFER_AND_FUSE
        assert torch.tpu.eager_mode is M.DEFER_AND_FUSE

        # set_default_eager_mode from any thread: threads without a mode of their own follow it.
        run(lambda: torch.tpu.set_default_eager_mode("DEFER_NEVER"))
        assert torch.tpu.eager_mode is M.DEFER_NEVER and torch.tpu.default_eager_mode() is M.DEFER_NEVER
        print("ok")
    """)


def test_backward_runs_in_the_mode_of_the_thread_that_called_it() -> None:
    # A worker thread fuses while the process default is DEFER_NEVER: its backward (run by the autograd engine's
    # device thread) is recorded into the worker's graph, so one program per step runs and nothing else.
    out = _run("""
        import threading, torch
        torch.manual_seed(0)
        cpu = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
        dev = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
        dev.load_state_dict(cpu.state_dict()); dev.to("tpu")
        x = torch.randn(5, 8)
        def step(m, x):
            loss = m(x).square().mean()
            loss.backward()
            return loss.item()
        ref = step(cpu, x)
        xd = x.to("tpu")
        def fused_step(got):
            step(dev, xd)  # compiles
            for p in dev.parameters(): p.grad = None
            torch.tpu.reset_metrics()
            got["loss"] = step(dev, xd)
            got["grads"] = [p.grad.cpu() for p in dev.parameters()]
            got["flushes"] = dict(torch.tpu.metrics().flushes)
        def worker():
            torch.tpu.eager_mode = "DEFER_AND_FUSE"
            fused_step(in_worker)
        in_worker, in_main = {}, {}
        t = threading.Thread(target=worker); t.start(); t.join(120); assert not t.is_alive()
        assert torch.tpu.eager_mode is torch.tpu.EagerMode.DEFER_NEVER
        for got in (in_worker,):
            assert abs(got["loss"] - ref) < 1e-5
            for g, p in zip(got["grads"], cpu.parameters()):
                torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-6)
        torch.tpu.eager_mode = "DEFER_AND_FUSE"  # the same in the main thread, as the process default
        fused_step(in_main)
        print("flushes", in_worker["flushes"], in_main["flushes"])
    """)
    in_worker, in_main = eval(out.split("flushes", 1)[1].replace("} {", "}, {"))
    # The forward runs as the backward pass starts and the backward as it ends, both the worker's graphs (a backward
    # that ran apart would have flushed the forward for "transfer" or "value_needed"), as when the main thread fuses.
    assert in_worker == in_main and in_worker["backward_start"] == in_worker["backward_end"] == 1, (in_worker, in_main)
    assert set(in_worker) <= {"backward_start", "backward_end", "item", "to_cpu"}, in_worker


def test_value_pending_in_one_thread_read_by_another() -> None:
    _run("""
        import threading, torch
        x = torch.arange(12.0).reshape(3, 4)
        box = {}
        def producer():
            torch.tpu.eager_mode = "DEFER_AND_FUSE"
            xd = x.to("tpu")
            box["y"] = torch.tanh(xd * 2 + 1)  # pending in the producer's graph, never read there
            box["z"] = box["y"].sum(0)
        t = threading.Thread(target=producer); t.start(); t.join(60); assert not t.is_alive()
        # The main thread (DEFER_NEVER) uses it in eager ops and reads it.
        y, z = box["y"], box["z"]
        torch.testing.assert_close((y - 1).cpu(), torch.tanh(x * 2 + 1) - 1)
        torch.testing.assert_close(z.cpu(), torch.tanh(x * 2 + 1).sum(0))
        # ...and under DEFER_AND_FUSE in a block of its own.
        with torch.tpu.set_eager_mode("DEFER_AND_FUSE"):
            w = (y * 3).exp()
        torch.testing.assert_close(w.cpu(), (torch.tanh(x * 2 + 1) * 3).exp())
        print("ok")
    """)


def test_graphs_of_a_finished_thread_are_released_or_still_readable() -> None:
    _run("""
        import gc, threading, weakref, torch
        from torch_tpu import _deferred
        x = torch.arange(6.0)
        box = {}
        def worker(keep):
            torch.tpu.eager_mode = "DEFER_AND_FUSE"
            xd = x.to("tpu")
            torch.tpu.synchronize()
            y = xd * 2 + 1  # pending, never read in this thread
            (graph,) = _deferred._graphs.values()  # the main thread records nothing
            box["graph"] = weakref.ref(graph)
            if keep:
                box["y"] = y
        for keep in (False, True):
            t = threading.Thread(target=worker, args=(keep,)); t.start(); t.join(60); assert not t.is_alive()
            gc.collect()
            torch.tpu.synchronize()
            assert not _deferred._graphs, _deferred._graphs  # nothing records there any more
            if keep:
                torch.testing.assert_close(box["y"].cpu(), x * 2 + 1)  # its graph runs when read
            else:
                assert box["graph"]() is None  # nobody can read it: freed with its inputs
        print("ok")
    """)


def test_mode_switch_in_one_thread_while_another_runs_ops() -> None:
    _run("""
        import threading, torch
        x = torch.randn(16, 16)
        xd = x.to("tpu")
        errors, results = [], []
        stop = threading.Event()
        def worker():
            try:
                for _ in range(400):
                    y = xd
                    for _ in range(5):
                        y = (y * 0.5 + 1).tanh()
                    results.append(y.sum().item())
                    if stop.is_set():
                        break
            except BaseException as e:
                errors.append(repr(e))
        t = threading.Thread(target=worker); t.start()
        modes = ["DEFER_AND_FUSE", "DEFER_NEVER", "DEFER_NEVER_AND_LAUNCH_BLOCKING"]
        for i in range(150):
            torch.tpu.eager_mode = modes[i % 3]  # the process default, which the worker runs in
            (xd + i).sum().item()
        stop.set(); t.join(120); assert not t.is_alive()
        assert not errors, errors
        y = x
        for _ in range(5):
            y = (y * 0.5 + 1).tanh()
        assert results and all(abs(r - y.sum().item()) < 1e-3 for r in results), (results[:5], y.sum().item())
        print("ok", len(results))
    """)


_TRAIN = """
import threading, torch
MODE, COMPILE = {mode!r}, {compile!r}

def make(seed, width):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(12, width), torch.nn.ReLU(), torch.nn.Linear(width, 4))
    x = torch.randn(8, 12)
    y = torch.randint(0, 4, (8,))
    return model, x, y

def train(model, x, y, device, steps=6, compiled=False):
    model = model.to(device)
    x, y = x.to(device), y.to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    def loss_fn(x, y):
        return torch.nn.functional.cross_entropy(model(x), y)
    fwd = torch.compile(loss_fn, backend="tpu") if compiled else loss_fn
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = fwd(x, y)
        loss.backward()
        opt.step()
        if device == "tpu":
            torch.tpu.synchronize()  # waits for both threads' device work while the other one runs
        losses.append(loss.item())
    return losses, [p.detach().cpu() for p in model.parameters()]

specs = [(0, 32), (1, 24)]
expected = [train(*make(s, w), "cpu") for s, w in specs]
inputs = [make(s, w) for s, w in specs]  # here: torch.manual_seed is process-wide
got, errors = [None, None], []
start = threading.Barrier(2)

def worker(i):
    try:
        if MODE is not None:
            torch.tpu.eager_mode = MODE  # this thread's own mode
        start.wait()
        got[i] = train(*inputs[i], "tpu", compiled=COMPILE)
    except BaseException as e:
        import traceback
        errors.append(traceback.format_exc())

threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(2)]
for t in threads: t.start()
for t in threads: t.join(400)
assert not any(t.is_alive() for t in threads), "a training thread hangs"
assert not errors, errors[0]
for (el, ep), (gl, gp) in zip(expected, got):
    torch.testing.assert_close(torch.tensor(gl), torch.tensor(el), rtol=1e-4, atol=1e-5)
    for a, b in zip(gp, ep):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
print("ok")
"""


@pytest.mark.parametrize("mode", MODES)
def test_two_models_train_concurrently_like_cpu(mode: str) -> None:
    _run(_TRAIN.format(mode=mode, compile=False), timeout=500)


def test_two_models_train_concurrently_in_the_process_default() -> None:
    # No thread sets a mode: both run in TORCH_TPU_EAGER_MODE's default, each recording its own graph.
    _run(_TRAIN.format(mode=None, compile=False), timeout=500, env={"TORCH_TPU_EAGER_MODE": "DEFER_AND_FUSE"})


def test_two_compiled_models_train_concurrently_like_cpu() -> None:
    _run(_TRAIN.format(mode=None, compile=True), timeout=580)


@pytest.mark.parametrize("attempt", range(3))
def test_first_compile_from_many_threads_at_once(attempt: int) -> None:
    # Dynamo's entry-point lookup of backend "tpu" races (two threads register it: "duplicate name: tpu");
    # torch_tpu registers the backend when Dynamo's registry is imported, before any thread can look it up.
    out = _run("""
        import sys, threading, torch
        assert "torch._dynamo" not in sys.modules  # import torch stays free of Dynamo
        n = 8
        start = threading.Barrier(n)
        errors, results = [], []
        def work():
            start.wait()
            try:
                f = torch.compile(lambda a: a * 2 + 1, backend="tpu")
                results.append(f(torch.arange(4.0, device="tpu")).cpu())
            except BaseException as e:
                errors.append(repr(e))
        threads = [threading.Thread(target=work, daemon=True) for _ in range(n)]
        for t in threads: t.start()
        for t in threads: t.join(200)
        assert not any(t.is_alive() for t in threads), "a compile is still running"
        assert not errors, errors
        assert len(results) == n
        for r in results:
            torch.testing.assert_close(r, torch.arange(4.0) * 2 + 1)
        import torch._dynamo
        assert "tpu" in torch._dynamo.list_backends()
        print("ok")
    """, timeout=300)
    assert out.strip().endswith("ok")
