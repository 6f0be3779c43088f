"""PyTorch checks in Python that name the devices an operator may run on and leave `tpu` out, although the
operator runs on tpu: lifted for tpu tensors only; every other device still gets PyTorch's own check, unchanged.

- FlexAttention (`torch.nn.attention.flex_attention._validate_device`): an allow-list {cuda, cpu, xpu, hpu, mps}
  raises before the op is looked at. On tpu, eager flex_attention runs PyTorch's device-generic math reference and
  its backward on tpu kernels, and compiled graphs lower the flex_attention higher-order op (kernels/nn/
  flex_attention.py). The module is patched when it is imported (torch_tpu/_import_hooks.py), not at `import torch`.
"""

from __future__ import annotations

from typing import Any

_FLEX = "torch.nn.attention.flex_attention"


def _lift_flex_attention(module: Any) -> None:
    upstream = module._validate_device
    if getattr(upstream, "__wrapped__", None) is not None:
        return

    def _validate_device(query: Any, key: Any, value: Any) -> None:
        if query.device.type != "tpu":
            upstream(query, key, value)

    _validate_device.__wrapped__ = upstream  # type: ignore[attr-defined]
    module._validate_device = _validate_device


def install() -> None:
    from torch_tpu import _import_hooks

    _import_hooks.when_imported(_FLEX, _lift_flex_attention)
