"""Bad input gets PyTorch's usual errors or a message naming the op and the way out; nothing falls back
silently."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from conftest import REPO, run_python


def test_missing_op_is_strict_by_default() -> None:
    x = torch.randn(3, device="tpu")
    torch.tpu.fallback_report(reset=True)  # (an earlier test's opt-in fallbacks are not this test's)
    with pytest.raises(NotImplementedError) as e:
        torch.fake_quantize_per_tensor_affine(x, 0.1, 0, 0, 255)
    msg = str(e.value)
    assert "aten::fake_quantize_per_tensor_affine_cachemask" in msg
    assert "TORCH_TPU_CPU_FALLBACK=warn" in msg and "torch.tpu.set_cpu_fallback(True)" in msg
    assert torch.tpu.fallback_report() == {}


def test_opt_in_cpu_fallback_warns_once_and_counts() -> None:
    x = torch.randn(3, device="tpu")
    torch.tpu.fallback_report(reset=True)
    with torch.tpu.cpu_fallback(), warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for _ in range(3):
            y = torch.fake_quantize_per_tensor_affine(x, 0.1, 0, 0, 255)
    fell_back = [str(m.message) for m in w if "runs on CPU" in str(m.message)]
    assert len(fell_back) == 1 and "aten::fake_quantize_per_tensor_affine_cachemask" in fell_back[0]
    assert y.device.type == "tpu"
    torch.testing.assert_close(y.cpu(), torch.fake_quantize_per_tensor_affine(x.cpu(), 0.1, 0, 0, 255))
    assert torch.tpu.fallback_report(reset=True) == {"aten::fake_quantize_per_tensor_affine_cachemask": 3}
    with pytest.raises(NotImplementedError):  # strict again outside the context
        torch.fake_quantize_per_tensor_affine(x, 0.1, 0, 0, 255)


def test_fallback_env_var() -> None:
    r = run_python(
        "import torch, warnings\n"
        "x = torch.randn(3, device='tpu')\n"
        "y = torch.fake_quantize_per_tensor_affine(x, 0.1, 0, 0, 255)\n"
        "print(torch.tpu.fallback_report())",
        env={"TORCH_TPU_CPU_FALLBACK": "warn"},
    )
    assert r.returncode == 0, r.stderr
    assert "{'aten::fake_quantize_per_tensor_affine_cachemask': 1}" in r.stdout
    assert "runs on CPU" in r.stderr
    bad = run_python("import torch\nprint('imported', flush=True)\ntorch.zeros(1, device='tpu')",
                     env={"TORCH_TPU_CPU_FALLBACK": "sometimes"})
    assert "imported" in bad.stdout, bad.stderr  # `import torch` works; the first tpu use raises
    assert bad.returncode != 0 and "TORCH_TPU_CPU_FALLBACK='sometimes' is not understood" in bad.stderr


def test_device_mismatch_is_pytorchs_error() -> None:
    a = torch.randn(2, 2, device="tpu")
    b = torch.randn(2, 2)
    for fn in (lambda: a + b, lambda: b + a, lambda: torch.mm(a, b), lambda: torch.mul(b, a), lambda: a.add_(b)):
        with pytest.raises(RuntimeError, match=r"Expected all tensors to be on the same device, but found at least two devices, (tpu:0 and cpu|cpu and tpu:0)"):
            fn()


def test_unsupported_layout_and_dtype_errors() -> None:
    with pytest.raises(NotImplementedError, match="'Sparsetpu' backend"):  # PyTorch's own message
        torch.empty(2, 2, device="tpu", layout=torch.sparse_coo)
    with pytest.raises(RuntimeError, match="bool tensors is not supported"):
        torch.ones(2, dtype=torch.bool, device="tpu") - torch.ones(2, dtype=torch.bool, device="tpu")


@pytest.mark.parametrize("fn", [lambda b: b - 1, lambda b: b - 1.5, lambda b: 2 - b, lambda b: torch.sub(b.float(), True),
                                lambda b: torch.rsub(b, 1), lambda b: b.float().sub_(b)])
def test_sub_with_one_bool_operand_is_refused_like_cpu(fn) -> None:
    """PyTorch checks the operands' own dtypes: promotion must not turn `bool - 1` into an integer subtraction."""
    b = torch.tensor([True, False])
    with pytest.raises(RuntimeError, match="with a bool tensor is not supported") as cpu:
        fn(b)
    with pytest.raises(RuntimeError, match="with a bool tensor is not supported") as tpu:
        fn(b.to("tpu")).cpu()
    assert str(tpu.value).split(" If")[0] == str(cpu.value).split(" If")[0]


def _setup_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_TPU")}
    env.update(extra)
    return env


def test_setup_reports_missing_bazel(tmp_path: Path) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "python3").symlink_to(os.path.realpath(sys.executable))
    for tool in ("bash", "dirname", "id", "cat", "printf", "ls", "head", "sha256sum", "cut", "sed"):
        src = subprocess.run(["bash", "-c", f"command -v {tool}"], capture_output=True, text=True).stdout.strip()
        if src:
            (bindir / tool).symlink_to(src)
    env = _setup_env(tmp_path, PATH=str(bindir), TORCH_TPU_NO_APT="1")
    r = subprocess.run(["bash", str(REPO / "tools" / "setup.sh")], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode != 0
    assert "Bazel is not installed" in r.stderr and "apt-get install bazel-bootstrap" in r.stderr


def test_setup_reports_wrong_torch(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    fake = venv / "bin" / "python"
    fake.write_text("#!/bin/sh\necho 2.0.1\n")
    fake.chmod(0o755)
    env = _setup_env(tmp_path, TORCH_TPU_VENV=str(venv))
    r = subprocess.run(["bash", str(REPO / "tools" / "setup.sh")], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode != 0
    assert "has torch 2.0.1, but torch_tpu is built for torch==2.13.0" in r.stderr
    assert "pip install torch==2.13.0" in r.stderr


def test_complex32_names_tpu_and_the_supported_dtypes() -> None:
    cases = [
        lambda: torch.zeros(3, dtype=torch.chalf, device="tpu"),
        lambda: torch.zeros(3, dtype=torch.chalf).to("tpu"),
        lambda: torch.zeros(3, device="tpu").to(torch.chalf),
        lambda: torch.complex(*torch.ones(2, 2, dtype=torch.half, device="tpu")),
        lambda: torch.zeros(4, device="tpu").view(torch.chalf) + 1,  # not Python's "unsupported operand type(s)"
    ]
    for make in cases:
        with pytest.raises(RuntimeError) as info:
            make()
        msg = str(info.value)
        assert "dtype torch.complex32 is not supported on tpu" in msg, msg
        assert "float32" in msg and "bfloat16" in msg and "complex64" in msg and "float8_e4m3fn" in msg, msg
        assert "Use torch.complex64" in msg, msg
    # CPU has it: the oracle for what the message suggests
    ok = torch.complex(torch.ones(2, dtype=torch.half), torch.ones(2, dtype=torch.half)).to(torch.complex64).to("tpu")
    torch.testing.assert_close(ok.cpu(), torch.ones(2, dtype=torch.complex64) * (1 + 1j))


# Bad calls that used to return a value on tpu (the OpInfo error and reference inputs found them): each now
# behaves as on CPU.
def test_cat_dim_out_of_range_raises_like_cpu() -> None:
    a = torch.arange(6.0).view(2, 3)
    for dim in (2, 3, -3):
        with pytest.raises(IndexError, match="Dimension out of range"):
            torch.cat([a, a], dim=dim)  # the CPU oracle raises too
        with pytest.raises(IndexError, match=r"Dimension out of range \(expected to be in range of \[-2, 1\]"):
            torch.cat([a.to("tpu"), a.to("tpu")], dim=dim)
    with pytest.raises(RuntimeError, match="Sizes of tensors must match except in dimension 0"):
        torch.cat([torch.ones(2, 3, device="tpu"), torch.ones(3, 2, device="tpu")])


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8])
def test_arange_into_an_integer_out_steps_like_cpu(dtype) -> None:
    for start, end, step in ((0, 10, 2.5), (0.5, 7, 1.5), (1, 9.7, 3)):
        cpu = torch.arange(start, end, step, out=torch.empty(0, dtype=dtype))
        tpu = torch.arange(start, end, step, out=torch.empty(0, dtype=dtype, device="tpu"))
        assert torch.equal(tpu.cpu(), cpu), (start, end, step, tpu.cpu(), cpu)


def test_uniform_bounds_must_fit_the_dtype() -> None:
    with pytest.raises(RuntimeError, match="from is out of bounds for c10::Half"):
        torch.empty(4, dtype=torch.float16).uniform_(-1e6, 0)
    with pytest.raises(RuntimeError, match="from is out of bounds for c10::Half"):
        torch.empty(4, dtype=torch.float16, device="tpu").uniform_(-1e6, 0)


@pytest.mark.parametrize("mode", ["DEFER_NEVER", "DEFER_AND_FUSE"])
def test_softshrink_keeps_nan(mode) -> None:
    x = torch.tensor([float("nan"), 1.0, -1.0, 0.2, float("inf"), -float("inf")])
    with torch.tpu.set_eager_mode(mode):
        got = torch.nn.functional.softshrink(x.to("tpu")).cpu()
    torch.testing.assert_close(got, torch.nn.functional.softshrink(x), equal_nan=True)
