"""torch.autocast("tpu"): PyTorch's per-op autocast policy lists registered for tpu (bfloat16 by default)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def test_default_dtype_and_support() -> None:
    assert torch.get_autocast_dtype("tpu") == torch.bfloat16
    assert torch.amp.is_autocast_available("tpu")
    assert torch.bfloat16 in torch.tpu.get_amp_supported_dtype()


def test_policy_per_op() -> None:
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    ta, tb = a.tpu(), b.tpu()
    with torch.autocast("tpu"):
        mm = ta @ tb                       # lower precision
        lin = F.linear(ta, tb)
        sm = torch.softmax(mm, -1)         # float32
        ex = torch.exp(mm)
        add = ta + tb                      # not on a list: unchanged
        loss = F.mse_loss(mm, ta)          # float32
    assert mm.dtype == lin.dtype == torch.bfloat16
    assert sm.dtype == ex.dtype == loss.dtype == torch.float32
    assert add.dtype == torch.float32
    torch.testing.assert_close(mm.cpu(), (a.bfloat16() @ b.bfloat16()))
    with torch.autocast("tpu", dtype=torch.float16):
        assert (ta @ tb).dtype == torch.float16
    with torch.autocast("tpu", enabled=False):
        assert (ta @ tb).dtype == torch.float32


def test_autocast_training_step_backward() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).tpu()
    x = torch.randn(8, 16, device="tpu")
    y = torch.randint(0, 4, (8,), device="tpu")
    with torch.autocast("tpu"):
        out = model(x)
        loss = F.cross_entropy(out, y)
    assert out.dtype == torch.bfloat16 and loss.dtype == torch.float32
    loss.backward()
    for p in model.parameters():
        assert p.grad is not None and p.grad.dtype == torch.float32 and p.grad.device.type == "tpu"
