"""The selection rule of kernels/pallas/ (TORCH_TPU_PALLAS): which path a Pallas-backed kernel takes."""

from __future__ import annotations

import pytest
import torch  # noqa: F401  (loads torch_tpu)

from torch_tpu import _runtime
from torch_tpu.kernels.pallas import _select


@pytest.mark.parametrize("setting,fits,want", [
    ("reference", True, "reference"), ("interpret", True, "interpret"), ("interpret", False, "reference"),
    ("auto", False, "reference"),
])
def test_path_follows_the_setting_and_the_constraints(monkeypatch, setting, fits, want) -> None:
    monkeypatch.setenv("TORCH_TPU_PALLAS", setting)
    before = _select.CHOSEN[("k", want)]
    assert _select.path("k", fits) == want
    assert _select.CHOSEN[("k", want)] == before + 1


def test_auto_uses_the_kernel_only_on_a_tpu(monkeypatch) -> None:
    monkeypatch.delenv("TORCH_TPU_PALLAS", raising=False)
    assert _select.path("k", True) == ("tpu" if _runtime.platform() == "tpu" else "reference")


def test_a_bad_setting_names_the_variable(monkeypatch) -> None:
    monkeypatch.setenv("TORCH_TPU_PALLAS", "mosaic")
    with pytest.raises(RuntimeError, match="TORCH_TPU_PALLAS='mosaic'.*auto, interpret, reference"):
        _select.path("k", True)
