"""The tpu_dist torch.distributed backend, multi-process on XLA:CPU: every collective against the expected values
(float32, bfloat16, int64) on 2 and 4 ranks, subgroups, Work objects, functional collectives, DeviceMesh and
DTensor, DDP training of the MLP example against single-process CPU training, a restart in the same process
from an explicit store, and faults (a killed rank, a hung rank, mismatched shapes).

Ranks are started the way torchrun starts them (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT), each as `python tests/test_distributed.py <scenario>` with a timeout, so a hang fails the test.
This file is both the pytest module and the per-rank worker (the `_scenario_*` functions).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

HERE = Path(__file__).resolve()

# ======================================================================================================
# Worker side: runs in each rank's process (python tests/test_distributed.py <scenario>).
# ======================================================================================================

DTYPES = ("float32", "bfloat16", "int64")


def _init(timeout_s: float = 60.0):
    import torch
    import torch.distributed as dist

    local = int(os.environ["LOCAL_RANK"])
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # under torchrun: the CUDA idiom's order
        torch.tpu.set_device(local)
        dist.init_process_group("tpu_dist", timeout=timedelta(seconds=timeout_s), device_id=torch.device("tpu", local))
    else:
        dist.init_process_group("tpu_dist", timeout=timedelta(seconds=timeout_s))
        torch.tpu.set_device(local)
    return dist.get_rank(), dist.get_world_size(), torch.device("tpu", local)


def _close(actual, expected, dtype) -> None:
    import torch

    actual = actual.cpu()
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    tol = {torch.bfloat16: 2e-2, torch.float32: 1e-6}.get(dtype, 0)
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol)


def _check_collectives(group, ranks: list[int], me: int, dev, dtype_name: str) -> None:
    """Every collective of `group` (global ranks `ranks`, this rank is `me` in it) against values computed on CPU."""
    import torch
    import torch.distributed as dist

    dtype = getattr(torch, dtype_name)
    n = len(ranks)
    is_float = dtype.is_floating_point

    def base(r: int, shape=(2, 3)):  # small integers: exact in bfloat16 sums
        return (torch.arange(int(torch.tensor(shape).prod())).reshape(shape) % 5 + r + 1).to(dtype)

    xs = [base(r) for r in range(n)]
    stack = torch.stack([x.float() for x in xs])
    expect = {
        dist.ReduceOp.SUM: stack.sum(0), dist.ReduceOp.MIN: stack.min(0).values, dist.ReduceOp.MAX: stack.max(0).values,
        dist.ReduceOp.PRODUCT: stack.prod(0),
    }
    if is_float:
        expect[dist.ReduceOp.AVG] = stack.mean(0)
    for op, want in expect.items():
        t = base(me).to(dev)
        dist.all_reduce(t, op=op, group=group)
        _close(t, want.to(dtype), dtype)
    # all_reduce on a non-contiguous view writes through the view
    big = torch.zeros(3, 4, dtype=dtype, device=dev)
    view = big[:, 1:3]
    view.copy_(base(me, (3, 2)).to(dev))
    dist.all_reduce(view, group=group)
    want = torch.zeros(3, 4, dtype=dtype)
    want[:, 1:3] = sum(base(r, (3, 2)).float() for r in range(n)).to(dtype)
    _close(big, want, dtype)

    # broadcast, reduce
    root = n - 1
    t = base(me).to(dev)
    dist.broadcast(t, src=ranks[root], group=group)
    _close(t, xs[root], dtype)
    t = base(me).to(dev)
    dist.reduce(t, dst=ranks[0], group=group, op=dist.ReduceOp.SUM)
    _close(t, expect[dist.ReduceOp.SUM].to(dtype) if me == 0 else xs[me], dtype)

    # all_gather (list and into one tensor), gather
    outs = [torch.empty(2, 3, dtype=dtype, device=dev) for _ in range(n)]
    dist.all_gather(outs, base(me).to(dev), group=group)
    for r in range(n):
        _close(outs[r], xs[r], dtype)
    out = torch.empty(2 * n, 3, dtype=dtype, device=dev)
    dist.all_gather_into_tensor(out, base(me).to(dev), group=group)
    _close(out, torch.cat(xs), dtype)
    gl = [torch.empty(2, 3, dtype=dtype, device=dev) for _ in range(n)] if me == 0 else None
    dist.gather(base(me).to(dev), gl, dst=ranks[0], group=group)
    if me == 0:
        for r in range(n):
            _close(gl[r], xs[r], dtype)

    # reduce_scatter (list and tensor), scatter
    chunks = [[(base(r) + j).to(dtype) for j in range(n)] for r in range(n)]  # rank r's chunk for rank j
    out = torch.empty(2, 3, dtype=dtype, device=dev)
    dist.reduce_scatter(out, [c.to(dev) for c in chunks[me]], group=group)
    _close(out, sum(chunks[r][me].float() for r in range(n)).to(dtype), dtype)
    inp = torch.cat(chunks[me]).to(dev)
    out = torch.empty(2, 3, dtype=dtype, device=dev)
    dist.reduce_scatter_tensor(out, inp, group=group, op=dist.ReduceOp.MAX)
    _close(out, torch.stack([chunks[r][me] for r in range(n)]).float().max(0).values.to(dtype), dtype)
    out = torch.zeros(2, 3, dtype=dtype, device=dev)
    dist.scatter(out, [c.to(dev) for c in chunks[0]] if me == 0 else None, src=ranks[0], group=group)
    _close(out, chunks[0][me], dtype)

    # all_to_all_single: even and uneven splits; all_to_all on lists of different sizes
    def rows(r: int, j: int, k: int):  # what rank r sends to rank j: k rows of 3
        return (torch.arange(k * 3).reshape(k, 3) % 7 + 10 * r + j).to(dtype)

    inp = torch.cat([rows(me, j, 2) for j in range(n)]).to(dev)
    out = torch.empty(2 * n, 3, dtype=dtype, device=dev)
    dist.all_to_all_single(out, inp, group=group)
    _close(out, torch.cat([rows(r, me, 2) for r in range(n)]), dtype)

    def split(r: int, j: int) -> int:
        return (r + 2 * j) % 3  # includes empty chunks

    ins = [split(me, j) for j in range(n)]
    outs_sz = [split(r, me) for r in range(n)]
    inp = torch.cat([rows(me, j, ins[j]) for j in range(n)]).to(dev)
    out = torch.empty(sum(outs_sz), 3, dtype=dtype, device=dev)
    dist.all_to_all_single(out, inp, output_split_sizes=outs_sz, input_split_sizes=ins, group=group)
    _close(out, torch.cat([rows(r, me, outs_sz[r]) for r in range(n)]), dtype)
    in_list = [rows(me, j, split(me, j) + 1).to(dev) for j in range(n)]
    out_list = [torch.empty(split(r, me) + 1, 3, dtype=dtype, device=dev) for r in range(n)]
    dist.all_to_all(out_list, in_list, group=group)
    for r in range(n):
        _close(out_list[r], rows(r, me, split(r, me) + 1), dtype)

    # send/recv around the ring, in matching order
    if n > 1:
        nxt, prv = ranks[(me + 1) % n], ranks[(me - 1) % n]
        got = torch.zeros(2, 3, dtype=dtype, device=dev)
        if me % 2 == 0:
            dist.send(base(me).to(dev), nxt, group=group)
            dist.recv(got, prv, group=group)
        else:
            dist.recv(got, prv, group=group)
            dist.send(base(me).to(dev), nxt, group=group)
        _close(got, xs[(me - 1) % n], dtype)

    # async_op returns a real Work; its future carries the result
    t = base(me).to(dev)
    work = dist.all_reduce(t, group=group, async_op=True)
    assert isinstance(work, dist.Work), type(work)
    fut = work.get_future()
    assert work.wait() is True
    assert work.is_completed()
    _close(fut.wait()[0], expect[dist.ReduceOp.SUM].to(dtype), dtype)
    _close(t, expect[dist.ReduceOp.SUM].to(dtype), dtype)
    dist.barrier(group=group)


def _check_functional_and_dtensor(rank: int, n: int, dev) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as fc
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    world = dist.group.WORLD
    x = torch.arange(4.0, device=dev) + rank
    torch.testing.assert_close(fc.all_reduce(x, "sum", world).cpu(), sum(torch.arange(4.0) + r for r in range(n)))
    gathered = fc.all_gather_tensor(x, 0, world)
    torch.testing.assert_close(gathered.cpu(), torch.cat([torch.arange(4.0) + r for r in range(n)]))
    rs = fc.reduce_scatter_tensor(torch.arange(2.0 * n, device=dev), "sum", 0, world)
    torch.testing.assert_close(rs.cpu(), (torch.arange(2.0 * n) * n)[2 * rank:2 * rank + 2])
    a2a = fc.all_to_all_single(torch.full((n,), float(rank), device=dev), None, None, world)
    torch.testing.assert_close(a2a.cpu(), torch.arange(float(n)))

    mesh = init_device_mesh("tpu", (n,))
    assert mesh.device_type == "tpu"
    torch.manual_seed(0)
    full = torch.randn(4 * n, 6)
    w = torch.randn(6, 5)
    dx = distribute_tensor(full.to(dev), mesh, [Shard(0)])
    torch.testing.assert_close(dx.to_local().cpu(), full[4 * rank:4 * rank + 4])
    torch.testing.assert_close(dx.full_tensor().cpu(), full)
    dw = distribute_tensor(w.to(dev), mesh, [Replicate()])
    y = (dx @ dw).relu() + 1
    assert y.placements == (Shard(0),), y.placements
    torch.testing.assert_close(y.full_tensor().cpu(), (full @ w).relu() + 1, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx.redistribute(mesh, [Replicate()]).to_local().cpu(), full)
    torch.testing.assert_close(dx.sum().full_tensor().cpu(), full.sum(), rtol=1e-5, atol=1e-4)
    if n % 2 == 0 and n > 2:  # a 2-D mesh: its dimensions are subgroups
        mesh2 = init_device_mesh("tpu", (2, n // 2), mesh_dim_names=("dp", "tp"))
        d2 = distribute_tensor(full.to(dev), mesh2, [Shard(0), Shard(1)])
        assert tuple(d2.to_local().shape) == (2 * n, 6 // (n // 2)), d2.to_local().shape
        torch.testing.assert_close(d2.full_tensor().cpu(), full)
        torch.testing.assert_close((d2 * 2).sum().full_tensor().cpu(), full.sum() * 2, rtol=1e-5, atol=1e-4)


def _check_errors(rank: int, n: int, dev) -> None:
    import torch
    import torch.distributed as dist

    # mismatched shapes and dtypes across ranks: a clear error on every rank, and the group stays usable
    bad_dtype = torch.float32 if rank else torch.int64
    for bad in (torch.ones(rank + 1, device=dev), torch.ones(2, device=dev, dtype=bad_dtype)):
        try:
            dist.all_reduce(bad)
        except RuntimeError as e:
            msg = str(e)
            assert "mismatched" in msg and "all_reduce" in msg and "rank 1:" in msg, msg
        else:
            raise AssertionError("a mismatched all_reduce did not raise")
    # different collectives on different ranks
    try:
        if rank == 0:
            dist.all_reduce(torch.ones(2, device=dev))
        else:
            dist.broadcast(torch.ones(2, device=dev), src=0)
    except RuntimeError as e:
        assert "mismatched" in str(e), e
    else:
        raise AssertionError("all_reduce against broadcast did not raise")
    try:
        dist.all_reduce(torch.ones(2))
    except RuntimeError as e:
        assert "cpu tensor" in str(e) and "tpu_dist" in str(e), e
    else:
        raise AssertionError("a CPU tensor was accepted")
    t = torch.ones(3, device=dev)
    dist.all_reduce(t)
    assert t.cpu().tolist() == [float(n)] * 3


def _scenario_collectives() -> None:
    import torch
    import torch.distributed as dist

    rank, n, dev = _init()
    assert dist.get_backend() == "tpu_dist"
    for dtype in DTYPES:
        _check_collectives(None, list(range(n)), rank, dev, dtype)
    if n >= 4:  # subgroups: even and odd ranks; every rank creates both, as c10d requires
        evens, odds = dist.new_group([0, 2]), dist.new_group([1, 3])
        mine = [0, 2] if rank % 2 == 0 else [1, 3]
        for dtype in ("float32", "int64"):
            _check_collectives(evens if rank % 2 == 0 else odds, mine, mine.index(rank), dev, dtype)
        t = torch.full((2,), float(rank), device=dev)
        dist.all_reduce(t, group=evens if rank % 2 == 0 else odds)
        assert t.cpu().tolist() == [float(sum(mine))] * 2
    # batch_isend_irecv around the ring, every rank listing its send first (on 2 ranks both sides send at once)
    got = torch.zeros(2, device=dev)
    ops = [dist.P2POp(dist.isend, torch.full((2,), float(rank), device=dev), (rank + 1) % n),
           dist.P2POp(dist.irecv, got, (rank - 1) % n)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    assert got.cpu().tolist() == [float((rank - 1) % n)] * 2
    # both sides send first, then receive (different shapes each way)
    if n >= 2 and rank < 2:
        peer = 1 - rank
        mine = torch.arange(3.0 + rank, device=dev)
        back = torch.zeros(3 + peer, device=dev)
        ws = dist.isend(mine, peer)
        dist.recv(back, peer)
        ws.wait()
        assert back.cpu().tolist() == list(range(3 + peer)), back
    objs = [None] * n
    dist.all_gather_object(objs, {"rank": rank})
    assert objs == [{"rank": r} for r in range(n)], objs
    box = [f"from {rank}"]
    dist.broadcast_object_list(box, src=n - 1)
    assert box == [f"from {n - 1}"], box
    _check_functional_and_dtensor(rank, n, dev)
    _check_errors(rank, n, dev)
    # destroy, then a new group over the same world in this process, from an explicit store
    dist.destroy_process_group()
    store = dist.FileStore(os.environ["TEST_STORE"], n)
    dist.init_process_group("tpu", store=store, rank=rank, world_size=n)
    t = torch.full((3,), float(rank + 1), device=dev)
    dist.all_reduce(t)
    assert t.cpu().tolist() == [float(n * (n + 1) // 2)] * 3
    dist.destroy_process_group()
    print(f"rank {rank}: collectives ok", flush=True)


def _check_reduce_ops(rank: int, n: int, dev) -> None:
    """Every ReduceOp (PREMUL_SUM with a Python float and with a per-rank tensor factor) in every collective that
    takes one on float32 and int64 (all_reduce and reduce_scatter_tensor also on bfloat16 and bool), against
    values reduced on CPU; complex; the functional collectives; then the dtype errors."""
    import functools

    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as fc

    R = dist.ReduceOp

    def val(r: int, dtype, shape):  # exact in bfloat16, products included
        g = torch.Generator().manual_seed(1000 * r + shape[0])
        if dtype == torch.bool:
            return torch.randint(0, 2, shape, generator=g).bool()
        if dtype.is_floating_point or dtype.is_complex:
            return (torch.randint(-3, 4, shape, generator=g).to(torch.float32) / 2).to(dtype)
        return torch.randint(-7, 8, shape, generator=g).to(dtype)

    def factor(r: int, kind: str):  # PREMUL_SUM: the op (built on rank r) and rank r's factor
        if kind == "scalar":
            return dist._make_nccl_premul_sum(1.0 / 3.0), 1.0 / 3.0
        f = 0.5 + r  # a different factor on each rank, as a one-element tpu tensor (NCCL: a device tensor)
        return dist._make_nccl_premul_sum(torch.tensor([f], device=dev)), f

    def oracle(name: str, xs: list, dtype):
        if name.startswith("premul"):
            kind = name.split(":")[1]
            return sum(x.double() * factor(r, kind)[1] for r, x in enumerate(xs)).to(dtype)
        s = torch.stack(xs)
        if dtype == torch.bool and name in ("sum", "product"):
            return s.any(0) if name == "sum" else s.all(0)
        if name in ("band", "bor", "bxor"):
            fn = {"band": torch.bitwise_and, "bor": torch.bitwise_or, "bxor": torch.bitwise_xor}[name]
            return functools.reduce(fn, xs)
        if name in ("min", "max"):
            return getattr(s, name)(0).values
        wide = s if dtype in (torch.int64, torch.bool) else s.double()
        return {"sum": wide.sum(0), "avg": wide.mean(0) if name == "avg" else None,
                "product": wide.prod(0)}[name].to(dtype)

    def op_of(name: str):
        if name.startswith("premul"):
            return factor(rank, name.split(":")[1])[0]
        return getattr(R, name.upper())

    float_ops = ["sum", "avg", "product", "min", "max", "premul:scalar", "premul:tensor"]
    int_ops = ["sum", "product", "min", "max", "band", "bor", "bxor"]
    cases = [(torch.float32, float_ops), (torch.bfloat16, float_ops), (torch.int64, int_ops),
             (torch.bool, int_ops)]
    t0 = time.monotonic()
    for dtype, names in cases:
        for name in names:
            what = f"{name} {dtype}"
            xs = [val(r, dtype, (2 * n, 3)) for r in range(n)]
            ys = [val(r, dtype, (5,)) for r in range(n)]
            full, full_y = oracle(name, xs, dtype), oracle(name, ys, dtype)
            # all_reduce, all_reduce_coalesced
            t = xs[rank].to(dev)
            dist.all_reduce(t, op=op_of(name))
            _close(t, full, dtype)
            mine = slice(2 * rank, 2 * rank + 2)
            out = torch.empty(2, 3, dtype=dtype, device=dev)
            dist.reduce_scatter_tensor(out, xs[rank].to(dev), op=op_of(name))
            _close(out, full[mine], dtype)
            if dtype in (torch.bfloat16, torch.bool):  # the rest shares these two's programs with another dtype
                continue
            ts = [xs[rank].to(dev), ys[rank].to(dev)]
            dist.all_reduce_coalesced(ts, op=op_of(name))
            _close(ts[0], full, dtype)
            _close(ts[1], full_y, dtype)
            # reduce: the root gets the reduction, the others keep their input
            t = ys[rank].to(dev)
            dist.reduce(t, dst=n - 1, op=op_of(name))
            _close(t, full_y if rank == n - 1 else ys[rank], dtype)
            # reduce_scatter (list) and coalesced reduce_scatter_tensor
            out = torch.empty(2, 3, dtype=dtype, device=dev)
            dist.reduce_scatter(out, list(xs[rank].to(dev).chunk(n)), op=op_of(name))
            _close(out, full[mine], dtype)
            zs = [val(r, dtype, (4 * n,)) for r in range(n)]
            outs = [torch.empty(2, 3, dtype=dtype, device=dev), torch.empty(4, dtype=dtype, device=dev)]
            with dist._coalescing_manager():
                dist.reduce_scatter_tensor(outs[0], xs[rank].to(dev), op=op_of(name))
                dist.reduce_scatter_tensor(outs[1], zs[rank].to(dev), op=op_of(name))
            _close(outs[0], full[mine], dtype)
            _close(outs[1], oracle(name, zs, dtype)[4 * rank:4 * rank + 4], dtype)
        print(f"rank {rank}: reduce ops on {dtype} ok ({time.monotonic() - t0:.1f} s)", flush=True)

    # complex: c10d views all_reduce's complex tensors as real; reduce_scatter_tensor reaches tpu_dist as complex
    cs = [val(r, torch.complex64, (2 * n,)) * (1 + 2j) for r in range(n)]
    t = cs[rank].to(dev)
    dist.all_reduce(t, op=R.AVG)
    _close(t, torch.stack(cs).mean(0), torch.float32)
    out = torch.empty(2, dtype=torch.complex64, device=dev)
    dist.reduce_scatter_tensor(out, cs[rank].to(dev), op=dist._make_nccl_premul_sum(0.25))
    _close(out, (sum(cs) * 0.25)[2 * rank:2 * rank + 2], torch.float32)

    # the functional collectives (DTensor's path) with the ops they name by string
    x = val(rank, torch.float32, (2 * n, 3)).to(dev)
    xs = [val(r, torch.float32, (2 * n, 3)) for r in range(n)]
    world = dist.group.WORLD
    for name in ("avg", "product", "min", "max"):
        _close(fc.all_reduce(x, name, world), oracle(name, xs, torch.float32), torch.float32)
        _close(fc.reduce_scatter_tensor(x, name, 0, world), oracle(name, xs, torch.float32)[2 * rank:2 * rank + 2],
               torch.float32)
    ints = [val(r, torch.int64, (4,)) for r in range(n)]
    got = fc.all_reduce_coalesced([ints[rank].to(dev)], "bxor", world)
    _close(got[0], oracle("bxor", ints, torch.int64), torch.int64)

    # dtype rules (raised on every rank before anything is sent, so the group stays usable)
    def raises(fn, *words) -> None:
        try:
            fn()
        except (RuntimeError, ValueError) as e:
            assert all(w in str(e) for w in words), (words, str(e))
        else:
            raise AssertionError(f"no error for {words}")

    i64, f32 = torch.ones(4, dtype=torch.int64, device=dev), torch.ones(2 * n, device=dev)
    raises(lambda: dist.all_reduce(i64, op=R.AVG), "all_reduce", "ReduceOp.AVG", "floating point", "int64[4]")
    raises(lambda: dist.all_reduce(torch.ones(4, dtype=torch.bool, device=dev), op=R.AVG), "AVG", "bool[4]")
    raises(lambda: dist.reduce_scatter_tensor(torch.empty(2, dtype=torch.int64, device=dev),
                                              torch.ones(2 * n, dtype=torch.int64, device=dev),
                                              op=dist._make_nccl_premul_sum(0.5)),
           "reduce_scatter_tensor", "PREMUL_SUM", "floating point")
    raises(lambda: dist.all_reduce(f32, op=R.BAND), "all_reduce", "BAND", "integer or bool", "float32")
    raises(lambda: dist.reduce(f32, dst=0, op=R.BXOR), "reduce", "BXOR", "integer or bool")
    raises(lambda: dist.reduce_scatter_tensor(torch.empty(2, dtype=torch.complex64, device=dev),
                                              torch.ones(2 * n, dtype=torch.complex64, device=dev), op=R.MAX),
           "reduce_scatter_tensor", "MAX", "complex")
    raises(lambda: dist.all_reduce(f32, op=dist._make_nccl_premul_sum(torch.ones(1, dtype=torch.int64, device=dev))),
           "PREMUL_SUM", "one-element floating point", "int64[1]")
    raises(lambda: fc.all_reduce(f32, "premul_sum", world), "premul_sum", "factor")
    t = torch.ones(3, device=dev)
    dist.all_reduce(t)
    assert t.cpu().tolist() == [float(n)] * 3


def _scenario_reduce_ops() -> None:
    import torch.distributed as dist

    rank, n, dev = _init()
    _check_reduce_ops(rank, n, dev)
    dist.destroy_process_group()
    print(f"rank {rank}: reduce ops ok", flush=True)


def _scenario_ddp() -> None:
    """DDP on 2 ranks, half the batch each, against single-process CPU training on the full batch."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    import torch.distributed as dist

    sys.path.insert(0, str(HERE.parent.parent / "examples"))
    import mlp

    rank, n, dev = _init()
    steps = 4
    ref, batches, loss_fn = mlp.build(0)
    model, _, _ = mlp.build(0)
    ddp = DDP(model.to(dev), device_ids=[dev.index])
    opt, ref_opt = mlp.optimizer(ddp), mlp.optimizer(ref)
    half = 64 // n
    for step in range(steps):
        x, y = next(batches)
        ref_opt.zero_grad()
        ref_loss = loss_fn(ref(x), y)
        ref_loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ref_opt.step()

        opt.zero_grad()
        xs, ys = x[rank * half:(rank + 1) * half].to(dev), y[rank * half:(rank + 1) * half].to(dev)
        loss = loss_fn(ddp(xs), ys)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
        opt.step()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss, op=dist.ReduceOp.AVG)
        torch.testing.assert_close(mean_loss.cpu(), ref_loss.detach(), rtol=1e-5, atol=1e-5)
        for (name, p), q in zip(ddp.module.named_parameters(), ref.parameters()):
            # AdamW's first steps move a weight by about lr * sign(gradient) whatever the gradient's size, and a
            # ReLU unit whose pre-activation on some sample lies within float32 rounding of 0 takes its gradient
            # or not depending on rounding: CPU's float32 (MKL, AVX-512 here) put one such unit of this batch on
            # the other side from float64 and from XLA (its weight-gradient row off by 4.7e-4 against float64,
            # XLA's by 1.3e-9), so ~18 of 262144 weights move 2 lr apart in either eager mode, and fused XLA
            # orders float32 reductions its own way too. The tensor must agree to 0.1% in norm, each element
            # within 5 learning-rate steps (and the loss, above, to 1e-5).
            diff = p.detach().cpu() - q.detach()
            assert diff.norm() <= 1e-3 * q.detach().norm() + 1e-5, (step, name, diff.norm().item())
            assert diff.abs().max() <= 5 * 1e-3, (step, name, diff.abs().max().item())
        print(f"rank {rank} step {step} loss {mean_loss.item():.6f} ref {ref_loss.item():.6f}", flush=True)
    dist.destroy_process_group()
    print(f"rank {rank}: ddp ok", flush=True)


def _scenario_kill() -> None:
    """The last rank kills itself mid-run; the others keep calling all_reduce and must fail, not hang."""
    import torch
    import torch.distributed as dist

    rank, n, dev = _init(timeout_s=float(os.environ.get("TEST_PG_TIMEOUT", "20")))
    t = torch.ones(1024, device=dev)
    victim = int(os.environ.get("TEST_VICTIM", n - 1))
    for step in range(1000):
        if rank == victim and step == 3:
            if os.environ.get("TEST_FAULT") == "hang":
                time.sleep(600)
            os.kill(os.getpid(), signal.SIGKILL)
        dist.all_reduce(t)
        t.fill_(1.0)
    raise AssertionError("the survivors finished 1000 all_reduces without the dead rank")


def _scenario_order() -> None:
    """The start-up orders a user may write under torchrun (TEST_ORDER), then one all_reduce."""
    import torch
    import torch.distributed as dist

    local, order = int(os.environ["LOCAL_RANK"]), os.environ["TEST_ORDER"]
    timeout = timedelta(seconds=60)
    dev = torch.device("tpu", local)
    if order == "set_device first":  # the user guide's order (rank 0's set_device(0) does not start the runtime)
        torch.tpu.set_device(local)
        dist.init_process_group("tpu_dist", timeout=timeout)
    elif order == "init first":
        dist.init_process_group("tpu_dist", timeout=timeout)
        torch.tpu.set_device(local)
    elif order == "device_id":
        dist.init_process_group("tpu_dist", timeout=timeout, device_id=dev)
    else:  # no set_device at all: tensors name their device
        dist.init_process_group("tpu_dist", timeout=timeout)
    rank, n = dist.get_rank(), dist.get_world_size()
    t = torch.full((3,), float(rank + 1), device=dev)
    dist.all_reduce(t)
    assert t.cpu().tolist() == [float(n * (n + 1) // 2)] * 3, t
    dist.destroy_process_group()
    print(f"rank {rank}: order ok", flush=True)


def _scenario_startup_fault() -> None:
    """A start-up that cannot complete (TEST_FAULT) must be a Python error within the timeout, not an abort."""
    import torch.distributed as dist

    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    fault = os.environ["TEST_FAULT"]
    timeout = timedelta(seconds=10)
    try:
        if fault == "absent":  # the last rank never calls init_process_group
            if rank == n - 1:
                print(f"rank {rank}: leaves without init", flush=True)
                return
            dist.init_process_group("tpu_dist", timeout=timeout)
        else:  # "split stores": each rank rendezvouses on its own store, so none ever sees the others
            store = dist.FileStore(f"{os.environ['TEST_STORE']}.{rank}", n)
            dist.init_process_group("tpu_dist", store=store, rank=rank, world_size=n, timeout=timeout)
    except Exception as e:  # noqa: BLE001 - the point: a Python exception reaches the script
        print(f"rank {rank}: start-up error {type(e).__name__}: {e}", flush=True)
        return
    raise AssertionError("init_process_group completed without the other ranks")


def _worker_main(scenario: str) -> None:
    globals()[f"_scenario_{scenario}"]()


# ======================================================================================================
# pytest side: starts the ranks.
# ======================================================================================================

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch(n: int, scenario: str, timeout: float, tmp_path: Path, env: dict[str, str] | None = None,
            script: Path = HERE) -> list[tuple[int | None, str]]:
    """Starts n ranks like torchrun, each `python <script> <scenario>` (another test file can pass its own
    script); returns (exit code or None if killed at the timeout, output) per rank."""
    port = _free_port()
    procs = []
    for r in range(n):
        e = dict(os.environ)
        for k in ("TORCH_TPU_NUM_DEVICES", "TORCH_TPU_PLATFORM", "TORCH_TPU_CPU_FALLBACK", "TORCH_TPU_EAGER_MODE"):
            e.pop(k, None)
        e.update(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1",
                 MASTER_PORT=str(port), TEST_STORE=str(tmp_path / "filestore"), PYTHONUNBUFFERED="1")
        e.update(env or {})
        log = open(tmp_path / f"rank{r}.log", "w")
        procs.append((subprocess.Popen([sys.executable, str(script), scenario], stdout=log, stderr=subprocess.STDOUT,
                                       env=e, cwd="/", start_new_session=True), log))
    deadline = time.monotonic() + timeout
    results = []
    for r, (p, log) in enumerate(procs):
        try:
            rc = p.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            rc = None
        log.close()
        results.append((rc, (tmp_path / f"rank{r}.log").read_text()))
    return results


def _torchrun(n: int, scenario: str, timeout: float, tmp_path: Path, env: dict[str, str] | None = None
              ) -> list[tuple[int | None, str]]:
    """Starts n ranks with torchrun itself (its agent hosts the store); one combined log for all ranks."""
    e = dict(os.environ, TEST_STORE=str(tmp_path / "filestore"), PYTHONUNBUFFERED="1", **(env or {}))
    for k in ("TORCH_TPU_NUM_DEVICES", "TORCH_TPU_PLATFORM", "TORCH_TPU_CPU_FALLBACK", "TORCH_TPU_EAGER_MODE"):
        e.pop(k, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={n}", f"--master-port={_free_port()}",
           str(HERE), scenario]
    with open(tmp_path / "torchrun.log", "w") as log:
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=e, cwd="/", start_new_session=True)
        try:
            rc = p.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            rc = None
    out = (tmp_path / "torchrun.log").read_text()
    return [(rc, out)] * n


def _report(results: list[tuple[int | None, str]]) -> str:
    return "\n".join(f"--- rank {r} exit {rc} ---\n{out[-3000:]}" for r, (rc, out) in enumerate(results))


def _expect_ok(results: list[tuple[int | None, str]], marker: str) -> None:
    for r, (rc, out) in enumerate(results):
        assert rc == 0 and f"rank {r}: {marker}" in out, _report(results)


if __name__ != "__main__":
    import pytest

    from conftest import run_python

    FUSED = {"TORCH_TPU_EAGER_MODE": "DEFER_AND_FUSE"}

    # Four ranks (four processes on a 2-core machine: about a minute) run with the extended tests.
    @pytest.mark.parametrize("n, launcher", [(2, "torchrun"), pytest.param(4, "env", marks=pytest.mark.extended),
                                             (2, "env-fused")])
    def test_collectives(n: int, launcher: str, tmp_path: Path) -> None:
        """Also under DEFER_AND_FUSE: pending work runs before each collective, results feed later graphs."""
        if launcher == "torchrun":
            results = _torchrun(n, "collectives", 240, tmp_path)
        else:
            results = _launch(n, "collectives", 240, tmp_path, FUSED if launcher == "env-fused" else None)
        _expect_ok(results, "collectives ok")

    def test_every_reduce_op(tmp_path: Path) -> None:
        """SUM, AVG, PRODUCT, MIN, MAX, PREMUL_SUM (float and tensor factor), BAND/BOR/BXOR in all_reduce(_coalesced),
        reduce, reduce_scatter, reduce_scatter_tensor(_coalesced) and the functional collectives; NCCL's dtype rules."""
        _expect_ok(_launch(2, "reduce_ops", 240, tmp_path), "reduce ops ok")

    # Fused collectives run by default in test_collectives[2-env-fused]; DDP fused with the extended tests.
    @pytest.mark.parametrize("mode", ["DEFER_NEVER", pytest.param("DEFER_AND_FUSE", marks=pytest.mark.extended)])
    def test_ddp_mlp_matches_single_process(mode: str, tmp_path: Path) -> None:
        _expect_ok(_launch(2, "ddp", 180, tmp_path, {"TORCH_TPU_EAGER_MODE": mode}), "ddp ok")

    @pytest.mark.parametrize("fault", ["kill", "kill rank 0", "hang"])
    def test_dead_or_hung_rank_fails_survivors(fault: str, tmp_path: Path) -> None:
        """A killed rank (also rank 0, which hosts the c10d store and JAX's coordinator) or a hung one."""
        pg_timeout = 15
        n = 3 if fault == "kill" else 2
        victim = 0 if fault == "kill rank 0" else n - 1
        fault = fault.split()[0]
        t0 = time.monotonic()
        # The hang runs without the per-collective descriptor exchange: the timeout must not depend on its host sync.
        env = {"TEST_FAULT": fault, "TEST_PG_TIMEOUT": str(pg_timeout),
               "TORCH_TPU_DIST_CHECKS": "0" if fault == "hang" else "1"}
        env["TEST_VICTIM"] = str(victim)
        results = _launch(n, "kill", 120, tmp_path, env)
        for rc, out in [res for r, res in enumerate(results) if r != victim]:
            assert rc not in (0, None), _report(results)  # failed, not hung and not finished
            assert "tpu_dist: all_reduce" in out, _report(results)
            want = "has most likely died" if fault == "kill" else "did not finish within the timeout"
            assert want in out, _report(results)
        # survivors must not wait for much more than the process-group timeout (start-up included)
        assert time.monotonic() - t0 < 100, _report(results)

    # The user guide's order by default; the other three with the extended tests.
    @pytest.mark.parametrize("order", ["set_device first"] + [pytest.param(o, marks=pytest.mark.extended)
                                                              for o in ("init first", "device_id", "no set_device")])
    def test_torchrun_start_up_orders(order: str, tmp_path: Path) -> None:
        """The user guide's order (set_device, then init_process_group without device_id=) and the others: every
        rank joins JAX's world through the same store keys whichever comes first."""
        e = {"TEST_ORDER": order}
        _expect_ok(_torchrun(2, "order", 180, tmp_path, e), "order ok")

    @pytest.mark.parametrize("fault", ["absent", pytest.param("split stores", marks=pytest.mark.extended)])
    def test_start_up_failure_is_a_python_error(fault: str, tmp_path: Path) -> None:
        """A rank that never calls init, or ranks that never meet: each waiting rank gets a Python exception within
        init_process_group's timeout and the process exits normally (JAX's client would abort it with SIGABRT)."""
        results = _launch(2, "startup_fault", 120, tmp_path, {"TEST_FAULT": fault})
        waiting = [0] if fault == "absent" else [0, 1]
        for r, (rc, out) in enumerate(results):
            assert rc == 0, _report(results)  # not -6 (SIGABRT), not killed at the harness timeout
            if r in waiting:
                assert f"rank {r}: start-up error" in out, _report(results)
        if fault == "split stores":
            assert "never came" in results[0][1], _report(results)

    def test_registered_without_importing_jax() -> None:
        r = run_python(
            "import sys, torch, torch.distributed as dist\n"
            "assert 'tpu_dist' in dist.Backend.backend_list and 'tpu' in dist.Backend.backend_list\n"
            "assert dist.Backend.default_device_backend_map['tpu'] == 'tpu_dist'\n"
            "print(sorted(m for m in sys.modules if m.startswith('jax')))"
        )
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == "[]", r.stdout

    def test_runtime_started_before_init_is_a_clear_error(tmp_path: Path) -> None:
        r = run_python(
            "import torch, torch.distributed as dist\n"
            "torch.ones(2, device='tpu')\n"
            f"store = dist.FileStore({str(tmp_path / 's')!r}, 2)\n"
            "try:\n"
            "    dist.init_process_group('tpu_dist', store=store, rank=0, world_size=2)\n"
            "except RuntimeError as e:\n"
            "    print(e)\n"
        )
        assert r.returncode == 0, r.stderr
        assert "call init_process_group first" in r.stdout, r.stdout

if __name__ == "__main__":
    _worker_main(sys.argv[1])
