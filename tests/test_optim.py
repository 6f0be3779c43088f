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


# ---- DEFER_NEVER runs each optimizer step as one program (torch_tpu/_deferred.py, optimizer_step_starts) ----

def _mlp_steps(device: str, make_opt, steps: int = 3, check=None) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 4)).to(device)
    opt = make_opt(model.parameters())
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(8, 16, generator=g).to(device), torch.randint(0, 4, (8,), generator=g).to(device)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        if check is not None:
            check()
    return [p.detach().cpu() for p in model.parameters()] + [
        t.detach().cpu() for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]


UNFUSED = {
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    "adam_amsgrad": lambda p: torch.optim.Adam(p, lr=1e-2, amsgrad=True),
    "sgd_nesterov": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, nesterov=True),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-3),
    "adamw_for_loop": lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=False),
}


@pytest.mark.parametrize("name", list(UNFUSED))
def test_defer_never_runs_an_optimizer_step_as_one_program(name: str) -> None:
    """Under DEFER_NEVER each step of an optimizer over tpu parameters runs as one program, dispatched as the
    step ends (an `optimizer_step` flush); nothing stays pending, the thread is in DEFER_NEVER again, and
    parameters and optimizer state equal CPU's."""
    from torch_tpu import _deferred

    assert torch.tpu.eager_mode == torch.tpu.EagerMode.DEFER_NEVER
    seen = []

    def check() -> None:
        seen.append((torch.tpu.eager_mode, _deferred.thread_graph(0)))

    before = torch.tpu.metrics()
    got = _mlp_steps("tpu", UNFUSED[name], check=check)
    after = torch.tpu.metrics()
    assert after.flushes.get("optimizer_step", 0) - before.flushes.get("optimizer_step", 0) == 3
    assert after.fused_graph_runs - before.fused_graph_runs == 3, "one program per step"
    assert seen == [(torch.tpu.EagerMode.DEFER_NEVER, None)] * 3
    want = _mlp_steps("cpu", UNFUSED[name])
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("case", ["fused", "launch_blocking", "turned_off"])
def test_optimizer_steps_left_op_by_op(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """No step fusion for a `fused=True` optimizer (its kernel is one program already), under
    DEFER_NEVER_AND_LAUNCH_BLOCKING (op by op, each waited for), or with TORCH_TPU_FUSE_OPTIMIZER_STEPS=0."""
    make = UNFUSED["adamw"]
    mode = "DEFER_NEVER"
    if case == "fused":
        make = FUSED["adamw"]
    elif case == "launch_blocking":
        mode = "DEFER_NEVER_AND_LAUNCH_BLOCKING"
    else:
        monkeypatch.setenv("TORCH_TPU_FUSE_OPTIMIZER_STEPS", "0")
    before = torch.tpu.metrics()
    with torch.tpu.set_eager_mode(mode):
        got = _mlp_steps("tpu", make)
    after = torch.tpu.metrics()
    assert after.fused_graph_runs == before.fused_graph_runs
    assert after.flushes.get("optimizer_step", 0) == before.flushes.get("optimizer_step", 0)
    for g, w in zip(got, _mlp_steps("cpu", make)):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_a_step_given_a_closure_runs_op_by_op() -> None:
    """LBFGS calls its closure (forward, backward, a loss read as a Python number) inside the step and reads
    tensors to decide when to stop: recorded, each read would be a new graph to compile. A step given a closure
    runs op by op, and ends like CPU's."""
    res = {}
    for dev in ("cpu", "tpu"):
        torch.manual_seed(0)
        model = nn.Linear(6, 1).to(dev)
        x = torch.randn(32, 6).to(dev)
        y = (x @ torch.arange(6.0).to(dev)).unsqueeze(1)
        opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=5)

        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            return loss

        before = torch.tpu.metrics()
        losses = [opt.step(closure).item() for _ in range(3)]
        assert torch.tpu.metrics().fused_graph_runs == before.fused_graph_runs
        res[dev] = (losses, [p.detach().cpu() for p in model.parameters()])
    torch.testing.assert_close(res["tpu"][0], res["cpu"][0], rtol=1e-4, atol=1e-5)
    for g, w in zip(res["tpu"][1], res["cpu"][1]):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


class _RaisingSGD(torch.optim.SGD):
    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001, ANN201
        for group in self.param_groups:
            for p in group["params"]:
                p.add_(p.grad, alpha=-group["lr"])
        raise ValueError("raised inside the step")


def test_a_step_that_raises_returns_the_thread_to_its_mode() -> None:
    """A step that raises never reaches its post-hook: the thread is back in DEFER_NEVER at its next mode query,
    flush or step, and the updates the step recorded before raising are not lost."""
    for query in ("mode", "read", "next_step"):
        p = nn.Parameter(torch.arange(4.0, device="tpu"))
        opt = _RaisingSGD([p], lr=0.5)
        (p * p).sum().backward()
        with pytest.raises(ValueError, match="raised inside the step"):
            opt.step()
        if query == "mode":
            assert torch.tpu.eager_mode == torch.tpu.EagerMode.DEFER_NEVER
        elif query == "read":
            torch.testing.assert_close(p.detach().cpu(), torch.arange(4.0) * 0.0)
        else:
            plain = torch.optim.SGD([nn.Parameter(torch.ones(2, device="tpu"))], lr=0.1)
            plain.step()
        assert torch.tpu.eager_mode == torch.tpu.EagerMode.DEFER_NEVER
        torch.testing.assert_close(p.detach().cpu(), torch.arange(4.0) * 0.0)  # p - 0.5 * 2p
        x = torch.ones(2, device="tpu") + 1  # op by op again: nothing recorded
        from torch_tpu import _deferred

        assert _deferred.thread_graph(0) is None
        assert x.cpu().tolist() == [2.0, 2.0]


@pytest.mark.parametrize("backend", ["tpu", "inductor"])
def test_the_optimizer_hooks_do_not_break_a_compiled_step(backend: str) -> None:
    """torch_tpu's optimizer step hooks are invisible to torch.compile: a compiled function doing a step has no
    graph break there (Dynamo ignores them), and its parameters follow CPU's."""
    import torch._dynamo

    from torch_tpu import _compile  # noqa: F401  (torch_tpu's Dynamo skip rule, which backend tpu installs)

    res = {}
    for dev in ("cpu", "tpu"):
        torch.manual_seed(0)
        p = nn.Parameter(torch.randn(5).to(dev))
        opt = torch.optim.AdamW([p], lr=0.1)
        for _ in range(2):
            p.grad = (p * 2).detach()
            opt.step()  # eager: creates the state
        torch._dynamo.reset()
        explained = torch._dynamo.explain(opt.step)()
        reasons = [str(b.reason) for b in explained.break_reasons]
        assert not any("torch_tpu" in r or "optimizer_step" in r for r in reasons), reasons
        step = torch.compile(opt.step, backend=backend if dev == "tpu" else "inductor")
        for _ in range(2):
            p.grad = (p * 2).detach()
            step()
        res[dev] = p.detach().cpu()
    torch._dynamo.reset()
    torch.testing.assert_close(res["tpu"], res["cpu"], rtol=1e-5, atol=1e-6)
