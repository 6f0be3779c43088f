"""torch_tpu benchmarks. Each figure is a ratio of two things run side by side in this one process
(interleaved trials, median), so machine speed cancels out. Nothing here asserts a time.

    tools/bench                 # all benchmarks
    tools/bench eager_overhead  # one of them
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Callable

import torch


def per_call_us(fn: Callable[[], object], calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def side_by_side(fns: dict[str, Callable[[], object]], calls: int = 5000, trials: int = 7,
                 sync: Callable[[], None] | None = None) -> dict[str, float]:
    """Median microseconds per call of each function, measured in interleaved trials."""
    for fn in fns.values():  # warm-up: compile, fill caches
        per_call_us(fn, 200)
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(trials):
        for name, fn in fns.items():
            samples[name].append(per_call_us(fn, calls))
            if sync:
                sync()
    return {k: statistics.median(v) for k, v in samples.items()}


def bench_eager_overhead() -> None:
    """Eager dispatch overhead of `x + y` on 2x2 tpu tensors vs a bare cached jax.jit call (target < 2x)."""
    import jax
    import jax.numpy as jnp

    x = torch.randn(2, 2, device="tpu")
    y = torch.randn(2, 2, device="tpu")
    a = jnp.asarray(x.cpu().numpy())
    b = jnp.asarray(y.cpu().numpy())
    add = jax.jit(lambda p, q: p + q)
    xc, yc = x.cpu(), y.cpu()
    r = side_by_side({
        "tpu x + y": lambda: x + y,
        "jax.jit(a + b)": lambda: add(a, b),
        "torch cpu x + y": lambda: xc + yc,
    }, sync=torch.tpu.synchronize)
    print(f"eager_overhead  platform={torch.tpu.get_device_name()}")
    for k, v in r.items():
        print(f"  {k:<18} {v:8.2f} us/call")
    print(f"  ratio tpu eager / bare cached jax.jit : {r['tpu x + y'] / r['jax.jit(a + b)']:.2f}x  (target < 2x)")
    print(f"  ratio tpu eager / torch CPU eager     : {r['tpu x + y'] / r['torch cpu x + y']:.2f}x")


def bench_op_overhead() -> None:
    """Per-op cost, waited for, of a small elementwise op and a 256x256 matmul on tpu, against a bare cached
    jax.jit call of the same computation (also waited for) and against torch CPU eager."""
    import jax
    import jax.numpy as jnp

    cases = {
        "mul 64x64": ((64, 64), lambda p, q: p * q, lambda p, q: p * q, 2000),
        "mm 256x256": ((256, 256), lambda p, q: jnp.matmul(p, q, precision=jax.lax.Precision.HIGHEST),
                       lambda p, q: p @ q, 200),
    }
    print(f"op_overhead  platform={torch.tpu.get_device_name()}  (each call waits for its result)")
    for name, (shape, jfn, tfn, calls) in cases.items():
        xc, yc = torch.randn(*shape), torch.randn(*shape)
        x, y = xc.to("tpu"), yc.to("tpu")
        a, b = jnp.asarray(xc.numpy()), jnp.asarray(yc.numpy())
        jitted = jax.jit(jfn)

        def on_tpu() -> None:
            tfn(x, y)
            torch.tpu.synchronize()

        r = side_by_side({"tpu": on_tpu, "jit": lambda: jitted(a, b).block_until_ready(),
                          "cpu": lambda: tfn(xc, yc)}, calls=calls)
        print(f"  {name:<11} tpu {r['tpu']:8.1f} us  jax.jit {r['jit']:8.1f} us  torch cpu {r['cpu']:8.1f} us"
              f"  -> tpu/jit {r['tpu'] / r['jit']:.2f}x, tpu/cpu {r['tpu'] / r['cpu']:.2f}x")


def bench_training() -> None:
    """Training steps per second of the MLP and GPT examples on tpu (DEFER_NEVER, op by op) next to torch CPU
    eager, same model and data, measured after warm-up (compilation excluded)."""
    import importlib.util
    from pathlib import Path

    examples = Path(__file__).resolve().parent.parent / "examples"
    sys.path.insert(0, str(examples))
    print(f"training  platform={torch.tpu.get_device_name()}  (steps/s after 5 warm-up steps)")
    for name in ("mlp", "gpt"):
        spec = importlib.util.spec_from_file_location(f"example_{name}", examples / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        rates = {}
        for device in ("cpu", "tpu"):
            model, batches, loss_fn = mod.build(0)
            model = model.to(device)
            opt = mod.optimizer(model)
            x, y = (t.to(device) for t in next(batches))

            def step() -> None:
                opt.zero_grad()
                loss_fn(model(x), y).backward()
                opt.step()

            for _ in range(5):
                step()
            if device == "tpu":
                torch.tpu.synchronize()
            n = 30
            t0 = time.perf_counter()
            for _ in range(n):
                step()
            if device == "tpu":
                torch.tpu.synchronize()
            rates[device] = n / (time.perf_counter() - t0)
        print(f"  {name:<4} tpu {rates['tpu']:7.1f} steps/s  torch cpu {rates['cpu']:7.1f} steps/s"
              f"  -> tpu/cpu {rates['tpu'] / rates['cpu']:.2f}x")


ALL_REDUCE_MB = (1, 4, 16, 64)


def _all_reduce_rank() -> None:
    """One rank of bench_all_reduce (started by it with torchrun's environment variables)."""
    import os

    import torch.distributed as dist

    dist.init_process_group("tpu_dist")
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.tpu.set_device(int(os.environ["LOCAL_RANK"]))
    gloo = dist.new_group(backend="gloo")
    os.environ["TORCH_TPU_DIST_CHECKS"] = "0"  # read when a group is made: a second tpu group without them
    unchecked = dist.new_group(backend="tpu_dist")
    if rank == 0:
        print(f"all_reduce  {n} ranks, float32 sum, platform={torch.tpu.get_device_name()}  "
              "(bus bandwidth = 2(n-1)/n x bytes / time, median of interleaved trials)")
    for mb in ALL_REDUCE_MB:
        numel = mb * 2**20 // 4
        t_tpu = torch.ones(numel, device="tpu")
        t_cpu = torch.ones(numel)

        def on_tpu() -> None:
            dist.all_reduce(t_tpu)
            torch.tpu.synchronize()

        def on_tpu_unchecked() -> None:
            dist.all_reduce(t_tpu, group=unchecked)
            torch.tpu.synchronize()

        def on_gloo() -> None:
            dist.all_reduce(t_cpu, group=gloo)

        calls = max(2, 64 // mb)
        fns = {"tpu_dist": on_tpu, "unchecked": on_tpu_unchecked, "gloo": on_gloo}
        samples: dict[str, list[float]] = {k: [] for k in fns}
        for fn in fns.values():  # warm-up: compile, connect
            fn()
        for _ in range(5):
            for name, fn in fns.items():
                dist.barrier(group=gloo)
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                samples[name].append((time.perf_counter() - t0) / calls)
        if rank == 0:
            med = {k: statistics.median(v) for k, v in samples.items()}
            bus = {k: 2 * (n - 1) / n * numel * 4 / v / 1e9 for k, v in med.items()}
            print(f"  {mb:3d} MB  tpu_dist {med['tpu_dist'] * 1e3:7.2f} ms {bus['tpu_dist']:5.2f} GB/s  "
                  f"(checks off {bus['unchecked']:5.2f} GB/s)  "
                  f"gloo on cpu tensors {med['gloo'] * 1e3:7.2f} ms {bus['gloo']:5.2f} GB/s  "
                  f"-> tpu_dist/gloo {bus['tpu_dist'] / bus['gloo']:.2f}x", flush=True)
    dist.destroy_process_group()


def bench_all_reduce(ranks: int = 2) -> None:
    """all_reduce bus bandwidth of tpu_dist on tpu tensors next to torch's gloo backend on CPU tensors, in the
    same processes (2 ranks started like torchrun, 1-64 MB float32)."""
    import os
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for r in range(ranks):
        env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(ranks), LOCAL_WORLD_SIZE=str(ranks),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TF_CPP_MIN_LOG_LEVEL="2")
        out = None if r == 0 else subprocess.DEVNULL
        procs.append(subprocess.Popen([sys.executable, __file__, "--all-reduce-rank"], env=env, stdout=out,
                                      stderr=subprocess.DEVNULL, cwd="/"))
    for p in procs:
        try:
            p.wait(timeout=600)
        except subprocess.TimeoutExpired:
            p.kill()
            print("  all_reduce: a rank did not finish within 600 s")


BENCHMARKS = {"eager_overhead": bench_eager_overhead, "op_overhead": bench_op_overhead, "training": bench_training,
              "all_reduce": bench_all_reduce}


def main(argv: list[str]) -> int:
    if argv == ["--all-reduce-rank"]:
        _all_reduce_rank()
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", help=f"benchmarks to run (default: all of {', '.join(BENCHMARKS)})")
    args = ap.parse_args(argv)
    unknown = [n for n in args.names if n not in BENCHMARKS]
    if unknown:
        ap.error(f"unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(BENCHMARKS)}")
    for name in args.names or BENCHMARKS:
        BENCHMARKS[name]()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
