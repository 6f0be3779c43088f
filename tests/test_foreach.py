"""`_foreach_*` kernels (torch_tpu/_foreach.py): one program over the list, equal to PyTorch's per-tensor loop.

The oracle is CPU PyTorch on PyTorch's own foreach OpInfo samples, functional and in-place forms, in every
execution mode; the program path must be the one taken where it applies, and the loop where it would differ.
"""

from __future__ import annotations

import pytest
import torch
from torch.testing._internal.common_methods_invocations import (
    foreach_binary_op_db,
    foreach_pointwise_op_db,
    foreach_unary_op_db,
)

from torch_tpu import _foreach

EagerMode = torch.tpu.EagerMode
_OPS = [op for op in foreach_unary_op_db + foreach_binary_op_db + foreach_pointwise_op_db
        if op.name.removeprefix("_foreach_") in _foreach._BASES]
_MODES = [EagerMode.DEFER_NEVER, EagerMode.DEFER_AND_FUSE, EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING]


def _to(v, device):
    if isinstance(v, torch.Tensor):
        return v.to(device)
    if isinstance(v, (list, tuple)):
        return type(v)(_to(x, device) for x in v)
    return v


@pytest.fixture
def counts(monkeypatch):
    """How often each path ran: {"program": n, "loop": n}."""
    seen = {"program": 0, "loop": 0}
    real_loop, real_program = _foreach.ForeachKernel.loop, _foreach.ForeachKernel._program

    def loop(self, vals, n):
        seen["loop"] += 1
        return real_loop(self, vals, n)

    def program(self, *a):
        prog = real_program(self, *a)

        def counted(*args):
            seen["program"] += 1
            return prog(*args)

        return counted

    monkeypatch.setattr(_foreach.ForeachKernel, "loop", loop)
    monkeypatch.setattr(_foreach.ForeachKernel, "_program", program)
    for k in _foreach.KERNELS.values():
        monkeypatch.setattr(k, "_progs", {})
    return seen


def test_the_optimizer_families_are_installed() -> None:
    for name in ("_foreach_add_.Scalar", "_foreach_add_.List", "_foreach_mul_.Scalar", "_foreach_lerp_.Scalar",
                 "_foreach_addcmul_.Scalar", "_foreach_addcdiv_.ScalarList", "_foreach_sqrt", "_foreach_div_.ScalarList",
                 "_foreach_add.List", "_foreach_maximum.List"):
        assert name in _foreach.KERNELS, name


@pytest.mark.parametrize("mode", _MODES, ids=lambda m: m.name)
@pytest.mark.parametrize("op", _OPS, ids=lambda op: op.name)
def test_matches_cpu_on_the_opinfo_samples(op, mode, counts) -> None:
    samples = list(op.sample_inputs("cpu", torch.float32, requires_grad=False, num_input_tensors=[3]))
    assert samples
    old = torch.tpu.eager_mode
    torch.tpu.eager_mode = mode
    try:
        for s in samples:
            try:
                expected = op.op(s.input, *s.args, **s.kwargs)
            except (RuntimeError, TypeError):  # PyTorch refuses this sample (e.g. `-` on bool): so must tpu
                with pytest.raises((RuntimeError, TypeError)):
                    [t.cpu() for t in op.op(_to(s.input, "tpu"), *_to(s.args, "tpu"), **_to(s.kwargs, "tpu"))]
                continue
            got = op.op(_to(s.input, "tpu"), *_to(s.args, "tpu"), **_to(s.kwargs, "tpu"))
            for e, g in zip(expected, got):
                assert g.device.type == "tpu" and g.dtype == e.dtype and g.shape == e.shape
                torch.testing.assert_close(g.cpu(), e, equal_nan=True, msg=f"{op.name} {s}")
            if op.inplace_variant is None:
                continue
            cpu_in = [t.clone() for t in s.input]
            tpu_in = _to(cpu_in, "tpu")
            try:
                op.inplace_variant(cpu_in, *s.args, **s.kwargs)
            except RuntimeError as e:  # e.g. an integer result into a float target: tpu must refuse too
                with pytest.raises(RuntimeError):
                    op.inplace_variant(tpu_in, *_to(s.args, "tpu"), **_to(s.kwargs, "tpu"))
                    torch.tpu.synchronize()
                continue
            op.inplace_variant(tpu_in, *_to(s.args, "tpu"), **_to(s.kwargs, "tpu"))
            for c, t in zip(cpu_in, tpu_in):
                torch.testing.assert_close(t.cpu(), c, equal_nan=True, msg=f"{op.name}_ {s}")
    finally:
        torch.tpu.eager_mode = old
    assert counts["program"] > 0


def test_scalars_are_dynamic_and_results_exact(counts) -> None:
    xs_cpu = [torch.randn(4, 3), torch.randn(5)]
    xs = _to(xs_cpu, "tpu")
    for step in range(1, 5):
        torch._foreach_mul_(xs, 1 - 0.01 * step)
        torch._foreach_mul_(xs_cpu, 1 - 0.01 * step)
        torch._foreach_addcdiv_(xs, xs, [x.abs() + 1 for x in xs], [0.1 * step, -0.2 * step])
        torch._foreach_addcdiv_(xs_cpu, xs_cpu, [x.abs() + 1 for x in xs_cpu], [0.1 * step, -0.2 * step])
    for t, c in zip(xs, xs_cpu):
        torch.testing.assert_close(t.cpu(), c)
    assert counts["loop"] == 0
    k = _foreach.KERNELS["_foreach_mul_.Scalar"]
    assert len(k._progs) == 1, "a new scalar value must not make a new program"


def test_in_place_donates_only_arrays_nothing_else_reads(counts) -> None:
    """An in-place call gives a target's buffer to the program only when its storage holds the only reference: a
    clone sharing the array, a Python reference to it, or the same array read as another argument keep theirs; a
    view of a donated storage reads the new value."""
    from torch_tpu import _C

    cpu = [torch.randn(64, 32), torch.randn(100), torch.randn(7)]
    xs = _to(cpu, "tpu")
    view = xs[0][1]
    clone = xs[1].clone()
    assert _C._array(clone) is _C._array(xs[1])  # the clone shares the immutable array
    held = _C._array(xs[2])
    old = [c.clone() for c in cpu]
    before = _foreach.donated_inputs
    torch._foreach_mul_(xs, 2.0)
    torch._foreach_mul_(cpu, 2.0)
    assert _foreach.donated_inputs - before == 1  # xs[0] alone
    torch.testing.assert_close(view.cpu(), cpu[0][1])
    torch.testing.assert_close(clone.cpu(), old[1])
    torch.testing.assert_close(torch.from_numpy(__import__("numpy").asarray(held)), old[2])
    before = _foreach.donated_inputs
    torch._foreach_add_(xs, 1.5)  # every target now owns a fresh array
    torch._foreach_add_(cpu, 1.5)
    assert _foreach.donated_inputs - before == 3
    before = _foreach.donated_inputs
    torch._foreach_addcmul_(xs, xs, xs, 0.5)  # each target is read by the other arguments too
    torch._foreach_addcmul_(cpu, cpu, cpu, 0.5)
    assert _foreach.donated_inputs == before
    for t, c in zip(xs, cpu):
        torch.testing.assert_close(t.cpu(), c)
    torch.testing.assert_close(clone.cpu(), old[1])
    assert counts["loop"] == 0 and counts["program"] == 3


def test_cross_aliased_in_place_runs_the_loop(counts) -> None:
    """a += b; b += a (new a): computing both from the old values would be wrong, so the loop runs."""
    a_c, b_c = torch.ones(3), torch.full((3,), 2.0)
    a, b = a_c.to("tpu"), b_c.to("tpu")
    torch._foreach_add_([a_c, b_c], [b_c, a_c])
    torch._foreach_add_([a, b], [b, a])
    torch.testing.assert_close(a.cpu(), a_c)
    torch.testing.assert_close(b.cpu(), b_c)  # 2 + 3 = 5, not 2 + 1
    assert counts["loop"] == 1 and counts["program"] == 0
    # Views of one storage as two targets: the loop too.
    base_c = torch.arange(6.0)
    base = base_c.to("tpu")
    torch._foreach_mul_([base_c[:3], base_c[2:]], 2.0)
    torch._foreach_mul_([base[:3], base[2:]], 2.0)
    torch.testing.assert_close(base.cpu(), base_c)
    assert counts["loop"] == 2
    # The same tensor as target and as its own argument at the same position is fine (x += x).
    x_c = torch.randn(4)
    x = x_c.to("tpu")
    torch._foreach_add_([x], [x])
    torch._foreach_add_([x_c], [x_c])
    torch.testing.assert_close(x.cpu(), x_c)
    assert counts["program"] == 1


@pytest.mark.parametrize("mode", [EagerMode.DEFER_NEVER, EagerMode.DEFER_AND_FUSE], ids=lambda m: m.name)
def test_views_in_an_argument_list_run_one_program(mode, counts) -> None:
    """An argument list holding a view (a bias gradient kept in its producer's shape, a slice) is read through the
    storage layer element by element while the other elements take the whole-array path, in both eager modes: one
    program, CPU's values. A view of one of the targets' storages at another position still runs the loop."""
    torch.manual_seed(0)
    t_c = [torch.randn(4, 3), torch.randn(6), torch.randn(5)]
    big_c = torch.randn(2, 6)
    o_c = [torch.randn(4, 3), big_c[1], None]  # whole, a row of another storage, strided (below)
    t, o = _to(t_c, "tpu"), _to(o_c, "tpu")
    o[1] = big_c.to("tpu")[1]  # .to() copies views contiguous: take the views on tpu
    base = torch.randn(10).to("tpu")
    o[2], o_c[2] = base[::2], base.cpu()[::2]
    with torch.tpu.set_eager_mode(mode):
        torch._foreach_addcmul_(t, o, o, 0.5)
        got = [x.cpu() for x in t]
    torch._foreach_addcmul_(t_c, o_c, o_c, 0.5)
    for g, w in zip(got, t_c):
        torch.testing.assert_close(g, w)
    assert counts == {"program": 1, "loop": 0}
    # The targets' own storages seen through views at the other position: the loop computes it (a += b.t(), then
    # b += a.t() of the new a).
    a_c, b_c = torch.randn(3, 2), torch.randn(2, 3)
    a, b = a_c.to("tpu"), b_c.to("tpu")
    with torch.tpu.set_eager_mode(mode):
        torch._foreach_add_([a, b], [b.t(), a.t()])
        got = [a.cpu(), b.cpu()]
    torch._foreach_add_([a_c, b_c], [b_c.t(), a_c.t()])
    torch.testing.assert_close(got[0], a_c)
    torch.testing.assert_close(got[1], b_c)
    assert counts["loop"] == 1


def test_mixed_devices_and_cpu_tensors_behave_like_pytorch(counts) -> None:
    x = torch.randn(3, device="tpu")
    with pytest.raises(RuntimeError, match="same device|devices"):
        torch._foreach_add_([x], [torch.randn(3)])
    with pytest.raises(RuntimeError, match="same number of tensors"):
        torch._foreach_add([x, x], [x])


def test_in_place_cast_errors_like_cpu() -> None:
    ints_c = [torch.arange(3), torch.arange(4)]
    ints = _to(ints_c, "tpu")
    with pytest.raises(RuntimeError) as cpu_err:
        torch._foreach_add_(ints_c, 0.5)
    with pytest.raises(RuntimeError, match="can't be cast") as tpu_err:
        torch._foreach_add_(ints, 0.5)
    assert "can't be cast" in str(cpu_err.value)
    torch.testing.assert_close(ints[0].cpu(), torch.arange(3))  # nothing written


@pytest.mark.parametrize("mode", [EagerMode.DEFER_NEVER, EagerMode.DEFER_AND_FUSE], ids=lambda m: m.name)
@pytest.mark.parametrize("opt", ["AdamW", "Adam", "SGD", "RMSprop", "Adagrad"])
def test_foreach_optimizers_train_like_cpu(opt, mode, counts) -> None:
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.GELU(), torch.nn.Linear(16, 3))
    model = torch.nn.Sequential(*[m for m in __import__("copy").deepcopy(ref)]).to("tpu")
    kw = {"SGD": dict(lr=0.1, momentum=0.9, weight_decay=1e-2), "AdamW": dict(lr=1e-2, weight_decay=0.1)}.get(
        opt, dict(lr=1e-2))
    o_ref = getattr(torch.optim, opt)(ref.parameters(), foreach=True, **kw)
    o = getattr(torch.optim, opt)(model.parameters(), foreach=True, **kw)
    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
    old = torch.tpu.eager_mode
    torch.tpu.eager_mode = mode
    try:
        for _ in range(4):
            for m, op_, xx, yy in ((ref, o_ref, x, y), (model, o, x.to("tpu"), y.to("tpu"))):
                op_.zero_grad()
                torch.nn.functional.cross_entropy(m(xx), yy).backward()
                op_.step()
    finally:
        torch.tpu.eager_mode = old
    for (n, p), q in zip(ref.named_parameters(), model.parameters()):
        torch.testing.assert_close(q.cpu(), p, rtol=1e-5, atol=1e-5, msg=n)
    assert counts["program"] > 0
