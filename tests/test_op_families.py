"""Gradients of the op families of issue 13 (embedding_bag, grid_sample, cdist / pdist, ctc_loss,
segment_reduce, ...) against CPU autograd: for a few OpInfo samples, torch.autograd.grad of the op's outputs
(with a random cotangent) with respect to its floating-point inputs, on tpu and on CPU, in DEFER_NEVER and
DEFER_AND_FUSE. Plus the edge cases of those ops that OpInfo samples do not reach (empty bags, padding_idx,
impossible CTC alignments), checked against CPU values."""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.nn.functional as F
import torch_tpu  # noqa: F401
from torch.testing._internal.common_methods_invocations import op_db
from torch.utils._pytree import tree_flatten

from opinfo_harness import _clone, _tpu_sample, op_id

# Fused with the extended tests (tools/test_extended): the OpInfo suite runs a spread of ops fused by default.
MODES = ("DEFER_NEVER", pytest.param("DEFER_AND_FUSE", marks=pytest.mark.extended))

GRAD_OPS = [
    "nn.functional.embedding_bag", "grid_sampler_2d", "nn.functional.grid_sample", "cdist", "nn.functional.pdist",
    "nn.functional.ctc_loss", "_segment_reduce.lengths", "_segment_reduce.offsets",
    "nn.functional.multilabel_margin_loss", "_upsample_bilinear2d_aa",
]


def _grad_inputs(sample) -> list:
    return [t for t in tree_flatten((sample.input, sample.args, sample.kwargs))[0]
            if isinstance(t, torch.Tensor) and t.requires_grad]


def _grads(op, sample, cotangent_seed: int):
    out = op(sample.input, *sample.args, **sample.kwargs)
    outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor) and o.requires_grad]
    gen = torch.Generator().manual_seed(cotangent_seed)
    cots = [torch.randn(o.shape, generator=gen, dtype=o.dtype).to(o.device) for o in outs]
    return torch.autograd.grad(outs, _grad_inputs(sample), cots, allow_unused=True)


def _by_name(name: str):
    return next(op for op in op_db if op_id(op) == name)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", GRAD_OPS)
def test_gradient_matches_cpu(name: str, mode: str) -> None:
    op = _by_name(name)
    torch.manual_seed(zlib.crc32(name.encode()))
    samples = list(op.sample_inputs("cpu", torch.float32, requires_grad=True))[:4]
    assert samples, name
    checked = 0
    for i, sample in enumerate(samples):
        if not _grad_inputs(sample):
            continue
        cpu_sample = sample.transform(_clone)
        expected = _grads(op, cpu_sample, i)
        with torch.tpu.set_eager_mode(mode):
            actual = _grads(op, _tpu_sample(op, sample), i)
        for a, e in zip(actual, expected):
            if e is None:
                assert a is None or not a.cpu().any(), f"{name} sample {i}: tpu has a gradient where CPU has none"
                continue
            assert a.device.type == "tpu"
            torch.testing.assert_close(a.cpu(), e, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name} sample {i}: {m}")
        checked += 1
    assert checked, f"{name}: no sample with a differentiable input"


def _both(fn, *tensors, grad=True):
    """fn's result and the gradients of its sum of outputs for CPU copies and tpu copies of `tensors`."""
    res = []
    for dev in ("cpu", "tpu"):
        ts = [t.detach().to(dev).requires_grad_(grad and t.is_floating_point()) for t in tensors]
        out = fn(*ts)
        gs = ()
        if grad:
            wrt = [t for t in ts if t.requires_grad]
            gs = torch.autograd.grad(out.sum() if out.numel() else out.sum(), wrt)
        res.append((out.detach().cpu(), [g.cpu() for g in gs]))
    return res


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bag_mode", ["sum", "mean", "max"])
def test_embedding_bag_padding_and_empty_bags(bag_mode: str, mode: str) -> None:
    w = torch.randn(6, 4)
    idx = torch.tensor([1, 2, 4, 4, 0, 3, 4, 5])
    off = torch.tensor([0, 2, 2, 5, 6])  # an empty bag, a bag of padding only
    with torch.tpu.set_eager_mode(mode):
        (c, cg), (t, tg) = _both(lambda w: F.embedding_bag(idx.to(w.device), w, off.to(w.device), mode=bag_mode,
                                                           padding_idx=4), w)
    torch.testing.assert_close(t, c)
    torch.testing.assert_close(tg[0], cg[0])


@pytest.mark.parametrize("mode", MODES)
def test_embedding_bag_per_sample_weights_and_last_offset(mode: str) -> None:
    w, psw = torch.randn(7, 3), torch.randn(6)
    idx, off = torch.tensor([0, 6, 2, 2, 5, 1]), torch.tensor([0, 3, 3, 6])
    with torch.tpu.set_eager_mode(mode):
        (c, cg), (t, tg) = _both(lambda w, p: F.embedding_bag(idx.to(w.device), w, off.to(w.device), mode="sum",
                                                              per_sample_weights=p, include_last_offset=True),
                                 w, psw)
    torch.testing.assert_close(t, c)
    for a, e in zip(tg, cg):
        torch.testing.assert_close(a, e)


@pytest.mark.parametrize("bag_mode", ["sum", "mean"])
def test_embedding_bag_scale_grad_by_freq(bag_mode: str) -> None:
    """The oracle is CPU's embedding (whose scale_grad_by_freq is right) summed per bag: CPU's embedding_bag
    backward divides by the count of the wrong index in torch 2.13 (pytorch/pytorch#190063)."""
    w = torch.randn(7, 3)
    idx, off = torch.tensor([0, 6, 2, 2, 5, 1, 5, 3]), [0, 3, 3, 6, 8]
    wc = w.clone().requires_grad_()
    rows = F.embedding(idx, wc, scale_grad_by_freq=True)
    bags = [rows[a:b].sum(0) / (max(b - a, 1) if bag_mode == "mean" else 1) for a, b in zip(off, off[1:])]
    expected = torch.autograd.grad(torch.stack(bags).sum(), wc)[0]
    wt = w.to("tpu").requires_grad_()
    out = F.embedding_bag(idx.to("tpu"), wt, torch.tensor(off[:-1], device="tpu"), mode=bag_mode,
                          scale_grad_by_freq=True)
    torch.testing.assert_close(out.detach().cpu(), torch.stack(bags).detach())
    torch.testing.assert_close(torch.autograd.grad(out.sum(), wt)[0].cpu(), expected)


def test_embedding_bag_bad_index_raises() -> None:
    w = torch.randn(5, 3, device="tpu")
    with pytest.raises(RuntimeError, match="embedding_bag"):
        F.embedding_bag(torch.tensor([1, 7], device="tpu"), w, torch.tensor([0], device="tpu"), mode="max").cpu()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("zero_infinity", [False, True])
def test_ctc_loss_impossible_alignment_and_1d_targets(zero_infinity: bool, mode: str) -> None:
    torch.manual_seed(0)
    lp = torch.randn(6, 3, 5).log_softmax(2)
    targets = torch.tensor([1, 2, 2, 3, 1, 1, 1, 1, 1, 4, 4])  # sample 1 cannot fit in its 3 frames
    il, tl = [6, 3, 5], [3, 5, 3]
    with torch.tpu.set_eager_mode(mode):
        (c, cg), (t, tg) = _both(lambda lp: F.ctc_loss(lp, targets.to(lp.device), il, tl, reduction="none",
                                                       zero_infinity=zero_infinity), lp,
                                 grad=zero_infinity)
    torch.testing.assert_close(t, c)
    if zero_infinity:
        torch.testing.assert_close(tg[0], cg[0])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("padding_mode", ["zeros", "border", "reflection"])
@pytest.mark.parametrize("interp", ["bilinear", "nearest", "bicubic"])
def test_grid_sample_modes(interp: str, padding_mode: str, mode: str) -> None:
    torch.manual_seed(1)
    x, grid = torch.randn(2, 3, 5, 7), torch.rand(2, 4, 6, 2) * 2.6 - 1.3  # some points outside [-1, 1]
    for align in (False, True):
        with torch.tpu.set_eager_mode(mode):
            (c, cg), (t, tg) = _both(lambda x, g: F.grid_sample(x, g, interp, padding_mode, align), x, grid)
        torch.testing.assert_close(t, c, rtol=1e-4, atol=1e-5)
        for a, e in zip(tg, cg):
            torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("p", [0.0, 1.0, 1.5, 2.0, 3.0, float("inf")])
def test_cdist_pdist_norms(p: float) -> None:
    torch.manual_seed(2)
    a, b = torch.randn(2, 5, 3), torch.randn(2, 4, 3)
    (c, cg), (t, tg) = _both(lambda a, b: torch.cdist(a, b, p), a, b)
    torch.testing.assert_close(t, c)
    for x, e in zip(tg, cg):
        torch.testing.assert_close(x, e, rtol=1e-4, atol=1e-5)
    (c, cg), (t, tg) = _both(lambda a: F.pdist(a, p), a[0])
    torch.testing.assert_close(t, c)
    torch.testing.assert_close(tg[0], cg[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("reduce", ["sum", "mean", "max", "min", "prod"])
def test_segment_reduce_empty_nan_ties_initial(reduce: str, mode: str) -> None:
    data = torch.tensor([[1., 3., 2., float("nan"), 5., 0., 4., 2.], [2., 2., 0., 3., 0., 0., 1., 1.]]).T
    lengths = torch.tensor([2, 0, 3, 2, 1])
    for initial in (None, 2.0):
        with torch.tpu.set_eager_mode(mode):
            (c, cg), (t, tg) = _both(lambda d: torch.segment_reduce(d, reduce, lengths=lengths.to(d.device),
                                                                    initial=initial), data)
        torch.testing.assert_close(t, c, equal_nan=True)
        torch.testing.assert_close(tg[0], cg[0], equal_nan=True)


def test_segment_reduce_bad_lengths_raise() -> None:
    d = torch.randn(5, device="tpu")
    with pytest.raises(RuntimeError, match="sum to data.size"):
        torch.segment_reduce(d, "sum", lengths=torch.tensor([2, 2], device="tpu")).cpu()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("nd", [2, 3])
def test_fractional_max_pool_with_given_samples(nd: int, mode: str) -> None:
    """Values, indices and gradient against CPU with the same window offsets (_random_samples)."""
    torch.manual_seed(3)
    x = torch.randn((2, 3) + (9,) * nd)
    samples = torch.rand(2, 3, nd)
    pool = F.fractional_max_pool2d if nd == 2 else F.fractional_max_pool3d
    for out_size in ((4,) * nd, (1,) * nd, (6,) * nd):
        res = []
        for dev in ("cpu", "tpu"):
            xi = x.to(dev).requires_grad_()
            with torch.tpu.set_eager_mode(mode):
                out, idx = pool(xi, 3, output_size=out_size, return_indices=True, _random_samples=samples.to(dev))
                g = torch.autograd.grad(out, xi, torch.arange(out.numel(), dtype=out.dtype).reshape(out.shape)
                                        .to(dev))[0]
            res.append((out.detach().cpu(), idx.cpu(), g.cpu()))
        for a, e in zip(*reversed(res)):
            torch.testing.assert_close(a, e)


def test_fractional_max_pool_draws_from_the_tpu_generator() -> None:
    x = torch.randn(1, 2, 9, 9, device="tpu")
    torch.manual_seed(5)
    a = F.fractional_max_pool2d(x, 3, output_size=4).cpu()
    torch.manual_seed(5)
    b = F.fractional_max_pool2d(x, 3, output_size=4).cpu()
    torch.testing.assert_close(a, b)


@pytest.mark.parametrize("mode", MODES)
def test_rrelu_training_and_eval(mode: str) -> None:
    torch.manual_seed(4)
    x = torch.randn(200)
    with torch.tpu.set_eager_mode(mode):
        (c, cg), (t, tg) = _both(lambda x: F.rrelu(x, 0.1, 0.3, training=False), x)
        torch.testing.assert_close(t, c)
        torch.testing.assert_close(tg[0], cg[0])
        xt = x.to("tpu").requires_grad_()
        torch.manual_seed(7)
        out = F.rrelu(xt, 0.1, 0.3, training=True)
        g = torch.autograd.grad(out.sum(), xt)[0].cpu()
        torch.manual_seed(7)
        again = F.rrelu(x.to("tpu"), 0.1, 0.3, training=True).cpu()
    out = out.detach().cpu()
    torch.testing.assert_close(out, again)  # the tpu generator's seed decides the noise
    neg = x <= 0
    torch.testing.assert_close(out[~neg], x[~neg])
    slope = out[neg] / x[neg]
    assert bool(((slope >= 0.1 - 1e-6) & (slope <= 0.3 + 1e-6)).all())
    assert slope.std() > 0.02  # drawn per element, not one slope
    torch.testing.assert_close(g[neg], slope)
    torch.testing.assert_close(g[~neg], torch.ones_like(g[~neg]))


@pytest.mark.parametrize("mode", MODES)
def test_histogram_weights_density_range(mode: str) -> None:
    torch.manual_seed(6)
    x, w = torch.randn(50), torch.rand(50)
    with torch.tpu.set_eager_mode(mode):
        for kwargs in ({"bins": 7}, {"bins": 5, "range": (-1.0, 0.5), "weight": w, "density": True},
                       {"bins": torch.tensor([-2.0, -0.5, 0.0, 0.1, 3.0]), "weight": w}):
            tk = {k: v.to("tpu") if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
            e = torch.histogram(x, **kwargs)
            a = torch.histogram(x.to("tpu"), **tk)
            torch.testing.assert_close(a.hist.cpu(), e.hist)
            torch.testing.assert_close(a.bin_edges.cpu(), e.bin_edges)
        pts = torch.randn(40, 2)
        e = torch.histogramdd(pts, bins=[3, 4], weight=w[:40], density=True)
        a = torch.histogramdd(pts.to("tpu"), bins=[3, 4], weight=w[:40].to("tpu"), density=True)
        torch.testing.assert_close(a.hist.cpu(), e.hist)
        for ae, ee in zip(a.bin_edges, e.bin_edges):
            torch.testing.assert_close(ae.cpu(), ee)


@pytest.mark.parametrize("mode", MODES)
def test_embedding_max_norm_renormalizes_weight_in_place(mode: str) -> None:
    torch.manual_seed(8)
    w = torch.randn(10, 4)
    idx, off = torch.tensor([1, 2, 3, 1, 9]), torch.tensor([0, 2])
    wc, wt = w.clone(), w.to("tpu")
    with torch.tpu.set_eager_mode(mode):
        e = F.embedding_bag(idx, wc, off, max_norm=0.5, norm_type=1.5)
        a = F.embedding_bag(idx.to("tpu"), wt, off.to("tpu"), max_norm=0.5, norm_type=1.5)
        torch.testing.assert_close(a.cpu(), e)
        torch.testing.assert_close(wt.cpu(), wc)  # rows 1, 2, 3, 9 rescaled, the others untouched
        e = F.embedding(idx, wc, max_norm=0.3)
        a = F.embedding(idx.to("tpu"), wt, max_norm=0.3)
        torch.testing.assert_close(a.cpu(), e)
        torch.testing.assert_close(wt.cpu(), wc)


def test_empty_inputs_histogram_and_fractional_pool() -> None:
    """No data: histogram's default extent is [0, 1] (not the +-0.5 around an empty range); a pool over zero
    planes gives an empty result and gradient."""
    for x in (torch.empty(0), torch.empty(5, 0, 5)):
        e, a = torch.histogram(x, 3), torch.histogram(x.to("tpu"), 3)
        torch.testing.assert_close(a.hist.cpu(), e.hist)
        torch.testing.assert_close(a.bin_edges.cpu(), e.bin_edges)
    x = torch.randn(0, 1, 4, 5, 4, device="tpu", requires_grad=True)
    out = F.fractional_max_pool3d(x, (2, 2, 1), output_size=2)
    assert out.shape == (0, 1, 2, 2, 2)
    assert torch.autograd.grad(out.sum(), x)[0].shape == x.shape


def _pool_input(shape: tuple, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Few distinct values (ties in most windows), some -inf, and NaNs where `seed` is odd."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-2, 3, shape, generator=g).to(dtype)
    x.view(-1)[torch.randperm(x.numel(), generator=g)[: x.numel() // 7]] = -float("inf")
    if seed % 2:
        x.view(-1)[torch.randperm(x.numel(), generator=g)[: x.numel() // 11]] = float("nan")
    return x


@pytest.mark.parametrize("case,dtype", [
    ((2, (2, 3, 9, 8), dict(kernel_size=3, stride=2, padding=1)), torch.float32),  # ResNet's stem pool
    ((2, (2, 3, 9, 8), dict(kernel_size=3, stride=2, padding=1)), torch.bfloat16),
    ((2, (1, 2, 7, 7), dict(kernel_size=(2, 3), stride=(2, 1), padding=(1, 1), ceil_mode=True)), torch.float32),
    ((2, (3, 10, 11), dict(kernel_size=3, stride=2, dilation=2, padding=1)), torch.float32),  # unbatched, dilated
    ((2, (1, 1, 5, 5), dict(kernel_size=2, stride=2)), torch.float32),  # windows never reach the last row/column
    ((3, (1, 2, 5, 6, 4), dict(kernel_size=(3, 2, 2), stride=(2, 1, 2), padding=(1, 0, 1), ceil_mode=True)),
     torch.bfloat16),
    ((1, (2, 3, 12), dict(kernel_size=4, stride=3, padding=2)), torch.float32),
])
def test_max_pool_ties_nan_and_inf_match_cpu(case: tuple, dtype: torch.dtype) -> None:
    """Values, indices and gradient equal to CPU's, bit for bit, where ties, -inf (also whole windows of it and of
    padding) and NaN are common: the first max of a window wins, a window with NaN gives its last NaN. (The
    cotangent's small integers sum exactly in bfloat16 too, whatever the order of accumulation.)"""
    nd, shape, kw = case
    pool = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}[nd]
    for seed in (0, 1):
        x = _pool_input(shape, dtype, seed)
        res = []
        for dev in ("cpu", "tpu"):
            xi = x.to(dev).requires_grad_()
            out, idx = pool(xi, return_indices=True, **kw)
            cot = (torch.arange(out.numel()) % 7).reshape(out.shape).to(dtype).to(dev)
            grad = torch.autograd.grad(out, xi, cot)[0]
            res.append((out.detach().cpu(), idx.cpu(), grad.cpu()))
        (v_cpu, i_cpu, g_cpu), (v, i, g) = res
        assert torch.equal(i, i_cpu), (seed, i, i_cpu)
        torch.testing.assert_close(v, v_cpu, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(g, g_cpu, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32])
def test_adaptive_max_pool_nan_and_ties_match_cpu(dtype: torch.dtype) -> None:
    for seed in (0, 1):
        x = _pool_input((2, 3, 7, 9), dtype, seed)
        for out_size in ((3, 4), (1, 1)):
            v_cpu, i_cpu = F.adaptive_max_pool2d(x, out_size, return_indices=True)
            v, i = F.adaptive_max_pool2d(x.to("tpu"), out_size, return_indices=True)
            assert torch.equal(i.cpu(), i_cpu), (seed, out_size)
            torch.testing.assert_close(v.cpu(), v_cpu, rtol=0, atol=0, equal_nan=True)
