"""The test tiers (conftest.py): tests marked `extended` leave the default run, join it with --extended, and run
when named by node id; the run says how many it left out."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO

SWEEP = "tests/test_conj.py::test_every_opinfo_with_lazy_bit_inputs"  # marked extended


def _collect(*args: str) -> tuple[list[str], str]:
    # -P: the repository root (the cwd) must not shadow the installed wheel
    out = subprocess.run([sys.executable, "-P", "-m", "pytest", "--collect-only", "-q", "-p", "no:warnings", *args],
                         capture_output=True, text=True, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return [ln for ln in out.stdout.splitlines() if "::" in ln], out.stdout


def test_extended_tests_leave_the_default_run_unless_named() -> None:
    ids, text = _collect("tests/test_conj.py", f"{SWEEP}[neg]")
    assert ids and f"{SWEEP}[conj]" not in ids
    assert ids.count(f"{SWEEP}[neg]") == 1  # named by node id: kept
    assert "1 test marked extended not run: bash tools/test_extended runs them" in text


def test_extended_flag_brings_them_back() -> None:
    only, _ = _collect("tests/test_conj.py", "--extended", "-m", "extended")
    assert only == [f"{SWEEP}[conj]", f"{SWEEP}[neg]"]
