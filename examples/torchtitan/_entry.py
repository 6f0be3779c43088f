"""One TorchTitan training process, started by examples/torchtitan/run.py (directly or under torchrun).

    python _entry.py --device {tpu,cpu} -- <torchtitan.train arguments>

--device tpu: torch_tpu autoloads with torch (strict: TORCH_TPU_CPU_FALLBACK must be unset) and TorchTitan
picks `tpu` and `tpu_dist` on its own (`torch._utils._get_available_device_type`,
`dist.Backend.default_device_backend_map`); torch_tpu itself lifts PyTorch's FlexAttention device allow-list
for tpu tensors, and only `torch.distributed.set_timeout` is bridged (below). TorchTitan's
own `torch.compile` (Inductor) regions around flex_attention and create_block_mask run as TorchTitan wrote them:
on XLA:CPU default torch.compile sends tpu graphs to the `tpu` backend, which lowers the flex_attention
higher-order op.

--device cpu: the oracle. torch_tpu is not loaded (TORCH_DEVICE_BACKEND_AUTOLOAD=0) and TorchTitan, which
knows no CPU training device, is pointed at `cpu` (`torch.cpu` as its device module, gloo as its backend).
CPU FlexAttention refuses backward, eager and under Inductor (its CPU template has none), so the oracle
runs PyTorch's own math reference of the flex_attention operator eagerly — the ops, not a reimplementation.
"""

from __future__ import annotations

import os
import sys


def _split_argv(argv: list[str]) -> tuple[str, list[str]]:
    if len(argv) < 2 or argv[0] != "--device" or argv[1] not in ("tpu", "cpu"):
        sys.exit("usage: _entry.py --device {tpu,cpu} -- <torchtitan.train arguments>")
    rest = argv[2:]
    if rest and rest[0] == "--":
        rest = rest[1:]
    return argv[1], rest


def _lift_cpu_flex_backward_gate() -> None:
    """CPU oracle only: PyTorch's FlexAttention refuses backward on `cpu` in Python (`_validate_device`; its
    Inductor CPU template has none) before the op is looked at. The oracle calls flex_attention eagerly
    (_eager_flex_regions), where it is PyTorch's device-generic math reference with its own backward, so that
    one check is lifted. (For `tpu`, torch_tpu itself lifts the allow-list that leaves it out:
    torch_tpu/_torch_gates.py.)"""
    import torch.nn.attention.flex_attention as fa

    upstream = fa._validate_device

    def _validate_device(query, key, value):
        if query.device.type == "cpu":
            return
        upstream(query, key, value)

    fa._validate_device = _validate_device


def _eager_flex_regions() -> None:
    """CPU oracle only: TorchTitan wraps `flex_attention` and `create_block_mask` in `torch.compile`
    (Inductor) at import, and Inductor's CPU flex template has no backward. The oracle calls the two functions
    eagerly instead: PyTorch's own flex_attention (its math reference) and create_block_mask."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    from torchtitan.models.common import attention

    attention.FlexAttention._compiled_flex_attn = flex_attention
    attention._compiled_create_block_mask = create_block_mask


def _pg_timeout_bridge() -> None:
    """TorchTitan 0.3.0 lowers every process group's timeout after step 1 with
    `torch.distributed.set_timeout`, which torch 2.13 does not have (0.3.0 targets a newer PyTorch, on any
    device). Where it is missing the groups keep their start-up timeout; nothing else changes."""
    import torch.distributed as dist

    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = lambda timeout, group=None: None


def _gloo_gradient_sum() -> None:
    """TorchTitan normalises the loss by the global token count and sets FSDP2's gradient divide factor to
    1.0, which FSDP2 sends as ReduceOp.PREMUL_SUM(1.0); gloo refuses PREMUL_SUM. For the CPU oracle that
    one reduction is sent as SUM, the same value."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as coll

    upstream = coll._get_gradient_divide_factors

    def _get_gradient_divide_factors(reduce_scatter_group, all_reduce_group, reduce_dtype, device_type="",
                                     factor=None, force_sum_reduction_for_comms=False):
        got = upstream(reduce_scatter_group, all_reduce_group, reduce_dtype, device_type, factor,
                       force_sum_reduction_for_comms)
        if factor == 1.0 and got[:2] == (None, None):
            return None, None, coll.ReduceOp.SUM, got[3]
        return got

    coll._get_gradient_divide_factors = _get_gradient_divide_factors


def _cpu_as_titan_device() -> None:
    """TorchTitan asks `torch._utils` for the accelerator and calls the device module's CUDA-style API
    (name, properties, memory statistics, set_device). `torch.cpu` has only part of it: the oracle gets a
    device module for `cpu` whose memory statistics are empty (TorchTitan prints them, nothing else)."""
    import types

    import torch
    import torch._utils

    mod = types.ModuleType("titan_cpu_device")
    mod.device_count = lambda: 1
    mod.current_device = lambda: 0
    mod.set_device = lambda device: None
    mod.synchronize = lambda device=None: None
    mod.is_available = lambda: True
    mod.get_device_name = lambda device=None: "cpu"
    mod.get_device_properties = lambda device=None: types.SimpleNamespace(name="cpu", total_memory=1 << 40)
    mod.memory_stats = lambda device=None: {}
    mod.reset_peak_memory_stats = lambda device=None: None
    mod.empty_cache = lambda: None
    upstream = torch._utils._get_device_module

    torch._utils._get_available_device_type = lambda: "cpu"
    torch._utils._get_device_module = lambda device_type=None: mod if device_type == "cpu" else upstream(device_type)


def main() -> None:
    device, titan_argv = _split_argv(sys.argv[1:])
    if device == "cpu":
        os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
    elif os.environ.get("TORCH_TPU_CPU_FALLBACK"):
        sys.exit("examples/torchtitan: unset TORCH_TPU_CPU_FALLBACK: the tpu run must be strict")

    import torch

    if device == "tpu":
        if not (hasattr(torch, "tpu") and torch.tpu.is_available()):
            sys.exit("examples/torchtitan: torch_tpu did not load with torch (is the wheel installed?)")
    else:
        _cpu_as_titan_device()
        _gloo_gradient_sum()
    if device == "cpu":
        _lift_cpu_flex_backward_gate()

    _pg_timeout_bridge()
    if device == "cpu":
        _eager_flex_regions()
    sys.argv = ["torchtitan.train", *titan_argv]
    from torchtitan.train import main as titan_main

    titan_main()


if __name__ == "__main__":
    main()
