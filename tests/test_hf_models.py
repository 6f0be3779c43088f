"""Hugging Face GPT-2 and T5 (random-init tiny configs) train on tpu exactly like on CPU, with the optimizer
built before `model.to("tpu")`: same loss per step, same unique parameters, ties kept, the tied embedding
gets its gradient. Runs tools/check_hf_models.py's comparison; skips when transformers is not installed."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from conftest import REPO

pytest.importorskip("transformers")


def _tool():
    spec = importlib.util.spec_from_file_location("check_hf_models", REPO / "tools" / "check_hf_models.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up while the class is made
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("name, unique", [("gpt2", 28), ("t5", 47)])
def test_hf_model_trains_like_cpu(name, unique):
    r = _tool().compare(name, steps=5)
    assert r["cpu"]["unique_params"] == unique  # the tiny config's count on CPU (ties: wte/lm_head, shared x4)
    assert r["tpu"]["unique_params"] == unique
    assert r["checks"] == {k: True for k in r["checks"]}, (r["cpu"]["losses"], r["tpu"]["losses"])
