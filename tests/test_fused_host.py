"""The host side of DEFER_AND_FUSE programs (torch_tpu/_deferred.py): a fused program takes its graph's Python
scalars packed into one host array per scalar type (`_Layout`), and a graph that grows without a synchronization
is cut where its structure repeats, so that the cut graphs reuse one program instead of compiling one per length
(`_period`). Values must be those of DEFER_NEVER and CPU PyTorch (the oracles), and dtypes those of unpacked
Python scalars (weak types)."""

from __future__ import annotations

import pytest
import torch

from torch_tpu import _deferred

FUSE = torch.tpu.EagerMode.DEFER_AND_FUSE


@pytest.fixture(autouse=True)
def _restore_mode():
    yield
    torch.tpu.eager_mode = torch.tpu.EagerMode.DEFER_NEVER


def _scalar_ops(f: torch.Tensor, h: torch.Tensor, i8: torch.Tensor, i64: torch.Tensor, s: float, k: int,
                flag: bool) -> list[torch.Tensor]:
    """Python scalars of every type against tensors of several dtypes: promotion must treat them as weak."""
    return [f * s + k, h * s, h + k, i8 + k, i8 * s, i64 + (k << 40), torch.where(f > 0, f, s),
            f.masked_fill(f < 0, k), torch.full_like(f, flag), (f * 1j + s).abs(), torch.clamp(i8, -k, k),
            f.pow(k), (f + s).sum()]


def _inputs() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    f = torch.randn(4, 5, generator=g)
    return [f, f.half(), torch.randint(-100, 100, (4, 5), generator=g, dtype=torch.int8),
            torch.randint(-2**40, 2**40, (4, 5), generator=g)]


@pytest.mark.parametrize("scalars", [(0.5, 3, True), (-1.25, 7, False)], ids=["first", "new_values"])
def test_packed_scalars_keep_dtypes_and_values(scalars) -> None:
    cpu_in = _inputs()
    tpu_in = [t.tpu() for t in cpu_in]
    cpu = _scalar_ops(*cpu_in, *scalars)
    never = [t.cpu() for t in _scalar_ops(*tpu_in, *scalars)]
    with torch.tpu.set_eager_mode(FUSE):
        fused = [t.cpu() for t in _scalar_ops(*tpu_in, *scalars)]
    for a, b, c in zip(fused, cpu, never):
        assert a.dtype == b.dtype == c.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=2e-3, atol=1e-3)
        torch.testing.assert_close(a, c, rtol=0, atol=0)


def test_packed_scalars_are_inputs_not_constants() -> None:
    """New scalar values reuse the program (no compile) and are not baked in."""
    x = torch.randn(8, device="tpu")
    with torch.tpu.set_eager_mode(FUSE):
        for s in (0.5, 1.5):  # the second call may replay the first's trace: both compile at most once
            (x * s + 2).relu().cpu()
        before = torch.tpu.metrics().fused_graph_compiles
        outs = [(x * s + k).relu().cpu() for s, k in ((0.25, 1), (-3.0, 5), (2.0, -7))]
        assert torch.tpu.metrics().fused_graph_compiles == before
    for out, (s, k) in zip(outs, ((0.25, 1), (-3.0, 5), (2.0, -7))):
        torch.testing.assert_close(out, (x.cpu() * s + k).relu())  # (XLA may fuse it into an FMA)



# ---- a graph that grows without a synchronization ----

def _model_and_steps(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.GELU(), torch.nn.LayerNorm(16),
                                torch.nn.Linear(16, 5)).tpu()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(8, 12, generator=g).tpu(), torch.randint(0, 5, (8,), generator=g).tpu()

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

    return model, step


def _run_without_sync(mode, steps: int, train: bool) -> tuple[torch.nn.Module, list[torch.Tensor], dict]:
    """`steps` training steps, or without `train` a stream of forward passes feeding back (no backward pass, no
    optimizer: an inference or decoding loop), that never read a value."""
    model, step = _model_and_steps()
    if not train:
        h = torch.randn(8, 12, generator=torch.Generator().manual_seed(1)).tpu()
        ema = torch.zeros(8, 5, device="tpu")
        head = torch.nn.Linear(5, 12).tpu()

        @torch.no_grad()
        def step() -> torch.Tensor:  # noqa: F811
            nonlocal h
            out = model(h)
            ema.mul_(0.9).add_(out, alpha=0.1)
            h = head(out).tanh()
            return ema.sum()

    with torch.tpu.set_eager_mode(mode):
        step()  # the first step creates the optimizer state: a structure of its own
        torch.tpu.synchronize()
        before = torch.tpu.metrics()
        losses = [step() for _ in range(steps)]  # nothing reads a value
        after = torch.tpu.metrics()
        values = [t.cpu() for t in losses]
    counts = {"compiles": after.fused_graph_compiles - before.fused_graph_compiles,
              "cuts": after.flushes.get("size_limit", 0) - before.flushes.get("size_limit", 0),
              "replays": after.fused_replays - before.fused_replays}
    return model, values, counts


def test_a_graph_growing_without_sync_is_cut_where_it_repeats(monkeypatch) -> None:
    """A stream of 120 steps without a read, graphs capped at 100 ops: cut at the size limit alone, each graph
    started at another point of the step (a new structure to compile each time); cut at a multiple of the step's
    period, the graphs after the first have one structure: compiled once, replayed from then on."""
    monkeypatch.setattr(_deferred, "_MAX_OPS", 100)
    never, never_values, _ = _run_without_sync(torch.tpu.EagerMode.DEFER_NEVER, 120, train=False)
    fused, fused_values, counts = _run_without_sync(FUSE, 120, train=False)
    assert counts["cuts"] >= 10, counts
    assert counts["compiles"] <= 3, counts  # the first graph, the first cut at the period, nothing more
    assert counts["replays"] >= counts["cuts"] - 3, counts
    torch.testing.assert_close(fused_values, never_values, rtol=1e-5, atol=1e-5)


def test_a_training_loop_without_sync_runs_at_each_backward_and_update(monkeypatch) -> None:
    """40 training steps without a read: each backward pass and optimizer step runs its graph as it ends, so no
    graph grows to the size limit, and every step after the first replays the same two programs."""
    monkeypatch.setattr(_deferred, "_MAX_OPS", 100)
    never, never_losses, _ = _run_without_sync(torch.tpu.EagerMode.DEFER_NEVER, 40, train=True)
    fused, fused_losses, counts = _run_without_sync(FUSE, 40, train=True)
    assert counts["cuts"] == 0, counts
    assert counts["compiles"] <= 1, counts  # (the second update: the first created the optimizer's state)
    assert counts["replays"] >= 2 * 40 - 3, counts
    torch.testing.assert_close(fused_losses, never_losses, rtol=1e-5, atol=1e-5)
    for (n, p), (_, q) in zip(never.state_dict().items(), fused.state_dict().items()):
        torch.testing.assert_close(q.cpu(), p.cpu(), rtol=1e-4, atol=1e-4, msg=lambda m: f"{n}: {m}")


def test_the_cut_follows_the_stream_after_a_sync(monkeypatch) -> None:
    """After a synchronization a graph is cut where a value is needed again; a stream of another structure then
    finds its own period (right values, programs reused) and an aperiodic one runs at the size limit."""
    monkeypatch.setattr(_deferred, "_MAX_OPS", 60)
    _, step = _model_and_steps(1)
    x = torch.randn(6, device="tpu")
    xs = x.cpu()
    with torch.tpu.set_eager_mode(FUSE):
        for _ in range(12):
            step()
        x.cpu()  # a read: the graph runs here, not at the cut
        for i in range(130):  # period 3 (a new structure), 390 ops, no sync
            x = (x * 0.5 + i).sin()
            xs = (xs * 0.5 + i).sin()
        torch.testing.assert_close(x.cpu(), xs)
        before = torch.tpu.metrics()
        for i in range(150):  # aperiodic: shapes grow
            x = torch.cat([x, x[:1] * i])
            xs = torch.cat([xs, xs[:1] * i])
        assert torch.tpu.metrics().flushes.get("size_limit", 0) - before.flushes.get("size_limit", 0) >= 4
        torch.testing.assert_close(x.cpu(), xs)


def _python_arg_list(g, a):
    """The recorder's list loop as Python wrote it before runtime/TpuMode.cpp took it over (the oracle)."""
    specs, sigs = [], []
    for v in a:
        t = type(v)
        if t is _deferred.Pending and v.value is None and v.graph is g:
            specs.append(("n", v.node, v.out))
            sigs.append(v.meta)
        elif t in _deferred._ARRAY_TYPES:
            sp, sg = _deferred._input(g, v)
            specs.append(sp)
            sigs.append(sg)
        elif v is None:
            specs.append(None)
            sigs.append(None)
        elif t in _deferred._SCALARS:
            specs.append(("i", len(g.inputs)))
            g.inputs.append(v)
            sigs.append(t)
        else:
            sp, sg = _python_arg_list(g, v) if t is list or t is tuple else _deferred._arg(g, v)
            specs.append(sp)
            sigs.append(sg)
    return ("l", tuple(specs)), tuple(sigs)


def test_a_list_argument_is_recorded_as_the_python_loop_did() -> None:
    """A foreach op's list arguments are recorded by one C++ loop (_deferred._arg_list): every kind of element (this
    graph's placeholders, a computed placeholder, device arrays seen before or not, numbers of each type, None,
    nested lists and tuples, a torch.Size, a constant) gets the spec, signature and graph inputs the Python loop
    gave, and a placeholder of another graph still asks for a transfer."""
    import jax.numpy as jnp

    a, b = jnp.zeros((2, 3), jnp.float32), jnp.ones((4,), jnp.int32)
    _deferred._arg(_deferred._Graph(-1, 0), a)  # the array type is known from here on (as after any first op)

    def items(g, other):
        mine = _deferred.Pending(g, 3, 1, ((2, 3), a.dtype, False))
        done = _deferred.Pending(g, 0, 0, ((2, 3), a.dtype, False))
        done.value = b
        return [mine, a, None, 2, 0.5, True, 1j, [a, b, 3, (None, mine)], (4.0,), torch.Size([2, 3]), "mean", done,
                a, b]

    graphs = []
    for f in (_deferred._arg_list, _python_arg_list):
        g = _deferred._Graph(-1, 0)
        got = f(g, items(g, None))
        graphs.append((got, list(g.inputs), dict(g.input_pos)))
    (got, inputs, pos), (want, want_inputs, want_pos) = graphs
    assert got == want
    assert len(inputs) == len(want_inputs) and all(x is y or x == y for x, y in zip(inputs, want_inputs))
    assert [type(x) for x in inputs] == [type(x) for x in want_inputs]
    assert pos == want_pos
    assert got[0][1][0] == ("n", 3, 1) and got[0][1][1] == ("i", 0)  # the placeholder inline, the array deduplicated

    g, other = _deferred._Graph(-1, 0), _deferred._Graph(-2, 0)
    foreign = _deferred.Pending(other, 0, 0, ((2, 3), a.dtype, False))
    with pytest.raises(_deferred._Transfer) as info:
        _deferred._arg_list(g, [a, foreign])
    assert info.value.pending is foreign


def test_repeated_ops_are_recorded_by_the_cpp_kernel(monkeypatch) -> None:
    """Under DEFER_AND_FUSE a call shaped like an earlier one (a functional or in-place op over whole tpu tensors
    and Python numbers) is recorded by the op's C++ kernel (runtime/TpuDispatch.cpp, its recorded entry): the
    Python kernel is not entered, the op is recorded (nothing runs before the read), and values match CPU."""
    from torch_tpu import _eager

    slow: list[str] = []
    bind, fast_args = _eager.OpKernel.bind, _eager._fast_args

    def counting_bind(self, args, kwargs):
        slow.append(self.name)
        return bind(self, args, kwargs)

    def counting_fast_args(args):
        slow.append("_fast_args")
        return fast_args(args)

    def count(on: bool) -> None:
        monkeypatch.setattr(_eager.OpKernel, "bind", counting_bind if on else bind)
        monkeypatch.setattr(_eager, "_fast_args", counting_fast_args if on else fast_args)

    ac, bc, wc, biasc = torch.randn(4, 3), torch.randn(4, 3), torch.randn(3, 5), torch.randn(5)
    a, b, w, bias = ac.to("tpu"), bc.to("tpu"), wc.to("tpu"), biasc.to("tpu")

    def step(a, b, w, bias):
        y = torch.addmm(bias, (a * 1.5 + b).exp(), w)
        z = torch.sub(y, 1, alpha=2).relu()
        z.mul_(0.5).add_(y)  # in-place, on a placeholder
        return z / (y.abs() + 1)

    want = step(ac, bc, wc, biasc)
    with torch.tpu.set_eager_mode(FUSE):
        for _ in range(2):  # the first call installs the entries, the second is predicted by the first's trace
            step(a, b, w, bias).cpu()
        count(True)
        before = torch.tpu.metrics()
        r = step(a, b, w, bias)
        recorded = torch.tpu.metrics()
        count(False)
        assert slow == [], slow
        assert recorded.fused_graph_runs == before.fused_graph_runs  # recorded, not run
        torch.testing.assert_close(r.cpu(), want)
        after = torch.tpu.metrics()
        assert after.fused_graph_runs == before.fused_graph_runs + 1
        assert after.fused_ops - before.fused_ops >= 11  # every op of the step is in the one graph


def _train_mlp(steps: int) -> tuple[list[torch.Tensor], dict]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32),
                                torch.nn.Linear(32, 4)).to("tpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = torch.randn(8, 16).to("tpu"), torch.randint(0, 4, (8,)).to("tpu")
    losses = []
    with torch.tpu.set_eager_mode(FUSE):
        for i in range(steps):
            if i == 2:
                torch.tpu.synchronize()
                before = torch.tpu.metrics()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        torch.tpu.synchronize()
        after = torch.tpu.metrics()
        losses = [t.cpu() for t in losses]
    counts = {"runs": after.fused_graph_runs - before.fused_graph_runs,
              "ops": after.fused_ops - before.fused_ops,
              "flushes": {k: v - before.flushes.get(k, 0) for k, v in after.flushes.items()}}
    return losses, counts


def test_the_cpp_recorder_records_what_the_python_kernel_did() -> None:
    """A training step recorded with the C++ kernels' recorded entries (and their C++ recording of the op the
    trace predicts) against the same step recorded through the Python kernels: the same losses bit for bit, the
    same number of graphs, ops and flushes by reason (a backward pass's start and end and the optimizer step's end
    run the graphs in both)."""
    from torch_tpu import _C

    python = _C._eager_set_recorder(None)  # recorded calls take the Python kernel
    try:
        want, want_counts = _train_mlp(6)
    finally:
        _C._eager_set_recorder(python)
    got, counts = _train_mlp(6)
    assert all(torch.equal(g, w) for g, w in zip(got, want)), (got, want)
    assert counts == want_counts
    assert all(counts["flushes"].get(r, 0) >= 4 for r in ("backward_start", "backward_end", "optimizer_step")), counts


def test_a_graph_compiled_inside_a_dispatch_mode_is_not_seen_by_it() -> None:
    """A pending graph may be compiled while a user's TorchDispatchMode is active (torch.utils.checkpoint recomputes
    a region under its caching mode, and a compiled region there reads a pending value). Tracing the lowerings makes
    meta tensors for PyTorch's type promotion; the mode must not see them (TorchTitan's selective activation
    checkpointing raised "aten.empty.memory_format encountered during backward but not found in storage")."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: list[str] = []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    xc = torch.randn(3, 7, 11)
    ic = torch.randint(-5, 5, (3, 7, 11), dtype=torch.int32)
    with torch.tpu.set_eager_mode(FUSE):
        y = (xc.to("tpu") * 0.5 + ic.to("tpu")).exp() - ic.to("tpu")  # int32 and float32: promotion when traced
        y.mul_(ic.to("tpu"))  # in place: the cast check (torch.can_cast) when traced
        with Watch():
            torch.tpu.synchronize()  # the graph compiles and runs here, inside the mode
        assert seen == [], seen
        torch.testing.assert_close(y.cpu(), ((xc * 0.5 + ic).exp() - ic) * ic)
