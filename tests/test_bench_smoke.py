"""tools/bench.py host runs: a few iterations of its rows in a fresh process (figures are not checked; speed is
measured by the benchmark, never asserted in a test)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from conftest import REPO

BENCH = str(REPO / "tools" / "bench.py")


def _bench(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TORCH_TPU_EAGER_MODE"}
    return subprocess.run([sys.executable, BENCH, *args], capture_output=True, text=True, env=env, timeout=timeout,
                          cwd="/")


def test_host_quick_prints_each_ratio_with_its_target() -> None:
    # The Hugging Face / torchvision row and the cold-start subprocesses are left out to stay short.
    out = _bench("host", "--quick", "--rows", "eager,mlp,sync")
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert "FAILED" not in text, text
    ratios = re.findall(r"-> (\d+\.\d+)x \(target <= (\d+\.\d+)x\)  (ok|MISSES TARGET)", text)
    # a: 1 ratio, b: the fused MLP ratio (DEFER_NEVER is informational), e: 2 sync-heavy ratios
    assert len(ratios) == 4, text
    assert all(float(r) > 0 for r, _, _ in ratios), text
    assert [t for _, t, _ in ratios] == ["1.20", "1.30", "1.00", "1.00"], text
    summary = text.split("host summary", 1)[1]
    for row in ("a. eager x + y", "b. MLP step DEFER_AND_FUSE", "b. MLP step DEFER_NEVER", "e. sync-heavy"):
        assert row in summary, text


def test_host_unknown_row_names_the_choices() -> None:
    out = _bench("host", "--rows", "eager,nope", timeout=120)
    assert out.returncode == 2
    assert "unknown host row(s) nope" in out.stderr and "eager" in out.stderr, out.stderr


@pytest.mark.extended  # about a minute: the doctor itself is tested in test_doctor.py
def test_doctor_row_prints_the_overhead_ratio() -> None:
    out = _bench("doctor", timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    m = re.search(r"script alone +(\d+\.\d+) s +under the doctor +(\d+\.\d+) s +-> ratio (\d+\.\d+)x", out.stdout)
    assert m and all(float(v) > 0 for v in m.groups()), out.stdout
