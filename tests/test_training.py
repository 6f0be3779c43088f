"""Training on tpu: the example models train like on CPU step by step, optimizers, checkpoints and resume,
memory stays flat, and mixing devices fails the way PyTorch fails."""

from __future__ import annotations

import copy
import gc
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from conftest import REPO, check_fused_step_like_cpu, load_example, rss_bytes

sys.path.insert(0, str(REPO / "examples"))




def _run(mod, device: str, steps: int) -> tuple[list[float], nn.Module]:
    from _train import train

    model, batches, loss_fn = mod.build(0)
    model = model.to(device)
    losses = train(model, mod.optimizer(model), batches, loss_fn, device, steps, log=False)
    return losses, model


# Per-step loss tolerance (float32): the same math in a different order (XLA vs ATen kernels) drifts a little
# more in deeper models.
TOL = {"mlp": 1e-5, "gpt": 1e-4, "resnet": 1e-4, "lstm": 1e-5}


@pytest.mark.parametrize("name", ["mlp", "gpt", "resnet", "lstm"])
def test_example_trains_like_cpu(name: str) -> None:
    mod = load_example(name)
    cpu_losses, cpu_model = _run(mod, "cpu", 20)
    tpu_losses, tpu_model = _run(mod, "tpu", 20)
    tol = TOL[name]
    torch.testing.assert_close(tpu_losses, cpu_losses, rtol=tol, atol=tol)
    # Final parameters: Adam-style updates normalise by the gradient's magnitude, so a weight whose gradient is
    # ~0 (a dead ReLU unit) can move by up to lr per step on one side and not the other, and batch norm makes conv
    # weights sensitive to float32 reduction order. Each tensor must agree to 1% in norm (plus 1e-3 for tensors
    # near zero, like fresh biases), and each element to within 5 steps of the learning rate.
    lr = mod.optimizer(nn.Linear(1, 1)).param_groups[0]["lr"]
    for (n, p), (_, q) in zip(cpu_model.named_parameters(), tpu_model.named_parameters()):
        assert q.device.type == "tpu"
        diff = q.detach().cpu() - p.detach()
        assert diff.norm() <= 1e-2 * p.detach().norm() + 1e-3, (n, diff.norm().item())
        assert diff.abs().max() <= 5 * lr, (n, diff.abs().max().item())
    for (n, b), (_, c) in zip(cpu_model.named_buffers(), tpu_model.named_buffers()):  # batch-norm statistics
        if not b.is_floating_point():
            assert torch.equal(c.cpu(), b), n
            continue
        diff = c.cpu() - b
        assert diff.norm() <= 1e-2 * b.norm() + 1e-3, (n, diff.norm().item())


@pytest.mark.parametrize("name", ["mlp", "gpt", "resnet", "lstm"])
def test_example_trains_like_cpu_under_bfloat16_autocast(name: str) -> None:
    """The example models' steps under torch.autocast(bfloat16) on each device: tpu's policy casts the same ops as
    CPU's, so the losses agree to bfloat16 precision (a wrong cast list or a float32 fallback would not)."""
    mod = load_example(name)
    losses = {}
    for device in ("cpu", "tpu"):
        model, batches, loss_fn = mod.build(0)
        model = model.to(device)
        opt = mod.optimizer(model)
        losses[device] = []
        for _ in range(5):
            x, y = (t.to(device) for t in next(batches))
            opt.zero_grad()
            with torch.autocast(device_type=device, dtype=torch.bfloat16):
                try:
                    out = model(x)
                except RuntimeError as e:  # the oracle itself: CPU PyTorch's oneDNN LSTM on some CPUs
                    if device == "cpu" and "could not create a primitive descriptor" in str(e):
                        pytest.skip(f"CPU PyTorch cannot run this model under bfloat16 autocast here: {e}")
                    raise
                loss = loss_fn(out, y)
            assert out.dtype == torch.bfloat16 or name == "lstm", (name, out.dtype)
            loss.backward()
            opt.step()
            losses[device].append(loss.item())
    torch.testing.assert_close(losses["tpu"], losses["cpu"], rtol=1e-2, atol=1e-2)


OPTIMIZERS = {
    "sgd": lambda p, **kw: torch.optim.SGD(p, lr=0.1, **kw),
    "sgd_momentum_nesterov": lambda p, **kw: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True,
                                                            weight_decay=1e-4, **kw),
    "adam": lambda p, **kw: torch.optim.Adam(p, lr=1e-2, **kw),
    "adam_amsgrad": lambda p, **kw: torch.optim.Adam(p, lr=1e-2, amsgrad=True, **kw),
    "adamw": lambda p, **kw: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, **kw),
    "adagrad": lambda p, **kw: torch.optim.Adagrad(p, lr=0.1, **kw),
    "rmsprop": lambda p, **kw: torch.optim.RMSprop(p, lr=1e-2, momentum=0.5, centered=True, **kw),
}


@pytest.mark.parametrize("foreach", [True, False], ids=["foreach", "single_tensor"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizers_match_cpu(name: str, foreach: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    x, y = torch.randn(10, 8), torch.randint(0, 3, (10,))
    results = {}
    for device in ("cpu", "tpu"):
        m = copy.deepcopy(model).to(device)
        opt = OPTIMIZERS[name](m.parameters(), foreach=foreach)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        for _ in range(4):
            opt.zero_grad()
            F.cross_entropy(m(x.to(device)), y.to(device)).backward()
            opt.step()
            sched.step()
        results[device] = [p.detach().cpu() for p in m.parameters()]
        if device == "tpu":
            for state in opt.state.values():
                for v in state.values():
                    if isinstance(v, torch.Tensor) and v.dim() > 0:
                        assert v.device.type == "tpu"
    for p, q in zip(results["cpu"], results["tpu"]):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)


FUSED = {
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2, fused=True),
    "adam_amsgrad_decay": lambda p: torch.optim.Adam(p, lr=1e-2, amsgrad=True, weight_decay=0.1, fused=True),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, fused=True),
    "adamw_amsgrad_maximize": lambda p: torch.optim.AdamW(p, lr=1e-2, amsgrad=True, maximize=True, fused=True),
    "adamw_tensor_lr": lambda p: torch.optim.AdamW(p, lr=torch.tensor(1e-2), weight_decay=0.1, fused=True),
}


@pytest.mark.parametrize("mode", ["DEFER_NEVER", "DEFER_AND_FUSE"])
@pytest.mark.parametrize("name", list(FUSED))
def test_fused_adam_matches_cpu_fused(name: str, mode: str) -> None:
    """`fused=True` runs aten::_fused_adam(w)_ as one program per parameter group; parameters and state follow
    CPU's fused kernel step by step (with a learning-rate schedule: new rates, same program)."""
    from torch_tpu import _metrics

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    x, y = torch.randn(10, 8), torch.randint(0, 3, (10,))
    results, states = {}, {}
    for device in ("cpu", "tpu"):
        m = copy.deepcopy(model).to(device)
        opt = FUSED[name](m.parameters())
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        check = device == "tpu" and mode == "DEFER_NEVER"
        with torch.tpu.set_eager_mode(mode if device == "tpu" else "DEFER_NEVER"):
            for i in range(5):
                opt.zero_grad()
                F.cross_entropy(m(x.to(device)), y.to(device)).backward()
                if check and i == 3:
                    compiles = _metrics.metrics().compiles
                opt.step()
                if check and i == 3:
                    assert _metrics.metrics().compiles == compiles, "a new learning rate must not recompile"
                sched.step()
        results[device] = [p.detach().cpu() for p in m.parameters()]
        states[device] = [{k: v.cpu() for k, v in opt.state[p].items()} for p in m.parameters()]
    for p, q in zip(results["cpu"], results["tpu"]):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
    for a, b in zip(states["cpu"], states["tpu"]):
        assert a.keys() == b.keys()
        for k in a:
            torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.parametrize("adamw", [False, True], ids=["adam", "adamw"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_adam_grad_scale_and_found_inf_like_cpu(adamw: bool, dtype: torch.dtype) -> None:
    """Called directly, as GradScaler's optimizer step does: gradients are unscaled (and written back unscaled),
    and found_inf == 1 leaves everything as it was."""
    op = torch._fused_adamw_ if adamw else torch._fused_adam_
    torch.manual_seed(0)
    shapes = [(4, 3), (5,), (2, 2, 2)]
    base = {k: [torch.randn(s).to(dtype) for s in shapes] for k in ("p", "g", "m")}
    base["v"] = [torch.rand(s).to(dtype) for s in shapes]
    base["vmax"] = [v + 0.5 for v in base["v"]]
    base["steps"] = [torch.tensor(float(i + 3)) for i in range(len(shapes))]
    check_fused_step_like_cpu(base, lambda t, device, found_inf: op(
        t["p"], t["g"], t["m"], t["v"], t["vmax"], t["steps"], lr=0.01, beta1=0.9, beta2=0.99, weight_decay=0.05,
        eps=1e-8, amsgrad=True, maximize=False, grad_scale=torch.tensor(4.0, device=device), found_inf=found_inf),
        dtype)


def test_fused_adam_refuses_mixed_devices() -> None:
    p = nn.Parameter(torch.randn(4, device="tpu"))
    with pytest.raises(RuntimeError, match="_fused_adam_.*one tpu device.*grads"):
        torch._fused_adam_([p.detach()], [torch.ones(4)], [torch.zeros(4, device="tpu")],
                           [torch.zeros(4, device="tpu")], [], [torch.ones((), device="tpu")], lr=0.1, beta1=0.9,
                           beta2=0.99, weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False)


def test_checkpoint_resume_matches_uninterrupted(tmp_path) -> None:
    mod = load_example("mlp")
    from _train import train

    def fresh():
        model, batches, loss_fn = mod.build(0)
        model = model.tpu()
        return model, mod.optimizer(model), batches, loss_fn

    model, opt, batches, loss_fn = fresh()
    straight = train(model, opt, batches, loss_fn, "tpu", 10, log=False)

    model, opt, batches, loss_fn = fresh()
    first = train(model, opt, batches, loss_fn, "tpu", 5, log=False)
    path = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, path)

    # The checkpoint written on tpu loads on CPU...
    on_cpu = torch.load(path, map_location="cpu")
    assert all(t.device.type == "cpu" for t in on_cpu["model"].values())
    # ...and on tpu, into a fresh model and optimizer that continue where training stopped.
    model2, opt2, _, _ = fresh()
    state = torch.load(path)
    model2.load_state_dict(state["model"])
    opt2.load_state_dict(state["opt"])
    assert next(iter(opt2.state.values()))["exp_avg"].device.type == "tpu"
    resumed = train(model2, opt2, batches, loss_fn, "tpu", 5, log=False)
    torch.testing.assert_close(first + resumed, straight, rtol=1e-6, atol=1e-6)


def _fixed_batch_step(name: str):
    """One training step of an example model on tpu, on one fixed batch."""
    mod = load_example(name)
    model, batches, loss_fn = mod.build(0)
    model = model.tpu()
    opt = mod.optimizer(model)
    x, y = (t.tpu() for t in next(batches))

    def step() -> None:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()

    return step


def test_memory_flat_over_1000_mlp_steps() -> None:
    step = _fixed_batch_step("mlp")
    for _ in range(100):
        step()
    torch.tpu.synchronize()
    gc.collect()
    live, rss = torch.tpu.live_storages(), rss_bytes()
    for _ in range(1000):
        step()
    torch.tpu.synchronize()
    gc.collect()
    assert torch.tpu.live_storages() == live
    growth = rss_bytes() - rss
    assert growth < 64 * 2**20, f"host RSS grew {growth / 2**20:.1f} MiB over 1000 steps"


def test_model_split_across_devices_fails_naming_both() -> None:
    model = nn.Sequential(nn.Linear(4, 4).tpu(), nn.Linear(4, 2))  # second layer left on cpu
    with pytest.raises(RuntimeError, match=r"same device.*(tpu:0 and cpu|cpu and tpu:0)"):
        model(torch.randn(3, 4, device="tpu"))


def test_cpu_grad_on_tpu_param_fails_clearly() -> None:
    p = nn.Parameter(torch.randn(4, device="tpu"))
    with pytest.raises(RuntimeError, match="device"):
        p.grad = torch.ones(4)


def test_dropout_reproducible_under_seed() -> None:
    x = torch.ones(1000, device="tpu")
    torch.manual_seed(3)
    a = F.dropout(x, 0.3).cpu()
    torch.manual_seed(3)
    b = F.dropout(x, 0.3).cpu()
    assert torch.equal(a, b)
    kept = (a != 0).float().mean().item()
    assert 0.65 < kept < 0.75 and torch.allclose(a[a != 0], torch.tensor(1 / 0.7))


def test_steady_state_steps_compile_nothing() -> None:
    """After warm-up, training steps reuse cached executables: no XLA compilation per step."""
    import jax.monitoring

    compiles: list[str] = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, secs, **kw: compiles.append(name) if "backend_compile" in name else None)
    step = _fixed_batch_step("gpt")
    for _ in range(3):
        step()
    # The listener must see compiles (else the check below cannot fail). Warm-up may compile nothing when an
    # earlier test trained the same model; a shape no other test uses compiles for sure.
    (torch.ones(1, 3, 5, 7, 11, device="tpu") * 3).cpu()
    torch.tpu.synchronize()
    assert compiles, "the listener saw no compilation at all during warm-up"
    compiles.clear()
    for _ in range(3):
        step()
    torch.tpu.synchronize()
    assert compiles == [], f"{len(compiles)} compilations in 3 steady-state steps"
