"""Graph capture and replay (torch.tpu.TPUGraph, torch.tpu.graph, torch.accelerator.Graph): CUDA graphs' contract,
checked against CPU PyTorch running the same steps eagerly."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from conftest import jax_pairs, run_python


def _capture(fn):
    g = torch.tpu.TPUGraph()
    with torch.tpu.graph(g):
        out = fn()
    return g, out


def test_replay_reads_static_inputs_and_writes_static_outputs():
    x = torch.randn(8, 16, device="tpu")
    y = torch.randn(8, 16, device="tpu")
    g, z = _capture(lambda: (x * 2 + y.sin()).relu().sum(1))
    for _ in range(3):
        xc = torch.randn(8, 16)
        x.copy_(xc.to("tpu"))
        g.replay()
        torch.testing.assert_close(z.cpu(), (xc * 2 + y.cpu().sin()).relu().sum(1))


def test_capture_beside_a_live_functional_tensor():
    """A functionalization wrapper of a tpu tensor (AOTAutograd makes them while compiling; an exception's frames
    can keep one alive) has a storage that says tpu but is no torch_tpu buffer: a capture started while one is
    alive must neither fail on it ("expected a tpu storage") nor lose the tensor it wraps, which it still binds."""
    from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode

    x = torch.randn(8, 16, device="tpu")
    with FunctionalTensorMode():
        wrapper = FunctionalTensor.to_functional(x)
    assert wrapper.untyped_storage().device.type == "tpu"
    g, z = _capture(lambda: (x * 3).sum(0))
    xc = torch.randn(8, 16)
    x.copy_(xc.to("tpu"))
    g.replay()
    torch.testing.assert_close(z.cpu(), (xc * 3).sum(0))
    del wrapper


def test_capture_runs_nothing_until_replay():
    w = torch.randn(5, device="tpu")
    before = w.cpu()
    g, _ = _capture(lambda: w.mul_(2).add_(1))
    torch.testing.assert_close(w.cpu(), before)  # a capture records; it runs nothing
    g.replay()
    torch.testing.assert_close(w.cpu(), before * 2 + 1)
    g.replay()  # each replay reads what the last one wrote
    torch.testing.assert_close(w.cpu(), (before * 2 + 1) * 2 + 1)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32, bias=False), nn.BatchNorm1d(32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))


@pytest.mark.parametrize("mode", ["DEFER_NEVER", "DEFER_AND_FUSE"])
def test_training_step_replays_like_eager_cpu(mode):
    """Forward, backward and AdamW captured once and replayed on new batches give CUDA graphs' result: the steps
    CPU PyTorch takes eagerly on the same batches."""
    torch.manual_seed(1)
    batches = [(torch.randn(8, 16), torch.randint(0, 4, (8,))) for _ in range(6)]
    base = _model()

    cpu = copy.deepcopy(base)
    opt_c = torch.optim.AdamW(cpu.parameters(), lr=1e-2)
    losses_cpu = []
    for x, y in batches:
        opt_c.zero_grad()
        loss = F.cross_entropy(cpu(x), y)
        loss.backward()
        opt_c.step()
        losses_cpu.append(loss.item())

    with torch.tpu.set_eager_mode(mode):
        m = copy.deepcopy(base).to("tpu")
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, capturable=True)
        sx = torch.zeros(8, 16, device="tpu")
        sy = torch.zeros(8, dtype=torch.long, device="tpu")
        losses = []

        def step():
            loss = F.cross_entropy(m(sx), sy)
            loss.backward()
            opt.step()
            return loss

        for x, y in batches[:2]:  # warm-up, as with CUDA graphs: the optimizer's state exists before the capture
            sx.copy_(x.to("tpu"))
            sy.copy_(y.to("tpu"))
            opt.zero_grad(set_to_none=True)
            losses.append(step().item())
        opt.zero_grad(set_to_none=True)
        g, static_loss = _capture(step)
        for x, y in batches[2:]:
            sx.copy_(x.to("tpu"))
            sy.copy_(y.to("tpu"))
            g.replay()
            losses.append(static_loss.item())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(losses_cpu), rtol=1e-4, atol=1e-5)
    for p, q in zip(m.parameters(), cpu.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-4, atol=1e-5)
    for b, c in zip(m.buffers(), cpu.buffers()):  # BatchNorm's running statistics and batch count, updated in place
        torch.testing.assert_close(b.cpu(), c, rtol=1e-4, atol=1e-5)



def test_each_donated_buffer_takes_the_value_written_back_to_it():
    """A captured AdamW step donates its parameters' and moments' buffers: JAX pairs donated inputs with outputs
    of their shape and dtype in order, so the outputs must come in the donated storages' order, each storage's
    buffer taking its own new value (paired with another storage's, XLA copies the old values first: 27 copies in
    the issue-12 MLP step)."""
    m = _model().to("tpu")
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, capturable=True)
    sx, sy = torch.randn(8, 16, device="tpu"), torch.randint(0, 4, (8,), device="tpu")

    def step():
        loss = F.cross_entropy(m(sx), sy)
        loss.backward()
        opt.step()
        return loss

    step().item()
    opt.zero_grad(set_to_none=True)
    g, _ = _capture(step)
    written = {st._cdata: k for st, k, _ in g._writes}
    metas = [g._graph.entries[n][3][1][o][:2] for n, o in g._outs]
    reads = {i: (st, sig[:2]) for i, st, sig in g._reads}
    assert len(g._donate) >= 2 * len(list(m.parameters())), "parameters and both moments are donated"
    pairs = jax_pairs([reads[i][1] for i in g._donate], metas)
    for d, k in pairs.items():
        i = g._donate[d]
        assert written[reads[i][0]._cdata] == k, f"donated input {i} is paired with another storage's value"

def test_each_replay_draws_new_random_numbers():
    torch.tpu.manual_seed(3)
    x = torch.ones(4096, device="tpu")
    state = torch.tpu.get_rng_state()
    g, out = _capture(lambda: F.dropout(x, 0.5))
    masks = []
    for _ in range(3):
        g.replay()
        o = out.cpu()
        assert set(o.unique().tolist()) <= {0.0, 2.0}  # kept elements scaled by 1/(1-p)
        assert 0.4 < (o == 0).float().mean().item() < 0.6
        masks.append(o)
    assert not torch.equal(masks[0], masks[1]) and not torch.equal(masks[1], masks[2])
    assert not torch.equal(torch.tpu.get_rng_state(), state)  # the generator advances per replay


def test_a_value_needed_inside_the_capture_raises_and_leaves_tensors_as_they_were():
    w = torch.randn(6, device="tpu")
    before = w.cpu()
    g = torch.tpu.TPUGraph()
    with pytest.raises(RuntimeError, match="while a tpu graph was being captured"):
        with torch.tpu.graph(g):
            w.add_(1)
            if w.sum().item() > 0:  # a Python branch on a value: nothing has run yet
                w.mul_(2)
    assert not torch.tpu.is_current_stream_capturing()
    torch.testing.assert_close(w.cpu(), before)
    torch.testing.assert_close((w + 1).cpu(), before + 1)  # the device works as before
    with pytest.raises(RuntimeError, match="capture failed"):
        g.replay()


def test_a_capture_whose_block_raised_does_not_replay():
    w = torch.zeros(3, device="tpu")
    g = torch.tpu.TPUGraph()
    with pytest.raises(ValueError):
        with torch.tpu.graph(g):
            w.add_(1)
            raise ValueError("user code failed half way")
    with pytest.raises(RuntimeError, match="capture failed.*half way"):
        g.replay()
    assert w.cpu().tolist() == [0.0, 0.0, 0.0]


def test_adam_without_capturable_is_refused():
    m = nn.Linear(4, 4).to("tpu")
    opt = torch.optim.AdamW(m.parameters())
    m(torch.ones(2, 4, device="tpu")).sum().backward()
    opt.step()
    weight = m.weight.detach().cpu()
    with pytest.raises(RuntimeError, match="capturable is False"):
        with torch.tpu.graph(torch.tpu.TPUGraph()):
            opt.step()
    torch.testing.assert_close(m.weight.detach().cpu(), weight)


def test_a_host_copy_inside_the_capture_is_refused():
    x = torch.zeros(3, device="tpu")
    with pytest.raises(RuntimeError, match="copy_ from cpu to tpu:0 .* while a tpu graph is being captured"):
        with torch.tpu.graph(torch.tpu.TPUGraph()):
            x.copy_(torch.ones(3))


def test_is_current_stream_capturing():
    seen = []
    with torch.tpu.graph(torch.tpu.TPUGraph()):
        seen.append(torch.tpu.is_current_stream_capturing())
    assert seen == [True] and not torch.tpu.is_current_stream_capturing()


def test_torch_accelerator_graph_on_tpu():
    torch.accelerator.empty_host_cache()  # (null host allocator before: a segmentation fault)
    x = torch.arange(4.0, device="tpu")
    g = torch.accelerator.Graph()
    with g:
        x.mul_(3).sub_(1)
    torch.testing.assert_close(x.cpu(), torch.arange(4.0))
    g.replay()
    torch.testing.assert_close(x.cpu(), torch.arange(4.0) * 3 - 1)
    g.reset()
    with pytest.raises(RuntimeError, match="nothing was captured"):
        g.replay()


def test_replay_refuses_a_resized_static_input():
    x = torch.randn(4, device="tpu")
    g, out = _capture(lambda: x * 2)
    x.resize_(8)
    with pytest.raises(RuntimeError, match="held shape \\(4,\\)"):
        g.replay()


def test_replay_after_a_static_input_was_read_and_written_through_a_reshaping_view():
    # A whole read or write through a view of another shape keeps the storage's array in that shape (a bias
    # gradient read between replays, `x.view(-1).copy_(...)`): the same bytes, which the replay reads as captured.
    x = torch.randn(2, 6, device="tpu")
    g, out = _capture(lambda: x.sum(0) * 2)
    flat = x.view(12)
    for k in range(3):
        new = torch.randn(12)
        torch.testing.assert_close(torch._foreach_mul([flat], 1.0)[0].cpu(), x.cpu().view(12))  # a read
        flat.copy_(new.to("tpu"))  # a write
        g.replay()
        torch.testing.assert_close(out.cpu(), new.view(2, 6).sum(0) * 2)


def test_replay_keeps_arrays_pending_work_still_reads():
    """A replay donates the arrays of the state it overwrites only when nothing else holds them: here a graph
    recorded before the replay still reads the parameter's old value."""
    w = torch.randn(16, device="tpu")
    before = w.cpu()
    g, _ = _capture(lambda: w.mul_(2))
    with torch.tpu.set_eager_mode("DEFER_AND_FUSE"):
        y = w * 1  # recorded: reads w's array of now
        g.replay()
        torch.testing.assert_close(y.cpu(), before)
        torch.testing.assert_close(w.cpu(), before * 2)
        g.replay()
        z = w + 0
    torch.testing.assert_close(z.cpu(), before * 4)


def test_a_view_of_a_captured_output_sees_each_replay():
    x = torch.randn(4, device="tpu")
    kept = {}

    def body():
        t = x * 3
        kept["view"] = t[:2]  # (a view: its storage is found, so it is an output and holds zeros until replay)
        return t

    g, out = _capture(body)
    g.replay()
    torch.testing.assert_close(kept["view"].cpu(), x.cpu()[:2] * 3)
    torch.testing.assert_close(out.cpu(), x.cpu() * 3)


@pytest.mark.parametrize("mode", ["global", "thread_local"])
def test_another_thread_reading_a_captured_result_gets_an_error(mode):
    """The value does not exist before replay(): the other thread's read raises; in "global" mode (CUDA's default)
    that also fails the capture, in "thread_local" the capture goes on."""
    a = torch.ones(3, device="tpu")
    errors: list[str] = []
    go, done = threading.Event(), threading.Event()

    def reader():
        go.wait(30)
        try:
            (a + 1).cpu()
        except RuntimeError as e:
            errors.append(str(e))
        done.set()

    t = threading.Thread(target=reader)
    t.start()
    g = torch.tpu.TPUGraph()
    with torch.tpu.graph(g, capture_error_mode=mode):
        a.mul_(3)
        go.set()
        done.wait(30)
    t.join(30)
    assert len(errors) == 1 and "another thread" in errors[0]
    if mode == "global":
        with pytest.raises(RuntimeError, match="capture failed"):
            g.replay()
        assert a.cpu().tolist() == [1.0, 1.0, 1.0]
    else:
        g.replay()
        assert a.cpu().tolist() == [3.0, 3.0, 3.0]


def test_a_captured_tensor_moved_to_another_device_is_refused():
    """A transfer needs the value now; inside a capture a bound tensor has none yet (it raised an obscure JAX
    type error before)."""
    r = run_python(
        "import torch\n"
        "x = torch.randn(4, device='tpu:0')\n"
        "try:\n"
        "    with torch.tpu.graph(torch.tpu.TPUGraph()):\n"
        "        x.to('tpu:1')\n"
        "except RuntimeError as e:\n"
        "    print('refused:', e)\n"
        "print('after', (x + 1).cpu().shape)\n",
        env={"TORCH_TPU_NUM_DEVICES": "2"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "refused: torch_tpu: this tensor's storage is bound to a tpu graph being captured" in r.stdout
    assert "(transfer)" in r.stdout and "after torch.Size([4])" in r.stdout
