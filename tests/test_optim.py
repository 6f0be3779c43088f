"""Fused optimizers (`fused=True`) on tpu: `_fused_sgd_` (both overloads) next to `_fused_adam(w)_`; each step is
one XLA program over all parameters, and parameters and state follow CPU's fused kernels (and CPU's unfused
optimizer) step by step. The Adam(W) kernel's own cases (amsgrad, maximize, tensor lr, grad_scale/found_inf)
are in tests/test_training.py."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from conftest import check_fused_step_like_cpu

MODES = ["DEFER_NEVER", "DEFER_AND_FUSE"]

SGD = {
    "plain": dict(lr=0.1),
    "momentum": dict(lr=0.05, momentum=0.9),
    "momentum_dampening_decay": dict(lr=0.05, momentum=0.9, dampening=0.3, weight_decay=0.01),
    "nesterov_maximize": dict(lr=0.05, momentum=0.8, nesterov=True, maximize=True),
    "decay_no_momentum": dict(lr=0.1, weight_decay=0.1),
    "tensor_lr": dict(lr=torch.tensor(0.05), momentum=0.9),
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def _train(make, device: str, mode: str, steps: int = 5, sched: bool = True) -> tuple[list, list]:
    model = copy.deepcopy(_model()).to(device)
    opt = make(model.parameters())
    lr_sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5) if sched else None
    x, y = torch.randn(10, 8, generator=torch.Generator().manual_seed(1)), torch.arange(10) % 3
    with torch.tpu.set_eager_mode(mode if device == "tpu" else "DEFER_NEVER"):
        for _ in range(steps):
            opt.zero_grad()
            F.cross_entropy(model(x.to(device)), y.to(device)).backward()
            opt.step()
            if lr_sched is not None:
                lr_sched.step()
        params = [p.detach().cpu() for p in model.parameters()]
        state = [{k: v.cpu() for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)}
                 for p in model.parameters()]
    return params, state


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(SGD))
def test_fused_sgd_matches_cpu(name: str, mode: str) -> None:
    def make(fused: bool):
        def f(params):
            kw = dict(SGD[name])
            if isinstance(kw["lr"], torch.Tensor):
                kw["lr"] = kw["lr"].clone()
            return torch.optim.SGD(params, fused=fused, **kw)
        return f

    tpu = _train(make(True), "tpu", mode)
    cpu_fused = _train(make(True), "cpu", mode)
    cpu_plain = _train(make(False), "cpu", mode)
    for ref in (cpu_fused, cpu_plain):
        for a, b in zip(ref[0], tpu[0]):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
        for sa, sb in zip(ref[1], tpu[1]):
            assert sa.keys() == sb.keys()
            for k in sa:
                torch.testing.assert_close(sb[k], sa[k], rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("first", [False, True])
def test_fused_sgd_grad_scale_and_found_inf_like_cpu(first: bool, dtype: torch.dtype) -> None:
    """Called as GradScaler's optimizer step calls it: gradients unscaled (and written back unscaled);
    found_inf == 1 changes nothing."""
    torch.manual_seed(0)
    shapes = [(4, 3), (5,)]
    base = {k: [torch.randn(s).to(dtype) for s in shapes] for k in ("p", "g", "b")}
    check_fused_step_like_cpu(base, lambda t, device, found_inf: torch._fused_sgd_(
        t["p"], t["g"], t["b"], weight_decay=0.01, momentum=0.9, lr=0.1, dampening=0.1, nesterov=True,
        maximize=False, is_first_step=first, grad_scale=torch.tensor(8.0, device=device), found_inf=found_inf), dtype)


def test_fused_sgd_refuses_mixed_devices() -> None:
    with pytest.raises(RuntimeError, match="_fused_sgd_.*one tpu device.*grads"):
        torch._fused_sgd_([torch.zeros(4, device="tpu")], [torch.ones(4)], [], weight_decay=0.0, momentum=0.0,
                          lr=0.1, dampening=0.0, nesterov=False, maximize=False, is_first_step=False)


FUSED = {
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2, fused=True),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, fused=True),
    "sgd": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, fused=True),
}


@pytest.mark.parametrize("name", list(FUSED))
def test_fused_step_is_one_program(name: str) -> None:
    """The step of a fused optimizer is one XLA program whatever the number of parameters: under DEFER_AND_FUSE
    the whole step (the step-count increments and the fused kernel) runs as one graph, for 2 or 6 parameters;
    under DEFER_NEVER the fused kernel is one program launched once per step for all parameters."""
    from torch_tpu import _metrics
    from torch_tpu.kernels import optim

    for layers in (1, 3):
        model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(layers)]).tpu()
        opt = FUSED[name](model.parameters())
        with torch.tpu.set_eager_mode("DEFER_AND_FUSE"):
            for _ in range(3):
                model(torch.randn(4, 8, device="tpu")).sum().backward()
                torch.tpu.synchronize()
                before = _metrics.metrics()
                opt.step()
                torch.tpu.synchronize()
                after = _metrics.metrics()
                assert after.fused_graph_runs - before.fused_graph_runs == 1
                opt.zero_grad()
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(3)]).tpu()
    opt = FUSED[name](model.parameters())
    progs = {optim._program, optim._sgd_program}
    for prog in progs:
        prog.cache_clear()
    model(torch.randn(4, 8, device="tpu")).sum().backward()
    opt.step()
    launched = sum(p.cache_info().misses + p.cache_info().hits for p in progs)
    assert launched == 1, "one fused program for all 6 parameters"


@pytest.mark.parametrize("name", ["adam", "sgd"])
def test_fused_learning_rate_tensor_on_the_device(name: str) -> None:
    """A learning rate held in a tensor on the parameters' device (the `.tensor_lr` overloads, as capturable
    code on CUDA keeps it) is read inside the program."""
    res = {}
    for dev in ("cpu", "tpu"):
        p = nn.Parameter(torch.arange(5.0).to(dev))
        lr = torch.tensor(0.05, device=dev)
        opt = (torch.optim.Adam([p], lr=lr, fused=True) if name == "adam"
               else torch.optim.SGD([p], lr=lr, momentum=0.9, fused=True))
        for _ in range(3):
            (p * p).sum().backward()
            opt.step()
            opt.zero_grad()
            lr.mul_(0.5)
        res[dev] = p.detach().cpu()
    torch.testing.assert_close(res["tpu"], res["cpu"], rtol=1e-6, atol=1e-7)
