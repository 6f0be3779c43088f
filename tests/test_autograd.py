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
