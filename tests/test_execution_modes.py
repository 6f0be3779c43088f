"""Execution modes: DEFER_NEVER (default), DEFER_NEVER_AND_LAUNCH_BLOCKING and DEFER_AND_FUSE give the same results
(CPU is the oracle), DEFER_AND_FUSE flushes where a value is needed and caches its graphs, metrics count what
happened, and a call site that keeps recompiling for new shapes is warned about once."""

from __future__ import annotations

import copy
import sys
import warnings

import pytest
import torch
import torch.nn as nn

from conftest import load_example, run_python

EagerMode = torch.tpu.EagerMode
FUSE = EagerMode.DEFER_AND_FUSE


@pytest.fixture(autouse=True)
def _restore_mode():
    yield
    torch.tpu.eager_mode = EagerMode.DEFER_NEVER


def test_mode_api() -> None:
    assert torch.tpu.eager_mode == EagerMode.DEFER_NEVER
    torch.tpu.eager_mode = EagerMode.DEFER_AND_FUSE
    assert torch.tpu.eager_mode is EagerMode.DEFER_AND_FUSE
    torch.tpu.eager_mode = "defer_never_and_launch_blocking"
    assert torch.tpu.eager_mode is EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING
    torch.tpu.eager_mode = "DEFER_NEVER"
    with torch.tpu.set_eager_mode(FUSE):
        assert torch.tpu.eager_mode is FUSE
        with torch.tpu.set_eager_mode("DEFER_NEVER"):
            assert torch.tpu.eager_mode is EagerMode.DEFER_NEVER
        assert torch.tpu.eager_mode is FUSE
    assert torch.tpu.eager_mode is EagerMode.DEFER_NEVER
    with pytest.raises(ValueError, match="DEFER_AND_FUSE"):
        torch.tpu.eager_mode = "fast"


def test_set_eager_mode_as_a_call() -> None:
    """Called on its own (not in a `with`), set_eager_mode sets the thread's mode, as torch.set_grad_enabled
    does: it used to be a bare context manager, so the call changed nothing and the ops ran one by one."""
    torch.tpu.set_eager_mode(FUSE)
    assert torch.tpu.eager_mode is FUSE
    torch.tpu.reset_metrics()
    x = torch.arange(6.0).reshape(2, 3).to("tpu")
    y = (x * 2 + 1).sum(0)
    torch.testing.assert_close(y.cpu(), (torch.arange(6.0).reshape(2, 3) * 2 + 1).sum(0))
    assert torch.tpu.metrics().fused_ops >= 3  # recorded and run as a graph, not op by op
    # Its `with` form still restores what the plain call set, and a bad name fails at the call.
    with torch.tpu.set_eager_mode("DEFER_NEVER"):
        assert torch.tpu.eager_mode is EagerMode.DEFER_NEVER
    assert torch.tpu.eager_mode is FUSE
    with pytest.raises(ValueError, match="DEFER_AND_FUSE"):
        torch.tpu.set_eager_mode("fast")
    assert torch.tpu.eager_mode is FUSE


def test_mode_from_environment() -> None:
    out = run_python("import torch; print(torch.tpu.eager_mode)", env={"TORCH_TPU_EAGER_MODE": "DEFER_AND_FUSE"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "EagerMode.DEFER_AND_FUSE"
    bad = run_python("import torch; torch.zeros(1, device='tpu')", env={"TORCH_TPU_EAGER_MODE": "lazy"})
    assert bad.returncode != 0 and "TORCH_TPU_EAGER_MODE='lazy'" in bad.stderr and "DEFER_NEVER" in bad.stderr


def _program(x: torch.Tensor, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """A mix of what models do: elementwise chains, broadcasting, matmul, reductions, in-place ops through
    views, dtype-reinterpreting views, indexing with data-dependent shapes, random numbers, copies."""
    out = {}
    y = torch.tanh(x @ w + 1.0) * 2 - x.mean(0, keepdim=True)
    out["chain"] = y
    z = x.clone()
    z[0].add_(5)  # write through a row view
    z.t()[1].mul_(-2)  # through a transposed column view
    z[:, 2:4] = 7.0
    out["views"] = z
    bits = x.clone().view(torch.int32)
    bits.bitwise_xor_(1)
    out["bitcast"] = bits.view(torch.float32)
    out["reduce"] = torch.stack([y.sum(), y.amax(), y.std()])
    out["masked"] = y[y > 0]  # data-dependent shape
    torch.manual_seed(7)
    out["random"] = torch.randn(4, 4, device=x.device) + torch.rand(4, device=x.device)
    out["dropout"] = torch.nn.functional.dropout(y, 0.5)
    acc = torch.zeros(8, device=x.device)
    for i in range(5):
        acc += y[i]
    out["loop"] = acc
    out["cast"] = (y * 100).to(torch.int64).float()
    return out


@pytest.mark.parametrize("mode", ["DEFER_NEVER_AND_LAUNCH_BLOCKING", "DEFER_AND_FUSE"])
def test_modes_match_defer_never_and_cpu(mode: str) -> None:
    torch.manual_seed(0)
    xc, wc = torch.randn(8, 8), torch.randn(8, 8)
    cpu = _program(xc, wc)
    never = _program(xc.tpu(), wc.tpu())
    with torch.tpu.set_eager_mode(mode):
        other = _program(xc.tpu(), wc.tpu())
        for k in other:
            assert other[k].device.type == "tpu"
        other = {k: v.cpu() for k, v in other.items()}
    for k in cpu:
        torch.testing.assert_close(other[k], never[k].cpu(), rtol=1e-6, atol=1e-6, msg=k)
        if k not in ("random", "dropout"):  # the tpu generator's stream differs from CPU's
            torch.testing.assert_close(other[k], cpu[k], rtol=1e-5, atol=1e-5, msg=k)


def test_autograd_matches_defer_never() -> None:
    def grads() -> list[torch.Tensor]:
        torch.manual_seed(1)
        model = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 3)).tpu()
        x = torch.randn(5, 6).tpu()
        model(x).logsumexp(1).sum().backward()
        return [p.grad.cpu() for p in model.parameters()]

    expected = grads()
    with torch.tpu.set_eager_mode(FUSE):
        got = grads()
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_flush_reasons_and_unread_results_not_materialised() -> None:
    x = torch.randn(16, 16, device="tpu")
    torch.tpu.synchronize()
    torch.tpu.reset_metrics()
    with torch.tpu.set_eager_mode(FUSE):
        a = x * 2
        b = a + 1
        del a  # only b can still be read
        c = b.sin()
        assert torch.tpu.metrics().flushes == {}  # nothing ran yet
        c.cpu()
        m = torch.tpu.metrics()
        assert m.flushes == {"to_cpu": 1} and m.fused_ops == 3
        assert m.fused_outputs == 2, "b and c are alive; a was dropped and must not be materialised"
        (c * 3).sum().item()
        torch.nonzero(c > 0)  # a data-dependent shape
        str(c + 1)
        c.add_(1)
        torch.tpu.synchronize()
        d = c * 5  # flushed by the mode change below
    flushes = torch.tpu.metrics().flushes
    for reason in ("to_cpu", "item", "data_dependent", "synchronize", "mode_change"):
        assert flushes.get(reason, 0) >= 1, (reason, flushes)
    torch.testing.assert_close(d.cpu(), ((x.cpu() * 2 + 1).sin() + 1) * 5, rtol=1e-6, atol=1e-6)


def test_backward_and_optimizer_step_ends_run_the_recorded_graph_without_waiting() -> None:
    """When a backward pass that recorded tpu ops ends, and when an optimizer step ends, the caller's pending graph
    is run (dispatched, not waited for), so the device computes forward and backward while the host records the
    optimizer step, and the update while it records the next forward pass. Values as on CPU."""
    from torch_tpu import _deferred

    torch.manual_seed(0)
    cpu = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 4))
    model = copy.deepcopy(cpu).tpu()
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (cpu, model)]
    x = torch.randn(5, 8)
    expected = []
    for _ in range(3):
        opts[0].zero_grad()
        loss = cpu(x).square().mean()
        loss.backward()
        opts[0].step()
        expected.append(loss.item())
    torch.tpu.synchronize()
    torch.tpu.reset_metrics()
    got = []
    with torch.tpu.set_eager_mode(FUSE):
        for step in range(1, 4):
            opts[1].zero_grad()
            loss = model(x.tpu()).square().mean()
            assert _deferred.thread_graph(0) is not None  # the forward pass: recorded
            loss.backward()
            assert _deferred.thread_graph(0) is None, "the backward pass ended: its graph runs"
            flushes = torch.tpu.metrics().flushes
            assert (flushes["backward_start"], flushes["backward_end"], flushes.get("optimizer_step", 0)) == \
                (step, step, step - 1), flushes  # (the forward pass ran as the backward pass started)
            opts[1].step()
            assert _deferred.thread_graph(0) is None, "the optimizer step ended: its graph runs"
            got.append(loss.item())
        grad = torch.autograd.grad(model(x.tpu()).sum(), model[0].weight)[0]  # autograd.grad ends the same way
        assert _deferred.thread_graph(0) is None
        flushes = torch.tpu.metrics().flushes
        assert flushes == {"backward_start": 4, "backward_end": 4, "optimizer_step": 3}, \
            "loss.item() read values already dispatched"
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    for p, q in zip(cpu.parameters(), model.parameters()):
        torch.testing.assert_close(q.cpu(), p, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(grad.cpu(), torch.autograd.grad(cpu(x).sum(), cpu[0].weight)[0], rtol=1e-4, atol=1e-5)


def test_arange_is_recorded_not_a_flush() -> None:
    """torch.arange's size comes from host numbers: under DEFER_AND_FUSE it joins the pending graph (Hugging Face
    models call it in every forward; as a boundary it ran every pending graph first, and could not be captured)."""
    x = torch.randn(6, device="tpu")
    torch.tpu.synchronize()
    torch.tpu.reset_metrics()
    with torch.tpu.set_eager_mode(FUSE):
        y = x * 2
        r = torch.arange(1, 13, 2, device="tpu")
        f = torch.arange(0.5, 3.5, 0.5, device="tpu")
        z = y + r + f
        assert torch.tpu.metrics().flushes == {}
        torch.testing.assert_close(z.cpu(), x.cpu() * 2 + torch.arange(1, 13, 2) + torch.arange(0.5, 3.5, 0.5))


def test_size_limit_flushes(monkeypatch) -> None:
    from torch_tpu import _deferred

    monkeypatch.setattr(_deferred, "_MAX_OPS", 10)
    x = torch.ones(4, device="tpu")
    torch.tpu.reset_metrics()
    with torch.tpu.set_eager_mode(FUSE):
        for _ in range(25):
            x = x + 1
        assert torch.tpu.metrics().flushes.get("size_limit") == 2
        assert x.cpu().tolist() == [26.0] * 4


def test_transfer_between_devices_flushes() -> None:
    out = run_python(
        "import torch\n"
        "torch.tpu.eager_mode = 'DEFER_AND_FUSE'\n"
        "x = torch.arange(4.0, device='tpu:0') * 2\n"
        "y = x.to('tpu:1') + 1\n"
        "print(y.device, y.cpu().tolist(), torch.tpu.metrics().flushes)\n",
        env={"TORCH_TPU_NUM_DEVICES": "2"},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("tpu:1 [1.0, 3.0, 5.0, 7.0]") and "'transfer': 1" in out.stdout


def test_graphs_cached_and_scalars_do_not_recompile() -> None:
    x = torch.randn(32, 32, device="tpu")
    with torch.tpu.set_eager_mode(FUSE):
        for s in (1.0, 2.0):
            ((x * s + 1).relu() - s).cpu()
        torch.tpu.reset_metrics()
        results = [((x * s + 1).relu() - s).cpu() for s in (3.0, 4.5, -1.0)]
        m = torch.tpu.metrics()
    assert m.fused_graph_compiles == 0 and m.compiles == 0 and m.fused_graph_runs == 3
    for s, r in zip((3.0, 4.5, -1.0), results):
        torch.testing.assert_close(r, (x.cpu() * s + 1).relu() - s)


def test_synchronize_from_python_and_from_the_device_guard_runs_the_threads_graph() -> None:
    x = torch.randn(4, device="tpu")
    with torch.tpu.set_eager_mode(FUSE):
        torch.tpu.reset_metrics()
        y = x * 2
        torch.accelerator.synchronize()  # through the C++ device guard's callback
        assert torch.tpu.metrics().flushes == {"synchronize": 1}
        z = y + 1
        torch.tpu.synchronize()
        assert torch.tpu.metrics().flushes == {"synchronize": 2}
        torch.tpu.synchronize()  # nothing pending: no flush
        assert torch.tpu.metrics().flushes == {"synchronize": 2}
    torch.testing.assert_close(z.cpu(), x.cpu() * 2 + 1)


def test_program_collection_drops_the_fused_programs(monkeypatch) -> None:
    from torch_tpu import _deferred, _programs

    made = []
    real = _deferred._fused_program

    def counted(*args):
        made.append(1)
        return real(*args)

    monkeypatch.setattr(_deferred, "_fused_program", counted)  # compiled, or loaded from the disk cache
    x = torch.randn(8, device="tpu")
    with torch.tpu.set_eager_mode(FUSE):
        for _ in range(2):  # an op's first call takes the slow path: the first graph has another structure
            (x * 3 + 1).relu().cpu()
        made.clear()
        (x * 3 + 1).relu().cpu()
        assert not made  # found in memory
        _programs.collect()  # the collector drops the executor's own cache too (registered in torch_tpu/__init__)
        out = (x * 3 + 1).relu().cpu()
        assert len(made) == 1
    torch.testing.assert_close(out, (x.cpu() * 3 + 1).relu())


def test_error_surfaces_at_the_op() -> None:
    a, b = torch.ones(3, device="tpu"), torch.ones(4, device="tpu")
    with torch.tpu.set_eager_mode(FUSE):
        with pytest.raises(RuntimeError, match=r"size of tensor a \(3\) must match the size of tensor b \(4\)"):
            a + b
        assert (a + 1).cpu().tolist() == [2.0] * 3  # the failed op left nothing behind




# The small models by default; the conv net and the LSTM (twice the time) with the extended tests.
@pytest.mark.parametrize("name", ["mlp", "gpt"] + [pytest.param(n, marks=pytest.mark.extended)
                                                    for n in ("resnet", "lstm")])
def test_examples_train_the_same_fused(name: str) -> None:
    mod = load_example(name)
    from _train import train

    def run(mode: str) -> tuple[list[float], nn.Module]:
        model, batches, loss_fn = mod.build(0)
        model = model.tpu()
        with torch.tpu.set_eager_mode(mode), warnings.catch_warnings():
            warnings.simplefilter("error", torch.tpu.RecompilationWarning)  # warm-up is not a storm
            losses = train(model, mod.optimizer(model), batches, loss_fn, "tpu", 10, log=False)
        return losses, model

    never, m1 = run("DEFER_NEVER")
    torch.tpu.reset_metrics()
    fused, m2 = run("DEFER_AND_FUSE")
    metrics = torch.tpu.metrics()
    # Three flushes per step, as its backward pass starts and ends and as its optimizer step ends (loss.item() reads
    # a value the first computed), each a cached graph after the first steps.
    assert metrics.flushes == {"backward_start": 10, "backward_end": 10, "optimizer_step": 10}, metrics.flushes
    assert metrics.fused_graph_compiles <= 4  # forward, backward, the first update (it makes the state), the next
    # The same ops, fused: XLA may order a fused reduction differently (convolutions with batch norm feel it
    # most, ~1e-5 per step here), so losses agree to 1e-5 (1e-4 for the conv net) and every parameter and
    # buffer to 1e-3 absolute (a tenth of a learning-rate step) after 10 steps.
    tol = 1e-4 if name == "resnet" else 1e-5
    torch.testing.assert_close(fused, never, rtol=tol, atol=tol)
    for (n, p), (_, q) in zip(m1.state_dict().items(), m2.state_dict().items()):
        torch.testing.assert_close(q.cpu(), p.cpu(), rtol=1e-4, atol=1e-3, msg=lambda m: f"{n}: {m}")


def test_recompilation_storm_warns_once_with_shapes() -> None:
    w = torch.randn(8, device="tpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in range(1, 14):
            x = torch.ones(n, 8, device="tpu")
            (x * w).sum().item()  # a "step" with a new batch size each time
    storms = [w for w in caught if issubclass(w.category, torch.tpu.RecompilationWarning)]
    assert len(storms) >= 1
    text = str(storms[0].message)
    assert "test_execution_modes.py" in text and "input shapes keep changing" in text and ", 8)" in text
    assert len({str(w.message).split(" called from")[0] for w in storms}) == len(storms), "warned twice for one op"


def test_launch_blocking_waits_and_matches() -> None:
    x = torch.randn(64, 64)
    with torch.tpu.set_eager_mode("DEFER_NEVER_AND_LAUNCH_BLOCKING"):
        y = torch.softmax(x.tpu() @ x.tpu(), dim=1)
    torch.testing.assert_close(y.cpu(), torch.softmax(x @ x, dim=1), rtol=1e-5, atol=1e-5)


def test_metrics_report_compiles_and_fallbacks() -> None:
    torch.tpu.reset_metrics()
    x = torch.randn(3, 5, 7, device="tpu")  # a shape no other test uses: compiles
    (x * 3).cpu()
    with torch.tpu.cpu_fallback():
        torch.fake_quantize_per_tensor_affine(x, 0.1, 0, 0, 255)
    m = torch.tpu.metrics()
    assert m.compiles + m.persistent_cache_hits >= 1 and m.compile_seconds > 0
    assert m.cpu_fallbacks == {"aten::fake_quantize_per_tensor_affine_cachemask": 1}
    assert "flushes" in str(m)
