"""Autoload through the torch.backends entry point, lazy runtime start, and a clean venv."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, built_wheel, run_python

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
    return str(built_wheel())


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


# A bad TORCH_TPU_* value read at `import torch`: import works (CPU work too), and the first tpu use (and every
# later one, and torch.tpu.is_available) raises an error naming the variable, the value and the valid values.
_BAD_ENV = """
import torch
print("imported", (torch.ones(2) + 1).tolist(), flush=True)
for what in ("available", "first", "second"):
    try:
        torch.tpu.is_available() if what == "available" else torch.zeros(1, device="tpu") + 1
        print(what, "NO ERROR", flush=True)
    except RuntimeError as e:
        print(what, "ERROR", str(e).replace("\\n", " "), flush=True)
"""


@pytest.mark.parametrize("name,value,valid", [
    ("TORCH_TPU_EAGER_MODE", "bogus", ["DEFER_NEVER", "DEFER_AND_FUSE", "DEFER_NEVER_AND_LAUNCH_BLOCKING"]),
    ("TORCH_TPU_CPU_FALLBACK", "sometimes", ["'warn'", "'strict'"]),
    ("TORCH_TPU_CACHE", "perhaps", ["0 (or false, off, no)", "1 (or true, on, yes, unset)"]),
    ("TORCH_TPU_CACHE_MAX_BYTES", "garbage", ["4G", "512M"]),
    ("TORCH_TPU_FUSE_MAX_OPS", "many", ["positive integer"]),
    ("TORCH_TPU_FUSE_CACHE", "0", ["positive integer"]),
    ("TORCH_TPU_RECOMPILE_WARN", "x", ["e.g. 8", "0 turns the warning off"]),
    ("TORCH_TPU_NUM_DEVICES", "x", ["positive integer"]),
    ("TORCH_TPU_PLATFORM", "bogus", ["cpu, tpu, cuda"]),
], ids=lambda v: v if isinstance(v, str) and v.startswith("TORCH_TPU_") else "")
def test_bad_env_value_raises_at_first_tpu_use_not_at_import(name, value, valid, tmp_path) -> None:
    r = run_python(_BAD_ENV, env={name: value, "TORCH_TPU_CACHE_DIR": str(tmp_path)})
    assert r.returncode == 0 and "imported [2.0, 2.0]" in r.stdout, r.stdout + r.stderr[-3000:]
    for what in ("available", "first", "second"):
        line = next(ln for ln in r.stdout.splitlines() if ln.startswith(what + " "))
        assert "ERROR torch_tpu" in line and f"{name}={value!r}" in line, line
        for v in valid:
            assert v in line, (v, line)
