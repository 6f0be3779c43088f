"""DEFER_AND_FUSE replays a recorded step whose structure repeats: ops that follow the trace of an earlier graph
take their node info from it and the graph runs the trace's program. Any divergence (another op, shape, dtype,
static argument, input aliasing, donation pattern) must record normally and compute the right values, never run
a stale program; new values of Python scalars must neither recompile nor be baked in. CPU PyTorch and
DEFER_NEVER are the oracles; `torch.tpu.metrics().fused_replays` shows the replays."""

from __future__ import annotations

import pytest
import torch
from conftest import jax_pairs

FUSE = torch.tpu.EagerMode.DEFER_AND_FUSE


@pytest.fixture(autouse=True)
def _restore_mode():
    yield
    torch.tpu.eager_mode = torch.tpu.EagerMode.DEFER_NEVER


def _step(x: torch.Tensor, w: torch.Tensor, s: float = 0.5, dim: int = 1, ops: tuple[str, str, str] = ("add", "relu", "mul")
          ) -> list[torch.Tensor]:
    first = torch.add if ops[0] == "add" else torch.sub
    y = first(x @ w, s)
    y = torch.relu(y) if ops[1] == "relu" else torch.tanh(y)
    y = torch.softmax(y, dim) * 3.0
    z = y.sum(0)
    last = torch.mul if ops[2] == "mul" else torch.div
    return [y, last(z, 2.0)]


def _fused(*args, **kwargs) -> tuple[list[torch.Tensor], int]:
    """_step under DEFER_AND_FUSE, read back: (CPU results, graphs replayed meanwhile)."""
    before = torch.tpu.metrics().fused_replays
    with torch.tpu.set_eager_mode(FUSE):
        out = [t.cpu() for t in _step(*args, **kwargs)]
    return out, torch.tpu.metrics().fused_replays - before


def _check(out: list[torch.Tensor], x: torch.Tensor, w: torch.Tensor, *args, **kwargs) -> None:
    cpu = _step(x.cpu(), w.cpu(), *args, **kwargs)
    never = [t.cpu() for t in _step(x, w, *args, **kwargs)]
    for a, b, c in zip(out, cpu, never):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b)
        torch.testing.assert_close(a, c, rtol=1e-6, atol=1e-6)


def _warm(x: torch.Tensor, w: torch.Tensor) -> None:
    for _ in range(3):
        out, _ = _fused(x, w)
    out, replays = _fused(x, w)
    assert replays == 1, "the same step again must replay its trace"
    _check(out, x, w)


@pytest.mark.parametrize("ops", [("sub", "relu", "mul"), ("add", "tanh", "mul"), ("add", "relu", "div")],
                         ids=["first_op", "middle_op", "last_op"])
def test_a_different_op_records_normally(ops) -> None:
    x, w = torch.randn(8, 16, device="tpu"), torch.randn(16, 4, device="tpu")
    _warm(x, w)
    out, replays = _fused(x, w, ops=ops)
    assert replays == 0
    _check(out, x, w, ops=ops)
    out, replays = _fused(x, w)  # back to the first structure: right values again
    _check(out, x, w)
    out, replays = _fused(x, w, ops=ops)  # the variant is a structure seen before now: it replays too
    _check(out, x, w, ops=ops)


def test_a_different_shape_or_dtype_records_normally() -> None:
    x, w = torch.randn(8, 16, device="tpu"), torch.randn(16, 4, device="tpu")
    _warm(x, w)
    x6 = torch.randn(6, 16, device="tpu")
    out, replays = _fused(x6, w)
    assert replays == 0 and out[0].shape == (6, 4)
    _check(out, x6, w)
    xd, wd = x.double(), w.double()
    out, replays = _fused(xd, wd)
    assert replays == 0 and out[0].dtype == torch.float64
    _check(out, xd, wd)
    out, replays = _fused(x, w)
    _check(out, x, w)


def test_new_scalar_values_replay_without_recompiling() -> None:
    x, w = torch.randn(8, 16, device="tpu"), torch.randn(16, 4, device="tpu")
    _warm(x, w)
    torch.tpu.reset_metrics()
    for s in (1.5, -2.0, 0.0, 7.25):
        out, replays = _fused(x, w, s)
        assert replays == 1
        _check(out, x, w, s)
    m = torch.tpu.metrics()
    assert m.fused_graph_compiles == 0 and m.compiles == 0, "a scalar's value must be an input, not a constant"
    out, replays = _fused(x, w, 2)  # an int where a float was: another signature, computed right
    assert replays == 0
    _check(out, x, w, 2)


def test_a_different_static_argument_records_normally() -> None:
    x, w = torch.randn(8, 8, device="tpu"), torch.randn(8, 8, device="tpu")
    _warm(x, w)
    out, replays = _fused(x, w, dim=0)  # softmax over the other dimension: same shapes, other values
    assert replays == 0
    _check(out, x, w, dim=0)
    out, _ = _fused(x, w, dim=1)
    _check(out, x, w, dim=1)


def test_a_different_aliasing_records_normally() -> None:
    x, w = torch.randn(8, 8, device="tpu"), torch.randn(8, 8, device="tpu")
    _warm(x, w)
    out, replays = _fused(x, x)  # one array in both places: inputs are deduplicated, another structure
    assert replays == 0
    _check(out, x, x)
    out, replays = _fused(x, w)
    assert replays == 1
    _check(out, x, w)


def test_a_shorter_or_longer_graph_than_the_trace() -> None:
    x = torch.randn(4, 4, device="tpu")
    with torch.tpu.set_eager_mode(FUSE):
        for _ in range(3):
            ((x + 1) * 2).cpu()
        before = torch.tpu.metrics().fused_replays
        short = (x + 1).cpu()  # a prefix of the trace
        long = (((x + 1) * 2) - 3).cpu()  # the trace and one more op
        assert torch.tpu.metrics().fused_replays == before
        again = ((x + 1) * 2).cpu()  # a prefix of the trace predicted now (`long`'s): found by its node ids
    torch.testing.assert_close(short, x.cpu() + 1)
    torch.testing.assert_close(long, (x.cpu() + 1) * 2 - 3)
    torch.testing.assert_close(again, (x.cpu() + 1) * 2)


def test_a_different_donation_pattern_keeps_held_arrays() -> None:
    """An in-place update replays with the old buffer donated, then with it still held elsewhere (not donatable):
    the held array must keep its values."""
    from torch_tpu import _storage

    p = torch.zeros(64, device="tpu")
    u = torch.ones(64, device="tpu")
    with torch.tpu.set_eager_mode(FUSE):
        for _ in range(3):
            p.mul_(2.0).add_(u)
            torch.tpu.synchronize()
        before = torch.tpu.metrics().fused_replays
        held = _storage.read(p)  # the current array, referenced from here: the next program must not consume it
        p.mul_(2.0).add_(u)
        torch.tpu.synchronize()
        assert torch.tpu.metrics().fused_replays - before == 1
    torch.testing.assert_close(torch.tensor(__import__("numpy").array(held)), torch.full((64,), 7.0))
    torch.testing.assert_close(p.cpu(), torch.full((64,), 15.0))


def test_a_step_that_flushes_twice_replays_both_graphs() -> None:
    x, w = torch.randn(8, 8, device="tpu"), torch.randn(8, 8, device="tpu")
    with torch.tpu.set_eager_mode(FUSE):
        def step(s: float) -> tuple[float, torch.Tensor]:
            a = (x @ w + s).sum().item()  # graph A
            return a, (x * a).tanh().cpu()  # graph B
        for s in (0.0, 1.0, 2.0):
            step(s)
        before = torch.tpu.metrics().fused_replays
        results = [(s, step(s)) for s in (3.0, -1.0)]
        assert torch.tpu.metrics().fused_replays - before == 4
    xc, wc = x.cpu(), w.cpu()
    for s, (a, b) in results:
        ac = (xc @ wc + s).sum().item()
        assert a == pytest.approx(ac, rel=1e-5, abs=1e-4)
        torch.testing.assert_close(b, (xc * a).tanh())


def test_training_steps_replay_and_match_cpu() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32),
                                torch.nn.Linear(32, 4))
    import copy

    ref = copy.deepcopy(model)
    model = model.tpu()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    xt, yt = x.tpu(), y.tpu()
    losses, ref_losses = [], []
    torch.tpu.reset_metrics()
    with torch.tpu.set_eager_mode(FUSE):
        for _ in range(6):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(xt), yt)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    for _ in range(6):
        ref_opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(ref(x), y)
        loss.backward()
        ref_opt.step()
        ref_losses.append(loss.item())
    assert torch.tpu.metrics().fused_replays >= 3
    assert losses == pytest.approx(ref_losses, rel=1e-4, abs=1e-5)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.cpu(), q, rtol=1e-4, atol=1e-5)


def test_each_donated_buffer_takes_the_value_written_back_to_it() -> None:
    """An in-place step whose new values are made in another order than their old buffers are first read (AdamW
    makes its new moments before its new parameters): each donated buffer must be paired with the new value of
    its own tensor; paired with another one, XLA copies the old values before it overwrites them (an AdamW step's
    program took twice as long)."""
    from torch_tpu import _C, _deferred

    p = torch.randn(256, device="tpu")
    m = torch.randn(256, device="tpu")
    pc, mc = p.cpu(), m.cpu()
    old = {"p": id(_C._storage_array(p.untyped_storage())[0]), "m": id(_C._storage_array(m.untyped_storage())[0])}
    with torch.tpu.set_eager_mode(FUSE):
        p.mul_(0.5)
        m.add_(p)  # the new m is made first ...
        p.sub_(m)  # ... and the new p, whose old buffer the graph read first, last
        new = {"p": _C._storage_array(p.untyped_storage())[0], "m": _C._storage_array(m.untyped_storage())[0]}
        g = new["p"].graph
        where = {id(a): i for i, a in enumerate(g.inputs)}
        position = {k: where[v] for k, v in old.items()}
        torch.tpu.synchronize()
    (_, outs, donate, _), (_, order) = next(reversed(_deferred._fused.items()))
    assert sorted(donate) == sorted(position.values()), "both old buffers are the graph's to donate"
    program_outs = list(outs) if order is None else [outs[i] for i in order]
    pairs = jax_pairs([((256,), "f32")] * len(donate), [((256,), "f32")] * len(program_outs))
    for name, pos in position.items():
        assert program_outs[pairs[donate.index(pos)]] == (new[name].node, new[name].out), name
    torch.testing.assert_close(m.cpu(), mc + pc * 0.5)
    torch.testing.assert_close(p.cpu(), pc * 0.5 - (mc + pc * 0.5))


def test_the_first_step_records_the_graph_later_steps_record() -> None:
    """An op's first call under DEFER_AND_FUSE records through the fast-path entry it installs, as its later calls
    do: through the slow path it recorded another node (and the views it reads, `w.t()` in each Linear, as nodes of
    their own), so a fresh process compiled its first step's graph and then the same step again."""
    from conftest import run_python

    r = run_python("""
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.GELU(), torch.nn.LayerNorm(16), torch.nn.Linear(16, 5))
model = model.tpu()
x = torch.randn(8, 12).tpu()
torch.tpu.eager_mode = "DEFER_AND_FUSE"
for _ in range(3):
    model.zero_grad()
    model(x).square().mean().backward()
    torch.tpu.synchronize()
m = torch.tpu.metrics()
grads = [p.grad.cpu() for p in model.parameters()]
model = model.cpu()
model.zero_grad()
model(x.cpu()).square().mean().backward()
for g, p in zip(grads, model.parameters()):
    torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-6)
print("compiles", m.fused_graph_compiles, "replays", m.fused_replays)
""", env={"TORCH_TPU_CACHE": "0"}, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    # the forward pass's graph (run as the backward pass starts) and the backward pass's: compiled in the first step,
    # replayed in the next two
    assert r.stdout.split()[-4:] == ["compiles", "2", "replays", "4"], r.stdout
