"""GradScaler on tpu: `_amp_foreach_non_finite_check_and_unscale_` and `_amp_update_scale_` compute what CPU's
kernels compute (found_inf, growth tracker, backoff, growth), in every execution mode, and float16 autocast with
torch.amp.GradScaler("tpu") trains the examples/mlp.py model like CPU with GradScaler("cpu"): losses close, the
same scale sequence, and a step with an inf skipped the same way."""

from __future__ import annotations

import copy
import sys

import pytest
import torch
import torch.nn.functional as F

from conftest import REPO

MODES = ["DEFER_NEVER", "DEFER_AND_FUSE"]
INF, NAN = float("inf"), float("nan")


def _grads(dtype: torch.dtype, poison: float | None, where: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    out = [torch.randn(s, generator=g).mul(1000).to(dtype) for s in [(4, 3), (7,), (2, 2, 2)]]
    if poison is not None:
        out[where].view(-1)[2] = poison
    return out


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("poison", [None, INF, -INF, NAN])
def test_unscale_and_found_inf_like_cpu(poison: float | None, dtype: torch.dtype, mode: str) -> None:
    for start in (0.0, 1.0):  # found_inf is only ever set, never cleared
        got = {}
        for device in ("cpu", "tpu"):
            with torch.tpu.set_eager_mode(mode if device == "tpu" else "DEFER_NEVER"):
                grads = [g.to(device) for g in _grads(dtype, poison, 1)]
                found = torch.full((1,), start, device=device)
                torch._amp_foreach_non_finite_check_and_unscale_(grads, found, torch.full((1,), 1 / 1024,
                                                                                          device=device))
                got[device] = ([g.cpu() for g in grads], found.cpu())
        for a, b in zip(got["cpu"][0], got["tpu"][0]):
            assert b.dtype == a.dtype
            torch.testing.assert_close(b, a, rtol=0, atol=0, equal_nan=True)
        assert torch.equal(got["tpu"][1], got["cpu"][1]), (got["tpu"][1], got["cpu"][1])
        assert got["tpu"][1].item() == (1.0 if poison is not None or start else 0.0)


def test_unscale_errors_name_the_op() -> None:
    g = [torch.ones(3, device="tpu")]
    with pytest.raises(RuntimeError, match="_amp_foreach_non_finite_check_and_unscale_.*found_inf must be a "
                                           "1-element tensor"):
        torch._amp_foreach_non_finite_check_and_unscale_(g, torch.zeros(2, device="tpu"),
                                                         torch.ones(1, device="tpu"))
    with pytest.raises(RuntimeError, match="scaled_grads\\[0\\] is on cpu.*one tpu device"):
        torch._amp_foreach_non_finite_check_and_unscale_([torch.ones(3)], torch.zeros(1, device="tpu"),
                                                         torch.ones(1, device="tpu"))


@pytest.mark.parametrize("mode", MODES)
def test_update_scale_sequence_like_cpu(mode: str) -> None:
    """found_inf pattern over many steps: backoff resets the tracker, growth every `interval` clean steps, and
    a growth that would overflow float32 keeps the scale (CPU's isfinite check)."""
    pattern = [0, 0, 0, 1, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0]
    for init in (65536.0, 3.0e38):
        seq = {}
        for device in ("cpu", "tpu"):
            with torch.tpu.set_eager_mode(mode if device == "tpu" else "DEFER_NEVER"):
                scale = torch.full((), init, device=device)
                tracker = torch.zeros((), dtype=torch.int32, device=device)
                out = []
                for f in pattern:
                    r = torch._amp_update_scale_(scale, tracker, torch.full((), float(f), device=device), 2.0, 0.5, 3)
                    assert r is scale
                    out.append((scale.item(), int(tracker.item())))
                seq[device] = out
        assert seq["tpu"] == seq["cpu"]


def test_update_scale_refuses_bad_tracker() -> None:
    with pytest.raises(RuntimeError, match="_amp_update_scale_.*growth_tracker must be an int tensor"):
        torch._amp_update_scale_(torch.ones((), device="tpu"), torch.zeros((), device="tpu"),
                                 torch.zeros((), device="tpu"), 2.0, 0.5, 3)


def test_float16_autocast_is_accepted() -> None:
    assert torch.float16 in torch.tpu.get_amp_supported_dtype()
    a, b = torch.randn(4, 8, device="tpu"), torch.randn(8, 3, device="tpu")
    with torch.autocast("tpu", dtype=torch.float16):
        y = a @ b
    assert y.dtype == torch.float16
    with torch.autocast("cpu", dtype=torch.float16):
        torch.testing.assert_close(y.cpu(), a.cpu() @ b.cpu(), rtol=2e-3, atol=2e-3)


def _mlp():
    sys.path.insert(0, str(REPO / "examples"))
    try:
        import mlp
    finally:
        sys.path.pop(0)
    return mlp


@pytest.mark.parametrize("fused,mode", [(False, "DEFER_NEVER"), (True, "DEFER_NEVER"), (True, "DEFER_AND_FUSE")],
                         ids=["adamw", "adamw_fused", "adamw_fused_DEFER_AND_FUSE"])
def test_float16_autocast_mlp_trains_like_cpu(fused: bool, mode: str) -> None:
    """examples/mlp.py under float16 autocast with GradScaler, 9 steps; step 3's batch holds an inf, so its
    gradients are not finite: the step is skipped and the scale backs off; growth_interval=2 makes it grow too."""
    mlp = _mlp()
    model, batches, loss_fn = mlp.build(0)
    data = [next(batches) for _ in range(9)]
    data[3][0][0, 0] = INF
    runs = {}
    for device in ("cpu", "tpu"):
        m = copy.deepcopy(model).to(device)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3, fused=fused)
        scaler = torch.amp.GradScaler(device, init_scale=2.0 ** 12, growth_interval=2)
        losses, scales = [], []
        with torch.tpu.set_eager_mode(mode if device == "tpu" else "DEFER_NEVER"):
            for x, y in data:
                x, y = x.to(device), y.to(device)
                opt.zero_grad()
                with torch.autocast(device, dtype=torch.float16):
                    loss = loss_fn(m(x), y)
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                losses.append(loss.item())
                scales.append(scaler.get_scale())
        runs[device] = (torch.tensor(losses), scales, [p.detach().cpu() for p in m.parameters()])
    cpu, tpu = runs["cpu"], runs["tpu"]
    assert tpu[1] == cpu[1], (tpu[1], cpu[1])  # the same scale sequence: backoff at step 3, growth every 2
    assert cpu[1][3] == cpu[1][2] / 2 and max(cpu[1]) > 2.0 ** 12
    assert torch.isnan(cpu[0][3]) or torch.isinf(cpu[0][3])
    torch.testing.assert_close(tpu[0], cpu[0], rtol=1e-2, atol=1e-3, equal_nan=True)
    # Adam moves a weight by about lr per step whatever its gradient's size, so a weight whose float16 gradient
    # is near zero may move the other way: bound the largest difference by that, and the mean one tightly (a
    # weight moves by up to 9e-3 over the run).
    for a, b in zip(cpu[2], tpu[2]):
        d = (b - a).abs()
        assert d.max() <= 1e-3 * len(data) and d.mean() <= 5e-5, (d.max(), d.mean())  # measured: 1e-5 at most


def test_compiled_unscale_and_update_like_cpu() -> None:
    """Under torch.compile(backend="tpu") the functional forms AOTAutograd makes of both kernels are lowered into
    the graph's program."""
    def step(grads, found, inv, scale, tracker):
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)
        torch._amp_update_scale_(scale, tracker, found, 2.0, 0.5, 2)
        return grads[0] + 1

    def run(device, compiled):
        fn = torch.compile(step, backend="tpu", fullgraph=True) if compiled else step
        scale = torch.full((), 1024.0, device=device)
        tracker = torch.zeros((), dtype=torch.int32, device=device)
        seq = []
        for k in range(5):
            grads = [g.to(device) for g in _grads(torch.float32, INF if k == 2 else None, 0)]
            found = torch.zeros((), device=device)
            out = fn(grads, found, torch.full((), 1 / 1024, device=device), scale, tracker)
            seq.append((out.cpu(), [g.cpu() for g in grads], found.item(), scale.item(), int(tracker.item())))
        return seq

    cpu, tpu = run("cpu", False), run("tpu", True)
    for a, b in zip(cpu, tpu):
        torch.testing.assert_close(b[0], a[0], equal_nan=True)
        for x, y in zip(a[1], b[1]):
            torch.testing.assert_close(y, x, rtol=0, atol=0, equal_nan=True)
        assert b[2:] == a[2:], (b[2:], a[2:])
    assert [s[3] for s in cpu] == [1024.0, 2048.0, 1024.0, 1024.0, 2048.0]
