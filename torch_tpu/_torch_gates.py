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


# Compiled under a name outside torch_tpu's folder: Dynamo skips every frame in torch_tpu (_compile._register), and
# flex_attention calls the gate while Dynamo traces it, so the gate must be traceable (it folds to a constant on
# fake tensors, then inlines PyTorch's own check for other devices as before).
_GATE_SOURCE = """
def _validate_device(query, key, value):
    if query.device.type != "tpu":
        upstream(query, key, value)
"""


def _lift_flex_attention(module: Any) -> None:
    upstream = module._validate_device
    if getattr(upstream, "__wrapped__", None) is not None:
        return
    scope: dict[str, Any] = {"upstream": upstream}
    exec(compile(_GATE_SOURCE, "<torch_tpu: FlexAttention device gate>", "exec"), scope)
    gate = scope["_validate_device"]
    gate.__wrapped__ = upstream
    gate.__doc__ = "PyTorch's FlexAttention device check, lifted for tpu tensors (torch_tpu/_torch_gates.py)."
    module._validate_device = gate


def install() -> None:
    from torch_tpu import _import_hooks

    _import_hooks.when_imported(_FLEX, _lift_flex_attention)
