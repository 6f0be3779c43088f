"""torch.distributed.checkpoint with tpu tensors: a tensor-parallel model (DTensor weights sharded Shard(0) and
Shard(1) over a 2-rank DeviceMesh("tpu")), or an FSDP2 one, and its AdamW state, taken with `get_state_dict`, plus a DTensor with
uneven shards (5 rows on 2 ranks), written with `dcp.save` on 2 ranks, then loaded (`dcp.load` + `set_state_dict`) by one
process without a process group into a plain tpu model, and by 2 ranks into a fresh tensor-parallel model: every
value equal to the saved one, tpu tensors in and out. Writers: the serial host copy, `dcp.async_save` (with a
gloo group for its planning, as CUDA needs one) and the default one, which stages the copies on torch.tpu streams
(`current_stream()`, `stream(s)`, `wait_stream`).

Ranks start as in tests/test_distributed.py (its launcher and per-rank `_init`), each as
`python tests/test_dcp.py <scenario>` with a timeout.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

from test_distributed import _init  # noqa: E402

# (TP itself needs even shards: RowwiseParallel rebuilds its input's global shape as local size x world size)
IN, HIDDEN, OUT = 16, 32, 7
ROWS = 5  # the extra DTensor's rows: Shard(0) on 2 ranks puts 3 on rank 0 and 2 on rank 1 (torch.chunk's split)


def _model(seed: int):
    import torch
    import torch.nn as nn

    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, OUT))


def _parallelize(model, mesh, how: str = "tp"):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if how == "fsdp2":  # every parameter Shard(0), gathered per layer for compute
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    return parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})


def _train(model, opt, dev, steps: int = 2) -> None:
    import torch

    g = torch.Generator().manual_seed(3)
    for _ in range(steps):
        x, y = torch.randn(8, IN, generator=g), torch.randn(8, OUT, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x.to(dev)), y.to(dev)).backward()
        opt.step()


def _flat(state: dict, prefix: str = "") -> dict:
    """Nested state dict -> {dotted key: value}, DTensors as their full tensors."""
    from torch.distributed.tensor import DTensor

    out = {}
    for k, v in state.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(v, key + "."))
        elif isinstance(v, list):
            out.update(_flat(dict(enumerate(v)), key + "."))
        else:
            out[key] = v.full_tensor() if isinstance(v, DTensor) else v
    return out


def _assert_equal_to_saved(state: dict, dev) -> None:
    """Every tensor on the device type it was saved from (tpu; the optimizer's `step` counters are CPU scalars as
    on CUDA), DTensor shards on tpu, and equal to what the saving ranks had."""
    import torch
    from torch.distributed.tensor import DTensor

    want, devices = torch.load(os.environ["TEST_CKPT"] + ".expected.pt")
    flat = _flat(state)
    assert sorted(flat) == sorted(want), (sorted(flat), sorted(want))
    assert sum(d == "tpu" for d in devices.values()) == 13, devices  # 4 parameters, 2 moments each, the table
    for k, v in flat.items():
        w = want[k]
        if isinstance(w, torch.Tensor):
            assert isinstance(v, torch.Tensor) and v.device.type == devices[k], (k, type(v), v.device, devices[k])
            assert v.device.type == "cpu" or v.device == dev, (k, v.device)
            assert v.dtype == w.dtype and v.shape == w.shape, (k, v.dtype, w.dtype, v.shape, w.shape)
            assert torch.equal(v.cpu(), w), (k, (v.cpu() - w).abs().max())
        else:
            assert v == w, (k, v, w)
    for v in _leaves(state):
        if isinstance(v, DTensor):
            assert v.to_local().device == dev, v


def _leaves(state):
    if isinstance(state, dict):
        for v in state.values():
            yield from _leaves(v)
    elif isinstance(state, list):
        for v in state:
            yield from _leaves(v)
    else:
        yield state


def _scenario_save() -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    rank, n, dev = _init()
    mesh = init_device_mesh("tpu", (n,))
    model = _parallelize(_model(0).to(dev), mesh, os.environ["TEST_SHARDING"])
    w = model[0].weight
    assert isinstance(w, DTensor) and w.placements == (Shard(0),) and w.to_local().shape == (HIDDEN // n, IN)
    table = distribute_tensor(torch.arange(ROWS * 3.0).reshape(ROWS, 3).to(dev) * 0.5 - 1, mesh, [Shard(0)])
    assert table.to_local().shape == ((3 if rank == 0 else 2), 3), table.to_local().shape
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, dev)
    msd, osd = get_state_dict(model, opt)
    assert isinstance(msd["0.weight"], DTensor) and isinstance(osd["state"]["0.weight"]["exp_avg"], DTensor)
    state = {"model": msd, "optim": osd, "extra": {"table": table}}
    flat = _flat(state)
    expected = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in flat.items()}
    devices = {k: v.device.type for k, v in flat.items() if isinstance(v, torch.Tensor)}
    writer = os.environ["TEST_WRITER"]
    if writer == "serial":  # copies each tensor to the host in turn, on no stream
        dcp.save(state, storage_writer=dcp.FileSystemWriter(os.environ["TEST_CKPT"], per_thread_copy_ahead=0))
    elif writer == "async":  # stages a CPU copy, then writes in the background; its planning needs a CPU group
        gloo = dist.new_group(backend="gloo")
        dcp.async_save(state, storage_writer=dcp.FileSystemWriter(os.environ["TEST_CKPT"], per_thread_copy_ahead=0),
                       process_group=gloo).result()
    else:  # the default writer overlaps the copies on a torch.tpu stream (torch.tpu.current_stream, stream(s))
        dcp.save(state, checkpoint_id=os.environ["TEST_CKPT"])
    if rank == 0:
        torch.save((expected, devices), os.environ["TEST_CKPT"] + ".expected.pt")
    dist.barrier()
    # the saved values are still there and unchanged in this process
    _assert_equal_to_saved(state, dev)
    dist.destroy_process_group()
    print(f"rank {rank}: dcp save ok", flush=True)


def _scenario_load_single() -> None:
    """One process, no process group: a plain (unsharded) tpu model and optimizer read the sharded checkpoint."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    assert not dist.is_initialized()
    dev = torch.device("tpu", 0)
    model = _model(5).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, "extra": {"table": torch.zeros(ROWS, 3, device=dev)}}
    dcp.load(state, checkpoint_id=os.environ["TEST_CKPT"])
    _assert_equal_to_saved(state, dev)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    _assert_equal_to_saved({"model": model.state_dict(), "optim": get_state_dict(model, opt)[1],
                            "extra": state["extra"]}, dev)
    print("rank 0: dcp load single ok", flush=True)


def _scenario_load_sharded() -> None:
    """2 ranks: a fresh tensor-parallel model (other seed) reads the checkpoint into its shards (resharded when an
    FSDP2 model wrote it)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    rank, n, dev = _init()
    mesh = init_device_mesh("tpu", (n,))
    model = _parallelize(_model(5).to(dev), mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    msd, osd = get_state_dict(model, opt)
    table = distribute_tensor(torch.zeros(ROWS, 3, device=dev), mesh, [Shard(0)])
    state = {"model": msd, "optim": osd, "extra": {"table": table}}
    dcp.load(state, checkpoint_id=os.environ["TEST_CKPT"])
    _assert_equal_to_saved(state, dev)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    msd, osd = get_state_dict(model, opt)
    _assert_equal_to_saved({"model": msd, "optim": osd, "extra": state["extra"]}, dev)
    dist.destroy_process_group()
    print(f"rank {rank}: dcp load sharded ok", flush=True)


if __name__ != "__main__":
    import pytest
    import torch

    from test_distributed import _expect_ok, _launch

    def test_dcp_save_then_load_on_one_and_two_ranks(tmp_path: Path) -> None:
        env = {"TEST_CKPT": str(tmp_path / "ckpt"), "TEST_WRITER": "serial", "TEST_SHARDING": "tp"}
        _expect_ok(_launch(2, "save", 180, tmp_path, env, script=HERE), "dcp save ok")
        _expect_ok(_launch(1, "load_single", 120, tmp_path, env, script=HERE), "dcp load single ok")
        _expect_ok(_launch(2, "load_sharded", 180, tmp_path, env, script=HERE), "dcp load sharded ok")

    def test_dcp_async_save_then_load_on_two_ranks(tmp_path: Path) -> None:
        env = {"TEST_CKPT": str(tmp_path / "ckpt"), "TEST_WRITER": "async", "TEST_SHARDING": "tp"}
        _expect_ok(_launch(2, "save", 180, tmp_path, env, script=HERE), "dcp save ok")
        _expect_ok(_launch(2, "load_sharded", 180, tmp_path, env, script=HERE), "dcp load sharded ok")

    STREAMS = pytest.mark.xfail(not hasattr(torch.tpu, "current_stream"), strict=True,
                                reason="needs torch.tpu streams (issue 14 item 1): dcp's default FileSystemWriter "
                                "stages host copies on one, FSDP2 orders its all-gathers with them")

    @STREAMS
    def test_dcp_default_writer(tmp_path: Path) -> None:
        env = {"TEST_CKPT": str(tmp_path / "ckpt"), "TEST_WRITER": "default", "TEST_SHARDING": "tp"}
        _expect_ok(_launch(2, "save", 180, tmp_path, env, script=HERE), "dcp save ok")
        _expect_ok(_launch(1, "load_single", 120, tmp_path, env, script=HERE), "dcp load single ok")

    @STREAMS
    def test_dcp_fsdp2_checkpoint_loads_unsharded_and_as_tp(tmp_path: Path) -> None:
        env = {"TEST_CKPT": str(tmp_path / "ckpt"), "TEST_WRITER": "default", "TEST_SHARDING": "fsdp2"}
        _expect_ok(_launch(2, "save", 180, tmp_path, env, script=HERE), "dcp save ok")
        _expect_ok(_launch(1, "load_single", 120, tmp_path, env, script=HERE), "dcp load single ok")
        _expect_ok(_launch(2, "load_sharded", 180, tmp_path, env, script=HERE), "dcp load sharded ok")

if __name__ == "__main__":
    globals()[f"_scenario_{sys.argv[1]}"]()
