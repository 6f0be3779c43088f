"""Autograd on tpu through the kernel library's backward ops: small models train exactly like on CPU."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F


def _train(model: nn.Module, make_opt, x: torch.Tensor, y: torch.Tensor, device: str, steps: int) -> list[float]:
    m = copy.deepcopy(model).to(device)
    opt = make_opt(m.parameters())
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        out = m(x.to(device))
        loss = F.cross_entropy(out.flatten(0, -2) if out.dim() > 2 else out, y.to(device).flatten())
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


MODELS = {
    "mlp": lambda: (nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 10)),
                    torch.randn(16, 32), torch.randint(0, 10, (16,))),
    "cnn": lambda: (nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                                  nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                  nn.Linear(8, 10)),
                    torch.randn(4, 3, 12, 12), torch.randint(0, 10, (4,))),
    "embedding_layernorm": lambda: (nn.Sequential(nn.Embedding(50, 16), nn.LayerNorm(16), nn.Linear(16, 50)),
                                    torch.randint(0, 50, (4, 6)), torch.randint(0, 50, (4, 6))),
}


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("optim", ["sgd_momentum", "adamw"])
def test_training_matches_cpu(name: str, optim: str) -> None:
    torch.manual_seed(0)
    model, x, y = MODELS[name]()
    make_opt = {"sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
                "adamw": lambda p: torch.optim.AdamW(p, lr=1e-3)}[optim]
    cpu = _train(model, make_opt, x, y, "cpu", 5)
    tpu = _train(model, make_opt, x, y, "tpu", 5)
    torch.testing.assert_close(tpu, cpu, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU])
@pytest.mark.parametrize("bias", [True, False])
def test_recurrent_layers_forward_and_backward(cls, bias: bool) -> None:
    torch.manual_seed(0)
    m = cls(8, 16, num_layers=2, batch_first=True, bias=bias)
    x = torch.randn(3, 5, 8, requires_grad=True)
    mt = copy.deepcopy(m).to("tpu")
    xt = x.detach().to("tpu").requires_grad_()
    out_c, out_t = m(x)[0], mt(xt)[0]
    out_c.pow(2).sum().backward()
    out_t.pow(2).sum().backward()
    torch.testing.assert_close(out_t.cpu(), out_c.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(xt.grad.cpu(), x.grad, rtol=1e-5, atol=1e-6)
    for p, q in zip(m.parameters(), mt.parameters()):
        assert q.grad.device.type == "tpu"
        torch.testing.assert_close(q.grad.cpu(), p.grad, rtol=1e-5, atol=1e-5)


def test_gradients_stay_on_tpu_and_accumulate() -> None:
    w = torch.randn(4, 3, device="tpu", requires_grad=True)
    x = torch.randn(2, 4, device="tpu")
    for _ in range(2):
        (x @ w).sum().backward()
    assert w.grad.device.type == "tpu"
    torch.testing.assert_close(w.grad.cpu(), 2 * x.cpu().sum(0, keepdim=True).t().expand(4, 3))
    with torch.no_grad():
        y = x @ w
    assert not y.requires_grad


def test_retain_graph_hooks_clip_and_modes() -> None:
    w = torch.randn(3, 3, device="tpu", requires_grad=True)
    wc = w.detach().cpu().requires_grad_()
    seen = []
    w.register_hook(lambda g: seen.append(g.device.type) or g * 2)
    for t in (w, wc):
        y = (t.tanh() @ t.sigmoid()).sum()
        y.backward(retain_graph=True)
        y.backward()  # second backward through the retained graph accumulates
    assert seen == ["tpu", "tpu"]
    torch.testing.assert_close(w.grad.cpu(), 2 * wc.grad)
    total = torch.nn.utils.clip_grad_norm_([w], max_norm=0.5)
    assert total.device.type == "tpu"
    torch.testing.assert_close(w.grad.norm().cpu(), torch.tensor(0.5), rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        assert not (w * 2).requires_grad
    with torch.inference_mode():
        z = w * 2
    assert z.is_inference() and z.device.type == "tpu"


def test_gradient_accumulation_equals_full_batch() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(6, 2).tpu()
    x = torch.randn(8, 6, device="tpu")
    full = torch.autograd.grad(lin(x).pow(2).mean(), lin.weight)[0]
    for half in (x[:4], x[4:]):
        (lin(half).pow(2).mean() / 2).backward()
    torch.testing.assert_close(lin.weight.grad.cpu(), full.cpu(), rtol=1e-5, atol=1e-6)


def _input_grads(f, xs: list[torch.Tensor], dev: str, seed: int = 0) -> list[torch.Tensor]:
    """Gradients of f's output (one random upstream gradient, the same on both devices) w.r.t. xs."""
    ins = [x.to(dev).requires_grad_() for x in xs]
    out = f(*ins)
    up = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype).to(dev)
    return [g.cpu() for g in torch.autograd.grad(out, ins, up)]


def _check_grads(f, *xs: torch.Tensor) -> None:
    want = _input_grads(f, list(xs), "cpu")
    got = _input_grads(f, list(xs), "tpu")
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


# The pads' backward kernels (reflection/replication_pad{1,2,3}d_backward): overlapping reads sum.
PADS = {
    "reflection1d": (nn.ReflectionPad1d((3, 1)), (2, 3, 6)),
    "reflection1d_unbatched": (nn.ReflectionPad1d(2), (3, 5)),
    "reflection2d": (nn.ReflectionPad2d((1, 2, 3, 0)), (2, 2, 5, 4)),
    "reflection3d": (nn.ReflectionPad3d((1, 1, 2, 0, 0, 1)), (1, 2, 3, 4, 3)),
    "replication1d": (nn.ReplicationPad1d((4, 2)), (2, 3, 3)),
    "replication2d": (nn.ReplicationPad2d((2, 3, 1, 4)), (2, 2, 3, 3)),
    "replication2d_unbatched": (nn.ReplicationPad2d(2), (2, 3, 3)),
    "replication3d": (nn.ReplicationPad3d((1, 2, 0, 3, 2, 1)), (1, 2, 2, 3, 2)),
    "F.pad_reflect": (lambda x: F.pad(x, (2, 2, 1, 1), mode="reflect"), (1, 3, 4, 4)),
    "F.pad_replicate": (lambda x: F.pad(x, (3, 0), mode="replicate"), (2, 2, 5)),
    "F.pad_circular": (lambda x: F.pad(x, (2, 1), mode="circular"), (2, 2, 5)),
    "negative_crop": (nn.ReplicationPad2d((-1, 2, 1, -1)), (1, 1, 4, 4)),
}


@pytest.mark.parametrize("name", list(PADS))
def test_padding_backward_matches_cpu(name: str) -> None:
    f, shape = PADS[name]
    _check_grads(f, torch.randn(*shape))


def test_padding_backward_modes_and_errors() -> None:
    x = torch.randn(2, 3, 6, requires_grad=True)
    for mode in (torch.tpu.EagerMode.DEFER_AND_FUSE, torch.tpu.EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING):
        saved = torch.tpu.eager_mode
        torch.tpu.eager_mode = mode
        try:
            got = _input_grads(lambda t: F.pad(t, (2, 3), mode="reflect"), [x.detach()], "tpu")
        finally:
            torch.tpu.eager_mode = saved
        want = _input_grads(lambda t: F.pad(t, (2, 3), mode="reflect"), [x.detach()], "cpu")
        torch.testing.assert_close(got[0], want[0])
    g = torch.ones(2, 3, 9, device="tpu")
    with pytest.raises(RuntimeError, match="reflection_pad1d_backward"):
        torch.ops.aten.reflection_pad1d_backward(g, x.detach().to("tpu"), [2, 2])


def test_conv_with_reflect_padding_trains_like_cpu() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1, padding_mode="reflect"), nn.ReplicationPad2d(1),
                          nn.Conv2d(4, 3, 3, padding=1, padding_mode="replicate"), nn.Flatten(), nn.Linear(3 * 8 * 8, 5))
    x, y = torch.randn(3, 2, 6, 6), torch.randint(0, 5, (3,))
    opt = lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)  # noqa: E731
    cpu = _train(model, opt, x, y, "cpu", 4)
    tpu = _train(model, opt, x, y, "tpu", 4)
    assert cpu[-1] < cpu[0]
    torch.testing.assert_close(torch.tensor(tpu), torch.tensor(cpu), rtol=1e-4, atol=1e-4)


def test_stft_backward_matches_cpu() -> None:
    """stft pads reflectively (center=True): its backward needs reflection_pad1d_backward."""
    w = torch.hann_window(16)
    f = lambda s: torch.stft(s, 16, hop_length=4, window=w.to(s.device), return_complex=True).abs()  # noqa: E731
    _check_grads(f, torch.randn(2, 64))


@pytest.mark.parametrize("args", [(1, 3, 2), (0, 2, 2), (-1, 3, 1), (2, 1, 3), (1, 5, 5), (0, 4, 3)])
def test_unfold_backward_matches_cpu(args: tuple[int, int, int]) -> None:
    dim, size, step = args
    _check_grads(lambda t: t.unfold(dim, size, step) * 2, torch.randn(4, 5, 6))


def test_unfold_backward_0d_and_after_view() -> None:
    _check_grads(lambda t: t.unfold(0, 1, 1) * 3, torch.randn(()))
    _check_grads(lambda t: t.t().unfold(1, 2, 1).sum(-1), torch.randn(5, 4))


def test_sgn_backward_and_efficientzerotensor() -> None:
    """sgn's gradient of a real input is autograd's _efficientzerotensor: zeros of the input's shape on tpu."""
    x = torch.randn(3, 4)
    _check_grads(lambda t: t.sgn() * t, x)
    _check_grads(lambda t: t.sgn(), x)
    _check_grads(lambda t: t.sign() + t.sgn().sum(), x)
    z = torch.ops.aten._efficientzerotensor([2, 3], dtype=torch.float64, device="tpu")
    assert z.device.type == "tpu" and z.dtype == torch.float64 and z.shape == (2, 3)
    torch.testing.assert_close(z.cpu(), torch.zeros(2, 3, dtype=torch.float64))
    torch.testing.assert_close((z + 1).cpu(), torch.ones(2, 3, dtype=torch.float64))
    zc = torch.complex(torch.randn(4), torch.randn(4))
    _check_grads(lambda t: t.sgn().real, zc)


def test_pad_unfold_sgn_gradients_under_compile() -> None:
    def f(t: torch.Tensor) -> torch.Tensor:
        return ((t.sgn() * t).sum() + t.unfold(1, 2, 1).pow(2).sum() + t.t().unfold(0, 3, 1).sum()
                + F.pad(t[None], (2, 1), mode="reflect").pow(2).sum()
                + F.pad(t[None, None], (1, 2, 2, 1), mode="replicate").pow(3).sum())

    x = torch.randn(3, 4)
    cf = torch.compile(f, backend="tpu")
    a = x.to("tpu").requires_grad_()
    out = cf(a)
    (g,) = torch.autograd.grad(out, a)
    xc = x.clone().requires_grad_()
    want = f(xc)
    (wg,) = torch.autograd.grad(want, xc)
    torch.testing.assert_close(out.detach().cpu(), want.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g.cpu(), wg, rtol=1e-5, atol=1e-5)


def test_adaptive_avg_pool3d_backward_out_form_like_cpu() -> None:
    """The legacy out= overload writes the gradient autograd's _adaptive_avg_pool3d_backward gives."""
    g = torch.Generator().manual_seed(0)
    x, go = torch.randn(2, 3, 5, 6, 7, generator=g), torch.randn(2, 3, 2, 3, 4, generator=g)
    want = torch.empty(0)
    torch.ops.aten.adaptive_avg_pool3d_backward.grad_input(go, x, grad_input=want)
    got = torch.empty(0, device="tpu")
    r = torch.ops.aten.adaptive_avg_pool3d_backward.grad_input(go.tpu(), x.tpu(), grad_input=got)
    assert r is got and got.shape == want.shape
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape,wshape,stride,padding", [
    ((2, 8, 2, 2), (16, 8, 3, 3), 1, 1), ((2, 8, 4, 4), (16, 8, 3, 3), 2, 1), ((1, 3, 4, 3), (5, 3, 1, 1), 2, 0),
    ((2, 4, 3, 3), (6, 4, 3, 3), 1, 0), ((0, 4, 2, 2), (6, 4, 3, 3), 1, 1), ((2, 4, 8, 8), (6, 4, 3, 3), 1, 1)])
def test_small_map_convolutions_like_cpu(shape, wshape, stride, padding) -> None:
    """Convolutions over maps of at most 4x4 run as windows times a matrix on XLA:CPU (kernels/nn/conv.py
    _conv_as_patches; its lax convolution was ~50x slower than PyTorch there): values and both gradients match CPU,
    and the path is the one taken."""
    import jax

    from torch_tpu.kernels.nn import conv

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(*shape, generator=g), torch.randn(*wshape, generator=g)
    xc, wc = x.clone().requires_grad_(), w.clone().requires_grad_()
    yc = F.conv2d(xc, wc, stride=stride, padding=padding)
    go = torch.randn(yc.shape, generator=g)
    yc.backward(go)
    xt, wt = x.tpu().requires_grad_(), w.tpu().requires_grad_()
    yt = F.conv2d(xt, wt, stride=stride, padding=padding)
    yt.backward(go.tpu())
    for got, want in ((yt, yc), (xt.grad, xc.grad), (wt.grad, wc.grad)):
        torch.testing.assert_close(got.detach().cpu(), want.detach(), rtol=1e-4, atol=1e-4)
    jaxpr = str(jax.make_jaxpr(lambda a, b: conv._conv(a, b, [stride], [padding], [1], False, [0], 1))(
        x.numpy(), w.numpy()))
    assert ("conv_general_dilated" in jaxpr) == (max(shape[2:]) > 4)


def _masked_backward_calls(dev: str) -> dict[str, tuple]:
    """Each backward op with an `output_mask`, called with some outputs off, on `dev` (same values everywhere)."""
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(dev)

    x, go, w, b = r(2, 3, 4), r(2, 3, 4), r(4), r(4)
    _, mean, rstd = torch.ops.aten.native_layer_norm(x, [4], w, b, 1e-5)
    xi, gi = r(2, 4, 3, 3), r(2, 4, 3, 3)
    _, gmean, grstd = torch.ops.aten.native_group_norm(xi, r(4), r(4), 2, 4, 9, 2, 1e-5)
    _, bmean, binv = torch.ops.aten.native_batch_norm(xi, r(4), r(4), None, None, True, 0.1, 1e-5)
    wc = r(5, 4, 3, 3)
    return {
        "layer_norm": torch.ops.aten.native_layer_norm_backward(go, x, [4], mean, rstd, w, b, [False, True, True]),
        "group_norm": torch.ops.aten.native_group_norm_backward(gi, xi, gmean, grstd, r(4), 2, 4, 9, 2,
                                                                [True, False, True]),
        "batch_norm": torch.ops.aten.native_batch_norm_backward(gi, xi, r(4), None, None, bmean, binv, True, 1e-5,
                                                                [False, True, False]),
        "convolution": torch.ops.aten.convolution_backward(r(2, 5, 3, 3), xi, wc, None, [1, 1], [1, 1], [1, 1],
                                                           False, [0, 0], 1, [False, True, False]),
        "grid_sampler": torch.ops.aten.grid_sampler_2d_backward(r(2, 4, 2, 2), xi, r(2, 2, 2, 2).tanh(), 0, 0, False,
                                                                [False, True]),
    }


@pytest.mark.parametrize("mode", ["DEFER_NEVER", "DEFER_AND_FUSE"])
def test_masked_backward_outputs_are_undefined_like_cpu(mode: str) -> None:
    """An output `output_mask` turns off is an undefined tensor (None), as on CPU: DTensor's sharding rules give it
    no spec and refuse a tensor there; the others match CPU."""
    want = _masked_backward_calls("cpu")
    saved = torch.tpu.eager_mode
    torch.tpu.eager_mode = getattr(torch.tpu.EagerMode, mode)
    try:
        got = _masked_backward_calls("tpu")
        got = {k: tuple(None if t is None else t.cpu() for t in v) for k, v in got.items()}
    finally:
        torch.tpu.eager_mode = saved
    for name, outs in want.items():
        assert [t is None for t in got[name]] == [t is None for t in outs], (name, got[name])
        for a, e in zip(got[name], outs):
            if e is not None:
                torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
