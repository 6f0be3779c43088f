"""max / min reductions propagate NaN as CPU PyTorch does. This jaxlib's XLA:CPU runs max and min reductions as
YNNPACK fusions by default, and those drop NaNs (rows of 256 with NaNs reduced to their largest number);
torch_tpu starts XLA:CPU without them (torch_tpu/_runtime.py, XLA_CPU_FLAGS)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

MODES = ("DEFER_NEVER", "DEFER_AND_FUSE")
F = torch.nn.functional

REDUCTIONS = {
    "amax": lambda t: t.amax(-1),
    "amin": lambda t: t.amin(0),
    "max.dim": lambda t: t.max(-1).values,
    "min.dim indices": lambda t: t.min(-1).indices,
    "max": lambda t: t.max().reshape(1),
    "aminmax": lambda t: torch.aminmax(t, dim=-1)[1],
    "max_pool1d": lambda t: F.max_pool1d(t.reshape(-1, 1, t.shape[-1]), 4),
    "inf-norm": lambda t: torch.linalg.vector_norm(t, float("inf"), dim=-1),
    "cummax": lambda t: t.cummax(-1).values,
}


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(((a == b) | (a.isnan() & b.isnan())).all()) and a.dtype == b.dtype and a.shape == b.shape


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", [(3, 256), (64, 256), (4, 64, 256), (1024, 8)], ids=str)
def test_max_min_reductions_propagate_nan(shape: tuple, mode: str) -> None:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    x.view(-1)[::97] = float("nan")  # a NaN in every row of 256
    x.view(-1)[::89] = float("inf")
    for name, fn in REDUCTIONS.items():
        with torch.tpu.set_eager_mode(mode):
            got = fn(x.to("tpu")).cpu()
        assert _same(got, fn(x)), name


def test_compiled_max_propagates_nan() -> None:
    x = torch.randn(64, 256)
    x[:, 5] = float("nan")
    got = torch.compile(lambda t: t.amax(-1) + t.amin(-1), backend="tpu")(x.to("tpu")).cpu()
    assert bool(got.isnan().all())


def _child(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=240)


def test_user_xla_flags_are_kept_and_a_late_start_warns() -> None:
    # a user's own setting of the flag wins; JAX started before torch_tpu: a warning names the flag
    code = ("import os, torch; torch.randn(2, device='tpu').cpu(); print(os.environ['XLA_FLAGS'])")
    r = _child(code, {"XLA_FLAGS": "--xla_cpu_experimental_ynn_fusion_type=individual_dot,reduce"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("--xla_cpu_experimental_ynn_fusion_type=individual_dot,reduce"), r.stdout
    code = ("import warnings, jax; jax.devices()\n"
            "import torch\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n"
            "    torch.randn(2, device='tpu').cpu()\n"
            "print([str(m.message) for m in w if 'drop NaNs' in str(m.message)])")
    r = _child(code, {"XLA_FLAGS": ""})
    assert r.returncode == 0, r.stderr
    assert "--xla_cpu_experimental_ynn_fusion_type=individual_dot: its max/min reductions may drop NaNs" in r.stdout, \
        r.stdout
