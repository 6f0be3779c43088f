"""Eager tpu kernels for PyTorch's functional collectives (`torch.ops._c10d_functional`, used by
`torch.distributed._functional_collectives`, DTensor and DeviceMesh). Each runs the collective on the group's
tpu_dist process group and returns when the result is ready, so `wait_tensor` is the identity. Inside
`torch.compile(backend="tpu")` graphs the same ops are XLA collectives of the compiled program
(distributed/_compiled.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as _c10d

_LIB: torch.library.Library | None = None

_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "product": dist.ReduceOp.PRODUCT,
        "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX, "band": dist.ReduceOp.BAND,
        "bor": dist.ReduceOp.BOR, "bxor": dist.ReduceOp.BXOR}


def _group(name: Any) -> Any:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def _op(reduce_op: str) -> Any:
    if reduce_op.lower() == "premul_sum":
        # The functional ops name their reduction by a string, so a PREMUL_SUM factor cannot reach them (PyTorch's
        # own c10d functional kernels do not accept "premul_sum" either).
        raise ValueError("tpu_dist: functional collectives cannot take reduce op 'premul_sum': a string carries no "
                         "factor. Multiply the input by the factor and use 'sum', or call dist.all_reduce / "
                         "dist.reduce_scatter_tensor with op=dist._make_nccl_premul_sum(factor).")
    try:
        return _OPS[reduce_op.lower()]
    except KeyError:
        raise ValueError(f"tpu_dist: functional collectives do not support reduce op {reduce_op!r}; use one of "
                         f"{', '.join(_OPS)}") from None


def _ar_opts(reduce_op: str) -> Any:
    o = _c10d.AllreduceOptions()
    o.reduceOp = _op(reduce_op)
    return o


def all_reduce_(input: torch.Tensor, reduce_op: str, group_name: Any) -> torch.Tensor:
    _group(group_name).allreduce([input], _ar_opts(reduce_op)).wait()
    return input


def all_reduce(input: torch.Tensor, reduce_op: str, group_name: Any) -> torch.Tensor:
    return all_reduce_(input.clone(), reduce_op, group_name)


def all_reduce_coalesced_(inputs: list[torch.Tensor], reduce_op: str, group_name: Any) -> list[torch.Tensor]:
    _group(group_name).allreduce(list(inputs), _ar_opts(reduce_op)).wait()
    return list(inputs)


def all_reduce_coalesced(inputs: list[torch.Tensor], reduce_op: str, group_name: Any) -> list[torch.Tensor]:
    return all_reduce_coalesced_([t.clone() for t in inputs], reduce_op, group_name)


def all_gather_into_tensor_out(input: torch.Tensor, group_size: int, group_name: Any, *, out: torch.Tensor
                               ) -> torch.Tensor:
    _group(group_name).all_gather_single(out, input.contiguous(), _c10d.AllgatherOptions()).wait()
    return out


def all_gather_into_tensor(input: torch.Tensor, group_size: int, group_name: Any) -> torch.Tensor:
    shape = (input.shape[0] * group_size,) + tuple(input.shape[1:]) if input.dim() else (group_size,)
    out = torch.empty(shape, dtype=input.dtype, device=input.device)
    return all_gather_into_tensor_out(input, group_size, group_name, out=out)


def all_gather_into_tensor_coalesced(inputs: list[torch.Tensor], group_size: int, group_name: Any
                                     ) -> list[torch.Tensor]:
    return [all_gather_into_tensor(t, group_size, group_name) for t in inputs]


def reduce_scatter_tensor_out(input: torch.Tensor, reduce_op: str, group_size: int, group_name: Any, *,
                              out: torch.Tensor) -> torch.Tensor:
    o = _c10d.ReduceScatterOptions()
    o.reduceOp = _op(reduce_op)
    _group(group_name).reduce_scatter_single(out, input.contiguous(), o).wait()
    return out


def reduce_scatter_tensor(input: torch.Tensor, reduce_op: str, group_size: int, group_name: Any) -> torch.Tensor:
    if input.shape[0] % group_size:
        raise RuntimeError(f"tpu_dist: reduce_scatter_tensor: dimension 0 of {list(input.shape)} is not divisible "
                           f"by the group size {group_size}")
    out = torch.empty((input.shape[0] // group_size,) + tuple(input.shape[1:]), dtype=input.dtype,
                      device=input.device)
    return reduce_scatter_tensor_out(input, reduce_op, group_size, group_name, out=out)


def reduce_scatter_tensor_coalesced(inputs: list[torch.Tensor], reduce_op: str, group_size: int, group_name: Any
                                    ) -> list[torch.Tensor]:
    return [reduce_scatter_tensor(t, reduce_op, group_size, group_name) for t in inputs]


def all_to_all_single(input: torch.Tensor, output_split_sizes: list[int], input_split_sizes: list[int],
                      group_name: Any) -> torch.Tensor:
    pg = _group(group_name)
    rows = sum(output_split_sizes) if output_split_sizes else input.shape[0]
    out = torch.empty((rows,) + tuple(input.shape[1:]), dtype=input.dtype, device=input.device)
    pg.all_to_all_single(out, input.contiguous(), list(output_split_sizes), list(input_split_sizes),
                         _c10d.AllToAllOptions()).wait()
    return out


def broadcast_(input: torch.Tensor, src: int, group_name: Any) -> torch.Tensor:
    o = _c10d.BroadcastOptions()
    o.rootRank = src
    _group(group_name).broadcast([input], o).wait()
    return input


def broadcast(input: torch.Tensor, src: int, group_name: Any) -> torch.Tensor:
    return broadcast_(input.clone(), src, group_name)


def wait_tensor(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


_KERNELS = {
    "all_reduce": all_reduce, "all_reduce_": all_reduce_, "all_reduce_coalesced": all_reduce_coalesced,
    "all_reduce_coalesced_": all_reduce_coalesced_, "all_gather_into_tensor": all_gather_into_tensor,
    "all_gather_into_tensor_out": all_gather_into_tensor_out,
    "all_gather_into_tensor_coalesced": all_gather_into_tensor_coalesced,
    "reduce_scatter_tensor": reduce_scatter_tensor, "reduce_scatter_tensor_out": reduce_scatter_tensor_out,
    "reduce_scatter_tensor_coalesced": reduce_scatter_tensor_coalesced, "all_to_all_single": all_to_all_single,
    "broadcast": broadcast, "broadcast_": broadcast_, "wait_tensor": wait_tensor,
}


def install() -> None:
    """Registers the kernels for PrivateUse1 (cheap: no JAX import)."""
    global _LIB
    if _LIB is not None:
        return
    lib = torch.library.Library("_c10d_functional", "IMPL")
    for name, fn in _KERNELS.items():
        lib.impl(name, fn, "PrivateUse1")
    _LIB = lib
