"""Autoload through the torch.backends entry point, lazy runtime start, and a clean venv."""

from __future__ import annotations

import glob
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, run_python

CHECK = """
import torch
x = torch.randn(2, 2, device="tpu"); y = torch.randn(2, 2, device="tpu"); z = x @ y
print(z); print(z.device)
assert torch.allclose(z.cpu(), x.cpu() @ y.cpu(), atol=1e-6)
"""


def test_autoload_without_import() -> None:
    r = run_python(CHECK)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("tpu:0")


def test_import_torch_does_not_start_jax() -> None:
    r = run_python(
        "import sys, torch; import torch_tpu\n"
        "assert 'tpu' == torch._C._get_privateuse1_backend_name()\n"
        "assert not torch.tpu.is_initialized()\n"
        "print(sorted(m for m in sys.modules if m.startswith('jax')))"
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", r.stdout


def test_autoload_can_be_disabled() -> None:
    r = run_python(
        "import sys, torch\n"
        "print('torch_tpu' in sys.modules, torch._C._get_privateuse1_backend_name())",
        env={"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"},
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "privateuseone"]


def _wheel() -> str:
    wheels = glob.glob(str(REPO / "bazel-bin" / "torch_tpu-0.2.0-*.whl"))
    assert wheels, "bazel-bin/torch_tpu-0.2.0-*.whl is missing: run tools/setup.sh"
    return wheels[0]


@pytest.mark.slow
def test_fresh_venv_with_only_torch_jax_and_the_wheel(tmp_path: Path) -> None:
    """A new venv with torch, jax and the wheel (nothing else asked for) runs the user guide's check."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    subprocess.run(
        [py, "-m", "pip", "install", "-q", "--disable-pip-version-check", "torch==2.13.0", "jax==0.10.2",
         "jaxlib==0.10.2", _wheel()],
        check=True, timeout=1200,
    )
    r = subprocess.run([py, "-c", CHECK], capture_output=True, text=True, cwd=str(tmp_path), timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("tpu:0")


def test_import_torch_tpu_before_torch() -> None:
    """`import torch_tpu` before torch (as `python -m torch_tpu.compile_cache` does) loads the backend, no cycle."""
    out = run_python("import torch_tpu, torch; print(torch.ones(2, device='tpu').sum().item())")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "2.0"
