"""torch_tpu benchmarks. Each figure is a ratio of two things run side by side in this one process
(interleaved trials, median), so machine speed cancels out. Nothing here asserts a time.

    tools/bench                 # all benchmarks
    tools/bench eager_overhead  # one of them
    tools/bench host            # every ratio issue 12 asks for, each with its target
    tools/bench host --rows eager,sync --quick
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any, Callable

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


def steps_per_second(steps: dict[str, Callable[[], object]], n: int, sync: Callable[[], None],
                     trials: int = 5, warm: int = 5) -> dict[str, float]:
    """Median steps per second of each training step, waited for (`sync`) after every n steps, interleaved trials
    after `warm` steps each."""
    for fn in steps.values():
        for _ in range(warm):
            fn()
    sync()
    samples: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(trials):
        for k, fn in steps.items():
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            sync()
            samples[k].append(n / (time.perf_counter() - t0))
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


def bench_ops(calls: int = 20, trials: int = 5) -> None:
    """Per-op time of common model ops on a (4, 64, 256) float32 activation: tpu (DEFER_NEVER; bursts of 10 calls, then
    torch.tpu.synchronize()) next to torch CPU eager, interleaved, sorted by the ratio. It finds the lowerings XLA runs
    slowly (XLA:CPU's exp/log power made RMSNorm's x.pow(2) 36x CPU's; a full sort for topk 55x) and shows what they
    cost now."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    hc = torch.randn(4, 64, 256, generator=g)
    pc = torch.rand(4, 64, 256, generator=g) + 0.1
    ic = torch.randint(0, 100, (4, 64, 256), generator=g)
    gc = torch.randn(4, 64, 128, generator=g)
    vc = torch.randn(4, 32000, generator=g)
    cpu = {"h": hc, "p": pc, "i": ic, "g": gc, "v": vc}
    tpu = {k: v.to("tpu") for k, v in cpu.items()}
    ops: dict[str, Callable[[dict], Any]] = {
        "x.pow(2)": lambda t: t["h"].pow(2),
        "x.pow(0.5)": lambda t: t["p"].pow(0.5),
        "x.pow(2.5)": lambda t: t["p"].pow(2.5),
        "x * x": lambda t: t["h"] * t["h"],
        "x * 0.5": lambda t: t["h"] * 0.5,
        "x / y": lambda t: t["h"] / t["p"],
        "rsqrt": lambda t: torch.rsqrt(t["p"]),
        "exp": lambda t: torch.exp(t["h"]),
        "tanh": lambda t: torch.tanh(t["h"]),
        "silu": lambda t: F.silu(t["h"]),
        "gelu": lambda t: F.gelu(t["h"]),
        "sin": lambda t: torch.sin(t["h"]),
        "clamp": lambda t: t["h"].clamp(-1, 1),
        "mean(-1)": lambda t: t["h"].mean(-1),
        "norm(dim=-1)": lambda t: t["h"].norm(dim=-1),
        "softmax": lambda t: torch.softmax(t["h"], -1),
        "layer_norm": lambda t: F.layer_norm(t["h"], (256,)),
        "rms_norm": lambda t: F.rms_norm(t["h"], (256,)),
        "cumsum": lambda t: t["h"].cumsum(-1),
        "argmax": lambda t: t["h"].argmax(-1),
        "topk(5)": lambda t: t["h"].topk(5, -1)[0],
        "topk(50) of 32000": lambda t: t["v"].topk(50, -1)[0],
        "sort": lambda t: t["h"].sort(-1)[0],
        "int x // 7": lambda t: t["i"] // 7,
        "slice_backward": lambda t: torch.ops.aten.slice_backward(t["g"], [4, 64, 256], 2, 0, 128, 1),
    }
    fns: dict[str, Callable[[], object]] = {}
    burst = 10  # ops queued back to back, then one wait: eager code does not wait after each op

    def run(op: Callable[[dict], Any], args: dict, wait: Callable[[], object]) -> None:
        for _ in range(burst):
            op(args)
        wait()

    for name, op in ops.items():
        fns[f"tpu {name}"] = lambda op=op: run(op, tpu, torch.tpu.synchronize)
        fns[f"cpu {name}"] = lambda op=op: run(op, cpu, lambda: None)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (CPU eager on one thread: steadier beside XLA's own threads, as row f's "cpu 1 thread")
    try:
        r = _interleaved(fns, calls=calls, trials=trials)
    finally:
        torch.set_num_threads(threads)
    print(f"ops  (4, 64, 256) float32, DEFER_NEVER, bursts of {burst} ops then a wait, CPU eager on 1 thread  "
          f"platform={torch.tpu.get_device_name()}")
    rows = sorted(ops, key=lambda n: r[f"tpu {n}"] / r[f"cpu {n}"], reverse=True)
    for name in rows:
        t, c = r[f"tpu {name}"] / burst, r[f"cpu {name}"] / burst
        print(f"  {name:<18} tpu {t:9.1f} us  cpu {c:9.1f} us  -> tpu/cpu {t / c:6.2f}x")


def bench_training() -> None:
    """Training steps per second of the MLP and GPT examples on tpu (DEFER_NEVER, op by op) next to torch CPU
    eager, same model and data, measured after warm-up (compilation excluded)."""
    print(f"training  platform={torch.tpu.get_device_name()}  (steps/s after 5 warm-up steps)")
    for name in ("mlp", "gpt"):
        mod = _example(name)
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


def bench_threads() -> None:
    """Two small models trained in two threads at once vs one after the other in one thread, per mode (ratio of
    wall times; about 1 means the threads cost nothing beyond sharing the host). Each thread records its own
    DEFER_AND_FUSE graph: interleaving both in one graph recompiled on every step (about 100x)."""
    import threading

    def make(seed: int, width: int) -> Callable[[], None]:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(32, width), torch.nn.ReLU(), torch.nn.Linear(width, 10))
        model = model.to("tpu")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = torch.randn(16, 32).to("tpu"), torch.randint(0, 10, (16,)).to("tpu")

        def step() -> None:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()

        return step

    print(f"threads  platform={torch.tpu.get_device_name()}  (2 models x 30 steps, torch.tpu.synchronize() per"
          " step)")
    for mode in ("DEFER_NEVER", "DEFER_AND_FUSE"):
        steps = [make(0, 64), make(1, 48)]

        def train(step: Callable[[], None], mode: str = mode, n: int = 30) -> None:
            with torch.tpu.set_eager_mode(mode):
                for _ in range(n):
                    step()
                    torch.tpu.synchronize()

        def one_thread() -> None:
            for s in steps:
                train(s)

        def two_threads() -> None:
            ts = [threading.Thread(target=train, args=(s,)) for s in steps]
            for t in ts:
                t.start()
            for t in ts:
                t.join()

        one_thread(), two_threads()  # warm-up: compile
        samples: dict[str, list[float]] = {"one": [], "two": []}
        for _ in range(5):
            samples["one"].append(per_call_us(one_thread, 1) / 1e3)
            samples["two"].append(per_call_us(two_threads, 1) / 1e3)
        one, two = statistics.median(samples["one"]), statistics.median(samples["two"])
        print(f"  {mode:<15} one thread {one:7.1f} ms  two threads {two:7.1f} ms  -> two/one {two / one:.2f}x")


def _example(name: str):
    import importlib.util
    from pathlib import Path

    examples = Path(__file__).resolve().parent.parent / "examples"
    if str(examples) not in sys.path:
        sys.path.insert(0, str(examples))
    spec = importlib.util.spec_from_file_location(f"example_{name}", examples / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # Dynamo looks compiled functions' modules up by name
    spec.loader.exec_module(mod)
    return mod


def _modes_side_by_side(fn: Callable[[], object], calls: int, trials: int = 5) -> dict[str, float]:
    """Median us per call of `fn` (which must wait for its result) under DEFER_NEVER and DEFER_AND_FUSE,
    interleaved trials."""
    modes = ("DEFER_NEVER", "DEFER_AND_FUSE")

    def in_mode(mode: str) -> Callable[[], object]:
        def run() -> object:
            with torch.tpu.set_eager_mode(mode):
                for _ in range(calls):
                    fn()
            return None
        return run

    for m in modes:  # warm-up: compile both
        with torch.tpu.set_eager_mode(m):
            for _ in range(3):
                fn()
    samples: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(trials):
        for m in modes:
            samples[m].append(per_call_us(in_mode(m), 1) / calls)
    return {m: statistics.median(v) for m, v in samples.items()}


def bench_fuse() -> None:
    """DEFER_AND_FUSE vs DEFER_NEVER, side by side: a 10-op elementwise chain on 1024x1024 (target >= 3x), an MLP
    training step (target >= 1.5x), a GPT block forward. Every timed call waits for its result."""
    print(f"fuse  platform={torch.tpu.get_device_name()}  (median of interleaved trials; each call waits)")
    x = torch.randn(1024, 1024, device="tpu")
    w = torch.randn(1024, 1024, device="tpu")

    def chain() -> None:  # 10 elementwise ops, memory-bound: what op-by-op execution is worst at
        y = x * 2.0
        y = y + w
        y = y - 0.5
        y = y * x
        y = torch.relu(y)
        y = y / 3.0
        y = y + 1.0
        y = torch.maximum(y, w)
        y = y * y
        y = y - x
        torch.tpu.synchronize()

    def chain_transcendental() -> None:  # the same length with sin/tanh/exp: compute-bound on a CPU
        y = torch.sin(x * 2.0 + 1.0)
        y = torch.tanh(y * x) - 0.5
        y = torch.relu(torch.exp(y) / 3.0) + x
        torch.tpu.synchronize()

    def report(name: str, r: dict[str, float], target: str) -> None:
        never, fuse = r["DEFER_NEVER"], r["DEFER_AND_FUSE"]
        print(f"  {name:<34} DEFER_NEVER {never / 1e3:8.2f} ms  DEFER_AND_FUSE {fuse / 1e3:8.2f} ms"
              f"  -> speed-up {never / fuse:5.2f}x {target}")

    report("10-op chain 1024x1024 (+,-,*,/,max)", _modes_side_by_side(chain, 20), "(target >= 3x)")
    report("10-op chain with sin/tanh/exp", _modes_side_by_side(chain_transcendental, 10), "")

    mod = _example("mlp")
    model, batches, loss_fn = mod.build(0)
    model = model.tpu()
    opt = mod.optimizer(model)
    bx, by = (t.tpu() for t in next(batches))

    def mlp_step() -> None:
        opt.zero_grad()
        loss = loss_fn(model(bx), by)
        loss.backward()
        opt.step()
        loss.item()

    r = _modes_side_by_side(mlp_step, 20)
    report("MLP training step", r, "(target >= 1.5x)")
    floor = _jax_floor_us("mlp")
    print(f"  {'  the same step in one jax.jit':<34} {floor / 1e3:8.2f} ms: DEFER_AND_FUSE is"
          f" {r['DEFER_AND_FUSE'] / floor:.2f}x of it, DEFER_NEVER {r['DEFER_NEVER'] / floor:.2f}x"
          " (the floor: the same XLA work with no per-op host work)")

    gpt = _example("gpt")
    torch.manual_seed(0)
    block = gpt.Block().tpu()
    h = torch.randn(16, gpt.CONTEXT, gpt.WIDTH, device="tpu")

    def block_forward() -> None:
        with torch.no_grad():
            block(h)
        torch.tpu.synchronize()

    report("GPT block forward (16x32x64)", _modes_side_by_side(block_forward, 20), "")

    gmodel, gbatches, gloss = gpt.build(0)
    gmodel = gmodel.tpu()
    gopt = gpt.optimizer(gmodel)
    gx, gy = (t.tpu() for t in next(gbatches))

    def gpt_step() -> None:
        gopt.zero_grad()
        loss = gloss(gmodel(gx), gy)
        loss.backward()
        gopt.step()
        loss.item()

    report("GPT training step", _modes_side_by_side(gpt_step, 10), "")


_FIRST_STEP = """
import sys, time
t_start = time.perf_counter()
import torch
sys.path.insert(0, {examples!r})
import mlp
torch.zeros(1, device="tpu")  # start the runtime (PJRT client)
mlp.optimizer(torch.nn.Linear(1, 1))  # torch.optim imports torch._dynamo on first use: not compilation
t0 = time.perf_counter()
model, batches, loss_fn = mlp.build(0)
model = model.tpu()
opt = mlp.optimizer(model)
x, y = (t.tpu() for t in next(batches))
opt.zero_grad()
loss = loss_fn(model(x), y)
loss.backward()
opt.step()
loss.item()
torch.tpu.synchronize()  # every op of the step done (under DEFER_AND_FUSE the update may still be running)
t1 = time.perf_counter()
s = torch.tpu.compile_cache.stats()
print(f"RESULT {{t1 - t0}} {{s.hits}} {{s.misses}} {{t0 - t_start}}")
"""


def bench_cold_start() -> None:
    """First training step (model to tpu, forward, backward, optimizer step, loss.item()) of a fresh process
    with an empty persistent compile cache vs a warm one (target: warm <= 20% of cold). Interpreter start,
    imports and the PJRT client start are the same either way and are printed apart."""
    import os
    import subprocess
    import tempfile
    from pathlib import Path

    examples = str(Path(__file__).resolve().parent.parent / "examples")
    code = _FIRST_STEP.format(examples=examples)
    print("cold_start  (fresh process per run: MLP example's first step; median of 3 runs each)")
    for mode in ("DEFER_NEVER", "DEFER_AND_FUSE"):
        cold, warm, startup = [], [], []
        hits = misses = 0
        for _ in range(3):
            with tempfile.TemporaryDirectory() as d:
                env = dict(os.environ, TORCH_TPU_CACHE_DIR=d, TORCH_TPU_EAGER_MODE=mode)
                for bucket in (cold, warm):
                    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                         check=True, cwd="/")
                    line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT")][-1].split()
                    bucket.append(float(line[1]))
                    startup.append(float(line[4]))
                    if bucket is warm:
                        hits, misses = int(line[2]), int(line[3])
        c, w = statistics.median(cold), statistics.median(warm)
        print(f"  {mode:<15} cold {c:6.2f} s  warm {w:6.2f} s  -> warm/cold {w / c:5.1%} (target <= 20%)"
              f"  [warm run: {hits} cache hits, {misses} misses; start-up before the step "
              f"{statistics.median(startup):.2f} s]")


def bench_doctor(steps: int = 8, runs: int = 3, example: str = "mlp") -> None:
    """The doctor's overhead: examples/<example>.py for `steps` steps with `python -m torch_tpu.doctor` vs the
    same script alone, each a fresh process with the same warm compile cache (runs alternate; medians). Each
    process prints its own wall time from before the script's first line to its end (interpreter start-up and
    imports excluded), so the ratio is the doctor's cost on the run itself."""
    import os
    import subprocess
    import tempfile
    from pathlib import Path

    script = str(Path(__file__).resolve().parent.parent / "examples" / f"{example}.py")
    timed = ("import runpy, sys, time, torch, torch.optim; torch.randn(1, device='tpu'); t0 = time.perf_counter()\n"
             "sys.argv = [{s!r}, '--device', 'tpu', '--steps', '{n}']; sys.path.insert(0, {d!r})\n"
             "{run}\n"
             "print('WALL', time.perf_counter() - t0)\n")
    plain = timed.format(s=script, d=os.path.dirname(script), n=steps, run="runpy.run_path(sys.argv[0], run_name='__main__')")
    doctor = timed.format(s=script, d=os.path.dirname(script), n=steps, run=(
        "from torch_tpu import doctor; doctor.run_script(sys.argv[0], sys.argv[1:], steps=None)"))
    samples: dict[str, list[float]] = {"plain": [], "doctor": []}
    with tempfile.TemporaryDirectory() as d:
        env = dict(os.environ, TORCH_TPU_CACHE_DIR=d)
        env.pop("TORCH_TPU_EAGER_MODE", None)
        for i in range(runs + 1):
            for k, code in (("plain", plain), ("doctor", doctor)):
                out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=d)
                if out.returncode:
                    raise RuntimeError(f"bench doctor: the {k} run failed:\n{out.stderr[-3000:]}")
                wall = float([ln for ln in out.stdout.splitlines() if ln.startswith("WALL")][-1].split()[1])
                if i:  # the first round fills the compile cache
                    samples[k].append(wall)
    p, dr = statistics.median(samples["plain"]), statistics.median(samples["doctor"])
    print(f"doctor  ({example}.py, {steps} steps, fresh process per run, warm compile cache, median of {runs})")
    print(f"  script alone {p:6.2f} s   under the doctor {dr:6.2f} s   -> ratio {dr / p:.2f}x")


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


def _run_ranks(flag: str, ranks: int, what: str) -> None:
    """Runs this file with `flag` as `ranks` processes started like torchrun (rank 0 prints), waiting up to 600 s."""
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
        procs.append(subprocess.Popen([sys.executable, __file__, flag], env=env,
                                      stdout=None if r == 0 else subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                      cwd="/"))
    for p in procs:
        try:
            p.wait(timeout=600)
        except subprocess.TimeoutExpired:
            p.kill()
            print(f"  {what}: a rank did not finish within 600 s")


def bench_all_reduce(ranks: int = 2) -> None:
    """all_reduce bus bandwidth of tpu_dist on tpu tensors next to torch's gloo backend on CPU tensors, in the
    same processes (2 ranks started like torchrun, 1-64 MB float32)."""
    _run_ranks("--all-reduce-rank", ranks, "all_reduce")


def _jax_adamw(lr: float, wd: float, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8):
    """torch.optim.AdamW's update, in JAX."""
    import jax
    import jax.numpy as jnp

    def update(params, state, grads):
        m, v, t = state
        t = t + 1
        m = jax.tree.map(lambda a, g: b1 * a + (1 - b1) * g, m, grads)
        v = jax.tree.map(lambda a, g: b2 * a + (1 - b2) * g * g, v, grads)
        step_size = lr / (1 - b1 ** t)
        bc2 = jnp.sqrt(1 - b2 ** t)

        def one(p, a, b):
            p = p * (1 - lr * wd)
            return p - step_size * a / (jnp.sqrt(b) / bc2 + eps)

        return jax.tree.map(one, params, m, v), (m, v, t)

    def init(params):
        zeros = jax.tree.map(jnp.zeros_like, params)
        return zeros, jax.tree.map(jnp.zeros_like, params), jnp.zeros((), jnp.float32)

    return init, update


def _jax_loss(name: str):
    """The MLP or GPT example's forward and cross-entropy written directly in JAX (params: the torch model's
    state_dict as arrays)."""
    import jax
    import jax.numpy as jnp

    def linear(p, prefix, x, bias=True):
        y = x @ p[prefix + ".weight"].T
        return y + p[prefix + ".bias"] if bias else y

    def xent(logits, y):
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=-1))

    def layer_norm(p, prefix, x):
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return (x - mu) / jnp.sqrt(var + 1e-5) * p[prefix + ".weight"] + p[prefix + ".bias"]

    def gelu(x):
        return jax.nn.gelu(x, approximate=False)

    if name == "host_mlp":  # _HostMLP: Linear, LayerNorm, GELU, Linear, GELU, Linear
        def loss(p, x, y):
            h = gelu(layer_norm(p, "1", linear(p, "0", x)))
            h = gelu(linear(p, "3", h))
            return xent(linear(p, "5", h), y)
        return loss

    if name == "mlp":
        def loss(p, x, y):
            h = jax.nn.relu(linear(p, "0", x))
            h = gelu(linear(p, "2", h))
            return xent(linear(p, "4", h), y)
        return loss

    def loss(p, idx, targets, heads=4, layers=2):
        b, t = idx.shape
        x = p["tok.weight"][idx] + p["pos.weight"][jnp.arange(t)]
        c = x.shape[-1]
        mask = jnp.tril(jnp.ones((t, t), bool))
        for i in range(layers):
            pre = f"blocks.{i}."
            q, k, v = jnp.split(linear(p, pre + "qkv", layer_norm(p, pre + "ln1", x)), 3, axis=-1)
            q, k, v = (z.reshape(b, t, heads, c // heads).transpose(0, 2, 1, 3) for z in (q, k, v))
            att = jnp.where(mask, q @ k.transpose(0, 1, 3, 2) / jnp.sqrt(c // heads), -jnp.inf)
            att = jax.nn.softmax(att, axis=-1) @ v
            x = x + linear(p, pre + "proj", att.transpose(0, 2, 1, 3).reshape(b, t, c))
            h = gelu(linear(p, pre + "mlp.0", layer_norm(p, pre + "ln2", x)))
            x = x + linear(p, pre + "mlp.2", h)
        logits = linear(p, "head", layer_norm(p, "ln", x), bias=False)
        return xent(logits.reshape(b * t, -1), targets.reshape(-1))

    return loss


def _jax_train_step(name: str) -> tuple[Callable[[], Any], list[Any]]:
    """Example `name` written directly in JAX, forward + backward + AdamW in one jax.jit, on the same weights and
    first batch: (a step returning the loss array, the carried [params, optimizer state])."""
    import jax
    import jax.numpy as jnp

    mod = _HostMLP if name == "host_mlp" else _example(name)
    model, batches, _ = mod.build(0)
    group = mod.optimizer(model).param_groups[0]
    params = {k: jnp.asarray(v.detach().numpy()) for k, v in model.named_parameters()}
    x, y = (jnp.asarray(t.numpy()) for t in next(batches))
    init, update = _jax_adamw(group["lr"], group["weight_decay"])
    loss = _jax_loss(name)

    @jax.jit
    def jax_step(params, state, x, y):
        value, grads = jax.value_and_grad(loss)(params, x, y)
        params, state = update(params, state, grads)
        return params, state, value

    carry = [params, init(params)]

    def step() -> Any:
        carry[0], carry[1], value = jax_step(carry[0], carry[1], x, y)
        return value

    return step, carry


def _jax_floor_us(name: str, calls: int = 20, trials: int = 5) -> float:
    """Median us per training step of example `name` written in one jax.jit, each step waited for like
    `loss.item()` (the floor: the same XLA work with no per-op host work)."""
    jax_step, _ = _jax_train_step(name)

    def step() -> None:
        float(jax_step())  # like loss.item()

    for _ in range(3):
        step()
    return statistics.median(per_call_us(lambda: [step() for _ in range(calls)], 1) / calls for _ in range(trials))


def bench_compile() -> None:
    """Training steps per second of the MLP and GPT examples: torch.compile(backend="tpu") (model and optimizer
    step compiled) vs tpu eager, and vs the same model and AdamW written directly in JAX with the whole step in one
    jax.jit (the floor; target compiled/JAX within 1.15x). Steps after warm-up, waited for at the end."""
    import jax

    print(f"compile  platform={torch.tpu.get_device_name()}  (steps/s after warm-up; AdamW; median of 5 trials)")
    for name in ("mlp", "gpt"):
        mod = _example(name)
        steps: dict[str, Callable[[], object]] = {}
        for mode in ("eager", "compiled"):
            model, batches, loss_fn = mod.build(0)
            model = model.to("tpu")
            opt = mod.optimizer(model)
            x, y = (t.to("tpu") for t in next(batches))

            def forward_loss(x, y, model=model, loss_fn=loss_fn):
                return loss_fn(model(x), y)

            # Compiled: the model with its loss (one forward and one backward graph) and the optimizer step.
            fwd = torch.compile(forward_loss, backend="tpu") if mode == "compiled" else forward_loss
            opt_step = torch.compile(opt.step, backend="tpu") if mode == "compiled" else opt.step

            def step(fwd=fwd, opt=opt, opt_step=opt_step, x=x, y=y) -> None:
                opt.zero_grad()
                fwd(x, y).backward()
                opt_step()

            steps[mode] = step
        # The floor: the same model and data in JAX, forward + backward + AdamW in one jit.
        floor, carry = _jax_train_step(name)
        steps["jax"] = floor

        def sync() -> None:
            torch.tpu.synchronize()
            jax.block_until_ready(carry)

        r = steps_per_second(steps, 30 if name == "mlp" else 20, sync)
        print(f"  {name:<4} compiled {r['compiled']:7.1f} steps/s  eager {r['eager']:7.1f} steps/s"
              f"  jax.jit {r['jax']:7.1f} steps/s  -> compiled/eager {r['compiled'] / r['eager']:.2f}x,"
              f" jax/compiled {r['jax'] / r['compiled']:.2f}x (target <= 1.15x)")


def bench_index_checks() -> None:
    """Cost of the device-side index checks (torch_tpu/_checks.py): an embedding + gather training step (forward
    and backward, waiting for the loss each step) with the checks on vs off (the unsafe opt-out
    TORCH_TPU_INDEX_CHECKS=0), in DEFER_NEVER, DEFER_AND_FUSE and torch.compile(backend="tpu") (target < 1.1x in
    the fused and compiled programs)."""
    from torch_tpu import _checks

    print(f"index_checks  platform={torch.tpu.get_device_name()}  (median of interleaved trials; each step waits)")
    torch.manual_seed(0)
    emb = torch.nn.Embedding(4096, 128).to("tpu")
    head = torch.nn.Linear(128, 512).to("tpu")
    ids = torch.randint(0, 4096, (32, 64), device="tpu")
    tgt = torch.randint(0, 512, (32, 64, 1), device="tpu")

    def forward(ids: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        logp = head(emb(ids)).log_softmax(-1)
        return -logp.gather(-1, tgt).mean()

    compiled = torch.compile(forward, backend="tpu", dynamic=False)

    def step(fwd: Callable[..., torch.Tensor]) -> Callable[[], float]:
        def run() -> float:
            emb.weight.grad = head.weight.grad = head.bias.grad = None
            loss = fwd(ids, tgt)
            loss.backward()
            return loss.item()
        return run

    calls, trials = 10, 15
    for label, mode, fwd in (("DEFER_NEVER", "DEFER_NEVER", forward), ("DEFER_AND_FUSE", "DEFER_AND_FUSE", forward),
                             ("torch.compile", "DEFER_NEVER", compiled)):
        run = step(fwd)
        samples: dict[bool, list[float]] = {True: [], False: []}
        with torch.tpu.set_eager_mode(mode):
            for on in (True, False):  # warm-up: compile both programs
                _checks.set_enabled(on)
                for _ in range(3):
                    run()
            for _ in range(trials):
                for on in (True, False):
                    _checks.set_enabled(on)
                    samples[on].append(per_call_us(run, calls))
        _checks.set_enabled(True)
        on_us, off_us = statistics.median(samples[True]), statistics.median(samples[False])
        best = min(samples[True]) / min(samples[False])  # the fastest trials: less sensitive to a loaded machine
        print(f"  {label:<15} checked {on_us:8.1f} us/step  unchecked {off_us:8.1f} us/step  "
              f"-> checked/unchecked {on_us / off_us:.3f}x (fastest trials {best:.3f}x)"
              + ("" if label == "DEFER_NEVER" else "  (target < 1.1x)"))


class _HostMLP:
    """The MLP training step issue 12 states: B=64, 256 -> 1024 -> 256 -> 10, GELU, LayerNorm, AdamW,
    cross-entropy (the examples' MLP has ReLU and no LayerNorm)."""

    @staticmethod
    def build(seed: int = 0):
        import torch.nn as nn
        import torch.nn.functional as F

        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(256, 1024), nn.LayerNorm(1024), nn.GELU(), nn.Linear(1024, 256), nn.GELU(),
                              nn.Linear(256, 10))
        g = torch.Generator().manual_seed(seed)

        def batches():
            while True:
                yield torch.randn(64, 256, generator=g), torch.randint(0, 10, (64,), generator=g)

        return model, batches(), F.cross_entropy

    @staticmethod
    def optimizer(model):
        return torch.optim.AdamW(model.parameters(), lr=1e-3)


HOST_ROWS = ("eager", "mlp", "gpt", "compiled", "sync", "cold", "hf", "nosync")
_HOST_TABLE: list[tuple[str, str, str, bool | None]] = []


def _host_row(name: str, figures: str, ratio: float, target: float, fmt: str = "{:.2f}x") -> None:
    """Print one ratio with its target and keep it for the summary table."""
    ok = ratio <= target
    shown, tgt = fmt.format(ratio), fmt.format(target)
    mark = "ok" if ok else "MISSES TARGET"
    print(f"  {name:<50} {figures}\n  {'':<50} -> {shown} (target <= {tgt})  {mark}", flush=True)
    _HOST_TABLE.append((name, shown, f"<= {tgt}", ok))


def _host_info(name: str, figures: str, ratio: str = "") -> None:
    print(f"  {name:<50} {figures}" + (f"  -> {ratio}" if ratio else ""), flush=True)
    if ratio:
        _HOST_TABLE.append((name, ratio, "", None))


def _interleaved(fns: dict[str, Callable[[], object]], calls: int, trials: int, warm: int = 3) -> dict[str, float]:
    """Median us per call of each function (each call must wait for its result), interleaved trials."""
    for fn in fns.values():
        for _ in range(warm):
            fn()
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(trials):
        for k, fn in fns.items():
            samples[k].append(per_call_us(fn, calls))
    return {k: statistics.median(v) for k, v in samples.items()}


def _graphed(opt: torch.optim.Optimizer, step: Callable[[], torch.Tensor]) -> Callable[[], float]:
    """`step` (zero_grad, forward, backward, opt.step(); returns the loss) captured once with torch.tpu.graph after
    two warm-up steps, as CUDA graphs are used: a function that replays it and reads the loss."""
    for _ in range(2):
        step().item()
    opt.zero_grad(set_to_none=True)
    graph = torch.tpu.TPUGraph()
    with torch.tpu.graph(graph):
        static_loss = step()
    return lambda: (graph.replay(), static_loss.item())[1]


def _tpu_step_variants(mod, modes=("DEFER_NEVER", "DEFER_AND_FUSE"), whole_step: bool = True,
                       compiled_model: bool = True, graph: bool = False) -> dict[str, Callable[[], float]]:
    """Training steps of `mod` (build/optimizer) on tpu, each ending in loss.item(): one per eager mode, the whole
    step in torch.compile(backend="tpu"), torch.compile(model, backend="tpu") with the optimizer eager, and (with
    `graph`) the step captured once with torch.tpu.graph and replayed. Every variant has its own model built from
    the same seed."""
    out: dict[str, Callable[[], float]] = {}

    def make(kind: str) -> Callable[[], float]:
        model, batches, loss_fn = mod.build(0)
        model = model.to("tpu")
        opt = mod.optimizer(model)
        x, y = (t.to("tpu") for t in next(batches))
        fwd = torch.compile(model, backend="tpu") if kind == "compiled model" else model

        def step() -> torch.Tensor:
            opt.zero_grad()
            loss = loss_fn(fwd(x), y)
            loss.backward()
            opt.step()
            return loss

        if kind == "compiled step":
            step = torch.compile(step, backend="tpu")
        if kind == "graph":
            for group in opt.param_groups:
                group["capturable"] = True  # (as constructing it with capturable=True: the state is made at step 1)
            return _graphed(opt, step)
        if kind in ("DEFER_NEVER", "DEFER_AND_FUSE"):
            def run() -> float:
                with torch.tpu.set_eager_mode(kind):
                    return step().item()
            return run
        if kind == "DEFER_NEVER, optimizer op by op":  # the step fusion turned off (TORCH_TPU_FUSE_OPTIMIZER_STEPS)
            def op_by_op() -> float:
                import os

                before = os.environ.get("TORCH_TPU_FUSE_OPTIMIZER_STEPS")
                os.environ["TORCH_TPU_FUSE_OPTIMIZER_STEPS"] = "0"
                try:
                    with torch.tpu.set_eager_mode("DEFER_NEVER"):
                        return step().item()
                finally:
                    if before is None:
                        del os.environ["TORCH_TPU_FUSE_OPTIMIZER_STEPS"]
                    else:
                        os.environ["TORCH_TPU_FUSE_OPTIMIZER_STEPS"] = before
            return op_by_op
        return lambda: step().item()

    for m in modes:
        out[m] = make(m)
    if "DEFER_NEVER" in modes:
        out["DEFER_NEVER, optimizer op by op"] = make("DEFER_NEVER, optimizer op by op")
    if whole_step:
        out["compiled step"] = make("compiled step")
    if compiled_model:
        out["compiled model"] = make("compiled model")
    if graph:
        out["graph"] = make("graph")
    return out


def _host_eager(quick: bool) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    x = torch.randn(2, 2, device="tpu")
    y = torch.randn(2, 2, device="tpu")
    a, b = jnp.asarray(x.cpu().numpy()), jnp.asarray(y.cpu().numpy())
    add = jax.jit(lambda p, q: p + q)
    with torch.tpu.set_eager_mode("DEFER_NEVER"):
        r = side_by_side({"tpu": lambda: x + y, "jax": lambda: add(a, b)}, calls=300 if quick else 5000,
                         trials=2 if quick else 7, sync=lambda: (torch.tpu.synchronize(), jax.block_until_ready(a)))
    _host_row("a. eager x + y (2x2, DEFER_NEVER, no sync)", f"tpu {r['tpu']:.2f} us  jax.jit {r['jax']:.2f} us",
              r["tpu"] / r["jax"], 1.2)
    # A cast (x.to(dtype), autocast's casts) and a copy to the host, each next to the same work in JAX.
    cast = jax.jit(lambda p: p.astype(jnp.bfloat16))
    with torch.tpu.set_eager_mode("DEFER_NEVER"):
        r = side_by_side({"tpu": lambda: x.to(torch.bfloat16), "jax": lambda: cast(a)}, calls=300 if quick else 3000,
                         trials=2 if quick else 7, sync=lambda: (torch.tpu.synchronize(), jax.block_until_ready(a)))
        _host_info("a. x.to(torch.bfloat16) (2x2) / jax.jit astype",
                   f"tpu {r['tpu']:.2f} us  jax.jit {r['jax']:.2f} us", f"{r['tpu'] / r['jax']:.2f}x")
        r = side_by_side({"tpu": lambda: (x + y).cpu(), "jax": lambda: np.asarray(add(a, b))},
                         calls=300 if quick else 3000, trials=2 if quick else 7)
        _host_info("a. (x + y).cpu() (2x2) / np.asarray(jax.jit add)", f"tpu {r['tpu']:.2f} us  jax {r['jax']:.2f} us",
                   f"{r['tpu'] / r['jax']:.2f}x")


def _host_training(name: str, quick: bool, fused: bool, compiled: bool) -> None:
    mod = _HostMLP if name == "host_mlp" else _example(name)
    label = "MLP" if name == "host_mlp" else "GPT"
    fns: dict[str, Callable[[], float]] = dict(_tpu_step_variants(
        mod, modes=("DEFER_NEVER", "DEFER_AND_FUSE") if fused else (), whole_step=compiled, compiled_model=compiled,
        graph=fused))
    jax_step, _ = _jax_train_step(name)
    fns["jax"] = lambda: float(jax_step())
    calls = 3 if quick else (20 if name == "host_mlp" else 10)
    r = _interleaved(fns, calls=calls, trials=2 if quick else 5, warm=2 if quick else 5)
    j = r["jax"]
    ms = lambda k: f"{r[k] / 1e3:.2f} ms"  # noqa: E731
    if fused:
        _host_row(f"b. {label} step DEFER_AND_FUSE / jax.jit", f"fused {ms('DEFER_AND_FUSE')}  jax.jit {ms('jax')}",
                  r["DEFER_AND_FUSE"] / j, 1.3)
        _host_info(f"b. {label} step DEFER_NEVER / jax.jit", f"never {ms('DEFER_NEVER')}  jax.jit {ms('jax')}",
                   f"{r['DEFER_NEVER'] / j:.2f}x")
        # DEFER_NEVER runs each optimizer step as one program; the same step with that turned off, op by op.
        _host_info(f"b. {label} DEFER_NEVER optimizer op by op / as one program",
                   f"op by op {ms('DEFER_NEVER, optimizer op by op')}  one program {ms('DEFER_NEVER')}",
                   f"{r['DEFER_NEVER, optimizer op by op'] / r['DEFER_NEVER']:.2f}x")
        # The step recorded once and replayed without Python per op (torch.tpu.graph, CUDA graphs' API).
        _host_info(f"b. {label} step replayed (torch.tpu.graph) / jax.jit",
                   f"replay {ms('graph')}  jax.jit {ms('jax')}", f"{r['graph'] / j:.2f}x")
    if compiled:
        _host_row(f"c. {label} torch.compile(whole step) / jax", f"compiled {ms('compiled step')}  jax.jit {ms('jax')}",
                  r["compiled step"] / j, 1.15)
        _host_row(f"c. {label} torch.compile(model) / jax", f"compiled {ms('compiled model')}  jax.jit {ms('jax')}",
                  r["compiled model"] / j, 1.4)


def _host_sync(quick: bool) -> None:
    x = torch.randn(2, 2, device="tpu")
    y = torch.randn(2, 2, device="tpu")
    x1, y1 = x[0, 0].clone(), y[0, 0].clone()
    for what, fn in (("(x + y).cpu(), 2x2", lambda: (x + y).cpu()), ("(x + y).item(), 1 element",
                                                                      lambda: (x1 + y1).item())):
        def in_mode(mode: str, fn=fn) -> Callable[[], object]:
            def run() -> None:
                with torch.tpu.set_eager_mode(mode):
                    for _ in range(50):
                        fn()
            return run

        def recorded(fn=fn) -> None:  # DEFER_AND_FUSE recording every op (its one-op segments not run directly)
            from torch_tpu import _deferred

            before = _deferred._DIRECT_AFTER
            _deferred._DIRECT_AFTER = 0
            try:
                in_mode("DEFER_AND_FUSE", fn)()
            finally:
                _deferred._DIRECT_AFTER = before
                _deferred.reset_direct()

        r = _interleaved({"fuse": in_mode("DEFER_AND_FUSE"), "never": in_mode("DEFER_NEVER"), "recorded": recorded},
                         calls=2 if quick else 20, trials=2 if quick else 7)
        _host_row(f"e. sync-heavy {what}: fused / never",
                  f"fused {r['fuse'] / 50:.2f} us  never {r['never'] / 50:.2f} us", r["fuse"] / r["never"], 1.0)
        _host_info(f"e. {what}: every op recorded / never", f"recorded {r['recorded'] / 50:.2f} us",
                   f"{r['recorded'] / r['never']:.2f}x")


def _host_nosync(quick: bool) -> None:
    """Training steps that never read a value (DEFER_AND_FUSE: one graph grows until its size limit), the MLP step
    of row b, 120 steps then one synchronize, twice, on fresh models: graphs cut where the step structure repeats
    (the default) next to graphs cut at the size limit only (before: every cut a new structure to compile), with
    the programs each compiled or loaded and the time per step of the first and of the second 120 steps."""
    from torch_tpu import _deferred

    steps = 12 if quick else 120
    results = {}
    for kind in ("cut at the period", "size limit only"):
        model, batches, loss_fn = _HostMLP.build(0)
        model = model.to("tpu")
        opt = _HostMLP.optimizer(model)
        x, y = (t.to("tpu") for t in next(batches))
        period = _deferred._period
        if kind == "size limit only":
            _deferred._period = lambda entries: 0
        try:
            with torch.tpu.set_eager_mode("DEFER_AND_FUSE"):
                figures = []
                for _ in range(2):
                    m0 = torch.tpu.metrics()
                    t0 = time.perf_counter()
                    for _ in range(steps):
                        opt.zero_grad()
                        loss_fn(model(x), y).backward()
                        opt.step()
                    torch.tpu.synchronize()
                    m1 = torch.tpu.metrics()
                    figures.append(((time.perf_counter() - t0) / steps * 1e3,
                                    m1.fused_graph_compiles - m0.fused_graph_compiles
                                    + m1.persistent_cache_hits - m0.persistent_cache_hits))
        finally:
            _deferred._period = period
        results[kind] = figures
        (a, ca), (b, cb) = figures
        _host_info(f"g. {steps} steps without a sync, {kind}",
                   f"first {a:.1f} ms/step ({ca} programs)  again {b:.1f} ms/step ({cb} programs)")
    first = {k: v[0][0] for k, v in results.items()}
    _host_info("g. first no-sync steps: cut at the period / size limit only", "",
               f"{first['cut at the period'] / first['size limit only']:.2f}x")


_HOST_FIRST_STEP = """
import gc, sys, time
import torch
import torch._dynamo, torch._functorch.aot_autograd  # PyTorch's own imports
# and those AOTAutograd's cache makes lazily at a first compile, for its key (FxGraphHashDetails), 0.24 s here
import torch._higher_order_ops.triton_kernel_wrap, torch._inductor.codegen.wrapper
sys.path.insert(0, {tools!r})
import bench
torch.zeros(1, device="tpu").cpu()  # start the runtime (PJRT client)
bench._HostMLP.optimizer(torch.nn.Linear(1, 1))
gc.collect()  # the imports' garbage: else a full collection (0.2 s here) may fall inside the step, as timeit avoids
t0 = time.perf_counter()
model, batches, loss_fn = bench._HostMLP.build(0)
model = model.tpu()
opt = bench._HostMLP.optimizer(model)
fwd = torch.compile(model, backend="tpu") if {compiled!r} else model
x, y = (t.tpu() for t in next(batches))
opt.zero_grad()
loss = loss_fn(fwd(x), y)
loss.backward()
opt.step()
loss.item()
torch.tpu.synchronize()  # every op of the step done (under DEFER_AND_FUSE the update may still be running)
print(f"RESULT {{time.perf_counter() - t0}}")
"""


def _host_cold(quick: bool) -> None:
    import os
    import subprocess
    import tempfile
    from pathlib import Path

    tools = str(Path(__file__).resolve().parent)
    # A cold first step takes 1-2 s here, a fresh process's start-up about 3 s: three pairs per case (one with
    # --quick) add about a minute to the host run, and a median of three is steadier than one pair.
    reps = 1 if quick else 3
    cases = (("DEFER_NEVER", 0.15), ("DEFER_AND_FUSE", 0.10), ("compiled model", 0.40))
    for label, target in cases[:1] if quick else cases:
        compiled = label == "compiled model"
        code = _HOST_FIRST_STEP.format(tools=tools, compiled=compiled)
        cold, warm = [], []
        for _ in range(reps):
            with tempfile.TemporaryDirectory() as d:
                env = dict(os.environ, TORCH_TPU_CACHE_DIR=f"{d}/tpu", TORCHINDUCTOR_CACHE_DIR=f"{d}/inductor",
                           TORCH_TPU_EAGER_MODE="DEFER_NEVER" if compiled else label)
                for bucket in (cold, warm):
                    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                         cwd="/", timeout=300)
                    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT")]
                    if out.returncode or not lines:
                        raise RuntimeError(f"first-step subprocess ({label}) failed: {out.stderr[-2000:]}")
                    bucket.append(float(lines[-1].split()[1]))
        c, w = statistics.median(cold), statistics.median(warm)
        _host_row(f"d. first step warm/cold, {label}", f"cold {c:.2f} s  warm {w:.2f} s (fresh processes, "
                  f"median of {reps})", w / c, target, fmt="{:.1%}")


def _hf_models() -> dict[str, Any]:
    """The row f models that can be built here: name -> (build(device) -> step, or the reason it is skipped)."""
    models: dict[str, Any] = {}
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except Exception as e:  # noqa: BLE001  (any import failure means: skip, with the reason)
        models["Llama (HF, tiny)"] = f"transformers does not import here ({type(e).__name__}: {e})"
    else:
        def llama(seed: int = 0):
            torch.manual_seed(seed)
            cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=4, vocab_size=1000, max_position_embeddings=128)
            model = LlamaForCausalLM(cfg)
            ids = torch.randint(0, 1000, (4, 64), generator=torch.Generator().manual_seed(seed))
            return model, ids, lambda m, x: m(input_ids=x, labels=x).loss
        models["Llama (HF, tiny)"] = llama
    try:
        from torchvision.models import resnet18
        name = "ResNet-18 (torchvision)"
    except Exception as e:  # noqa: BLE001
        # torchvision's PyPI wheels for torch 2.13.0 are CUDA builds that fail to import beside the CPU torch
        # ("operator torchvision::nms does not exist"): the same architecture, written out below, stands in.
        resnet18 = _resnet18
        name = "ResNet-18 (torchvision layout, built in)"
        print(f"  (torchvision does not import: {str(e)[:100]}; row f uses the same layout written out)")

    def resnet(seed: int = 0):
        torch.manual_seed(seed)
        g = torch.Generator().manual_seed(seed)
        data = (torch.randn(8, 3, 64, 64, generator=g), torch.randint(0, 1000, (8,), generator=g))
        return resnet18(), data, lambda m, d: torch.nn.functional.cross_entropy(m(d[0]), d[1])
    models[name] = resnet
    return models


def _resnet18() -> torch.nn.Module:
    """torchvision.models.resnet18() layer for layer (BasicBlock x [2, 2, 2, 2], 11.7 M parameters), for machines
    where torchvision cannot be imported."""
    nn = torch.nn
    Block = _example("resnet").Residual  # the examples' residual block: two 3x3 conv-BN, 1x1 conv-BN skip

    layers = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)]
    cin = 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [Block(cin, cout, stride), Block(cout, cout, 1)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, 1000)]
    return nn.Sequential(*layers)


def _host_hf(quick: bool) -> None:
    threads = torch.get_num_threads()
    for name, build in _hf_models().items():
        if isinstance(build, str):
            print(f"  f. {name}: SKIPPED, {build}", flush=True)
            _HOST_TABLE.append((f"f. {name}", "skipped", "", None))
            continue
        fns: dict[str, Callable[[], float]] = {}
        for kind in ("cpu 1 thread", f"cpu {threads} threads", "DEFER_NEVER", "DEFER_AND_FUSE", "compiled model",
                     "graph"):
            device = "cpu" if kind.startswith("cpu") else "tpu"
            model, data, loss_of = build(0)
            model = model.to(device)
            data = data.to(device) if isinstance(data, torch.Tensor) else tuple(t.to(device) for t in data)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=kind == "graph")
            fwd = torch.compile(model, backend="tpu") if kind == "compiled model" else model
            if kind == "graph":
                def whole(model=model, opt=opt, data=data, loss_of=loss_of) -> torch.Tensor:
                    opt.zero_grad(set_to_none=True)
                    loss = loss_of(model, data)
                    loss.backward()
                    opt.step()
                    return loss

                fns[kind] = _graphed(opt, whole)
                continue
            n_threads = 1 if kind == "cpu 1 thread" else threads
            mode = kind if kind.startswith("DEFER") else "DEFER_NEVER"

            def step(fwd=fwd, opt=opt, data=data, loss_of=loss_of, n_threads=n_threads, mode=mode) -> float:
                torch.set_num_threads(n_threads)
                try:
                    with torch.tpu.set_eager_mode(mode):
                        opt.zero_grad()
                        loss = loss_of(fwd, data)
                        loss.backward()
                        opt.step()
                        return loss.item()
                finally:
                    torch.set_num_threads(threads)

            fns[kind] = step
        r = _interleaved(fns, calls=2 if quick else 5, trials=2 if quick else 5, warm=2 if quick else 3)
        cpu1 = r["cpu 1 thread"]
        print(f"  f. {name}: " + "  ".join(f"{k} {v / 1e3:.1f} ms" for k, v in r.items()), flush=True)
        for kind, target in (("DEFER_NEVER", None), ("DEFER_AND_FUSE", 1.0), ("compiled model", 1.0), ("graph", None)):
            label = f"f. {name} tpu {kind} / cpu 1 thread"
            extra = f"(vs cpu {threads} threads {r[kind] / r[f'cpu {threads} threads']:.2f}x)"
            if target is None:
                _host_info(label, extra, f"{r[kind] / cpu1:.2f}x")
            else:
                _host_row(label, extra, r[kind] / cpu1, target)


def bench_host(rows: list[str] | None = None, quick: bool = False) -> None:
    """Every ratio issue 12 asks for, side by side in this one process, each with its target (rows that miss it
    are marked; nothing asserts). Training steps end in loss.item() (each step waited for), the JAX floor in
    float(loss). Row d runs fresh processes with an empty cache directory (cold) and then the same one (warm)."""
    rows = list(rows or HOST_ROWS)
    _HOST_TABLE.clear()
    print(f"host  platform={torch.tpu.get_device_name()}  torch threads={torch.get_num_threads()}"
          f"{'  (--quick: few iterations, figures are not meaningful)' if quick else ''}", flush=True)
    runs = {"eager": lambda: _host_eager(quick),
            "mlp": lambda: _host_training("host_mlp", quick, fused=True, compiled=False),
            "gpt": lambda: _host_training("gpt", quick, fused=True, compiled=False),
            "compiled": lambda: (_host_training("host_mlp", quick, fused=False, compiled=True),
                                 _host_training("gpt", quick, fused=False, compiled=True)),
            "sync": lambda: _host_sync(quick), "cold": lambda: _host_cold(quick), "hf": lambda: _host_hf(quick),
            "nosync": lambda: _host_nosync(quick)}
    for row in rows:
        t0 = time.perf_counter()
        try:
            runs[row]()
        except Exception as e:  # noqa: BLE001  (one failing row must not hide the others)
            print(f"  {row}: FAILED ({type(e).__name__}: {str(e)[:300]})", flush=True)
            _HOST_TABLE.append((row, "FAILED", "", False))
        print(f"  [{row}: {time.perf_counter() - t0:.0f} s]", flush=True)
    print("host summary")
    for name, ratio, target, ok in _HOST_TABLE:
        mark = "" if ok is None else ("ok" if ok else "MISSES")
        print(f"  {name:<58} {ratio:>8}  {target:<9} {mark}")


def bench_streams() -> None:
    """What streams and events cost (docs/user_guide.md, "Streams and events"): an FSDP-like step (a side-stream
    copy of the shards into a flat buffer, record_event, wait_event, three matmuls, an in-place update) with the
    stream and event calls next to the same step without them, per mode (ratio ~1: under DEFER_AND_FUSE the
    events cut no graph), and Event.record() next to a 2x2 add with 2,000 idle live arrays."""
    shards = [torch.randn(64, 64, device="tpu") for _ in range(3)]
    x = torch.randn(32, 64, device="tpu")
    flat = torch.empty(3 * 64 * 64, device="tpu")
    side, compute = torch.tpu.Stream(), torch.tpu.current_stream()

    def step(streams: bool) -> None:
        if streams:
            side.wait_stream(compute)
        with torch.tpu.stream(side if streams else None):
            torch.cat([s.reshape(-1) for s in shards], out=flat)
            params = [p.view(64, 64) for p in flat.split(64 * 64)]
            event = side.record_event() if streams else None
        if streams:
            compute.wait_event(event)
        h = x
        for p in params:
            h = torch.tanh(h @ p)
        for s, p in zip(shards, params):
            s.sub_(0.001 * p)
        h.sum().item()

    print("streams  (FSDP-like step: with streams/events vs without, us/step)")
    for mode in ("DEFER_NEVER", "DEFER_AND_FUSE"):
        with torch.tpu.set_eager_mode(mode):
            r = _interleaved({"streams": lambda: step(True), "plain": lambda: step(False)}, calls=30, trials=5)
        print(f"  {mode:<15} with {r['streams']:8.1f}  without {r['plain']:8.1f}  -> "
              f"{r['streams'] / r['plain']:.2f}x")
    keep = [torch.randn(4, device="tpu") for _ in range(2000)]
    torch.tpu.synchronize()
    e = torch.tpu.Event()
    a = torch.randn(2, 2, device="tpu")
    r = side_by_side({"Event.record()": e.record, "x + y": lambda: a + a}, calls=200, trials=5,
                     sync=torch.tpu.synchronize)
    print(f"  Event.record() with {len(keep)} live arrays {r['Event.record()']:8.1f} us, a 2x2 add "
          f"{r['x + y']:6.1f} us -> {r['Event.record()'] / r['x + y']:.1f}x")


def bench_profiler(calls: int = 300, trials: int = 5) -> None:
    """Host cost of profiling an eager step (4 ops on 64x64): the same step with no profiler, under torch.profiler
    with ProfilerActivity.CPU, with CPU + PrivateUse1 (which also runs XLA's tracer for the tpu device rows), and
    under torch.tpu.profiler.trace; per-step times while the profile runs, interleaved trials, and the time to
    leave each profile (synchronize, stop, and for torch.profiler build its results)."""
    import contextlib
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    x = torch.randn(64, 64, device="tpu")
    w = torch.randn(64, 64, device="tpu")

    def step() -> object:
        return ((x @ w).relu() + 1).sum()

    tmp = tempfile.mkdtemp(prefix="bench_profiler_")
    configs: dict[str, Callable[[], Any]] = {
        "no profiler": contextlib.nullcontext,
        "torch.profiler CPU": lambda: profile(activities=[ProfilerActivity.CPU]),
        "torch.profiler CPU+PrivateUse1": lambda: profile(
            activities=[ProfilerActivity.CPU, ProfilerActivity.PrivateUse1]),
        "torch.tpu.profiler.trace": lambda: torch.tpu.profiler.trace(tmp),
    }
    for _ in range(50):
        step()
    torch.tpu.synchronize()
    steps: dict[str, list[float]] = {k: [] for k in configs}
    exits: dict[str, list[float]] = {k: [] for k in configs}
    for _ in range(trials):
        for name, make in configs.items():
            ctx = make()
            ctx.__enter__()
            t0 = time.perf_counter()
            for _ in range(calls):
                step()
            torch.tpu.synchronize()
            t1 = time.perf_counter()
            ctx.__exit__(None, None, None)
            if hasattr(ctx, "key_averages"):
                ctx.key_averages()  # the results are built on first use
            t2 = time.perf_counter()
            steps[name].append((t1 - t0) / calls * 1e6)
            exits[name].append((t2 - t1) * 1e3)
    base = statistics.median(steps["no profiler"])
    print(f"profiler  platform={torch.tpu.get_device_name()}  step: ((x @ w).relu() + 1).sum() on 64x64, "
          f"{calls} steps per profile")
    for name in configs:
        st, ex = statistics.median(steps[name]), statistics.median(exits[name])
        print(f"  {name:<32} {st:8.1f} us/step  {st / base:5.2f}x   leaving the profile {ex:8.1f} ms")


def bench_jax_op() -> None:
    """torch.tpu.jax_op's per-call cost: a JAX gelu through jax_op next to the built-in tpu gelu (an aten lowering)
    and a bare cached jax.jit call, on 32x32 float32, each call waited for; forward + backward of the same too."""
    import jax
    import jax.numpy as jnp

    op = torch.tpu.jax_op(lambda v: jax.nn.gelu(v, approximate=True), name="bench_gelu")
    x = torch.randn(32, 32, device="tpu")
    a = jnp.asarray(x.cpu().numpy())
    bare = jax.jit(lambda v: jax.nn.gelu(v, approximate=True))
    xg = x.clone().requires_grad_()

    def grad_step(f):
        def run():
            xg.grad = None
            f(xg).sum().backward()
            xg.grad.cpu()
        return run

    r = side_by_side({
        "jax_op gelu": lambda: op(x).cpu(),
        "tpu F.gelu": lambda: torch.nn.functional.gelu(x, approximate="tanh").cpu(),
        "bare jax.jit": lambda: jax.device_get(bare(a)),
        "jax_op fwd+bwd": grad_step(op),
        "tpu F.gelu fwd+bwd": grad_step(lambda v: torch.nn.functional.gelu(v, approximate="tanh")),
    }, calls=300, trials=5)
    print(f"jax_op  platform={torch.tpu.get_device_name()}")
    for k, v in r.items():
        print(f"  {k:<20} {v:8.2f} us/call")
    print(f"  ratio jax_op / built-in lowering (forward)       : {r['jax_op gelu'] / r['tpu F.gelu']:.2f}x")
    print(f"  ratio jax_op / built-in lowering (fwd+bwd)       : {r['jax_op fwd+bwd'] / r['tpu F.gelu fwd+bwd']:.2f}x")
    print(f"  ratio jax_op / bare cached jax.jit (forward)     : {r['jax_op gelu'] / r['bare jax.jit']:.2f}x")


_INDUCTOR_FIRST_STEP = """
import sys, time
sys.path.insert(0, {examples!r})
import importlib.util
import torch, torch._dynamo
spec = importlib.util.spec_from_file_location("example_{name}", {examples!r} + "/{name}.py")
mod = importlib.util.module_from_spec(spec); sys.modules[spec.name] = mod; spec.loader.exec_module(mod)
model, batches, loss_fn = mod.build(0)
model = model.to("tpu"); opt = mod.optimizer(model)
x, y = (t.to("tpu") for t in next(batches))
t0 = time.perf_counter()
cm = torch.compile(model) if "{mode}" == "default" else torch.compile(model, backend="tpu")
opt.zero_grad(); loss = loss_fn(cm(x), y); loss.backward(); opt.step(); loss.item()
print("RESULT", time.perf_counter() - t0)
"""


def bench_inductor_default() -> None:
    """What default torch.compile(model) costs on tpu tensors vs backend="tpu", for the MLP and GPT examples
    (model compiled, eager AdamW step): the first step in a fresh process with an empty compile cache (Dynamo,
    AOTAutograd, XLA compiles; Dynamo imported before the timer) and steady steps/s side by side in this process.
    On XLA:CPU the default route sends tpu graphs to the tpu backend (torch_tpu/_inductor_route.py), so this
    measures the routing (and Inductor's imports); on a TPU it compares Inductor's Pallas code with the tpu backend."""
    import os
    import subprocess
    import tempfile
    from pathlib import Path

    import torch._dynamo

    examples = str(Path(__file__).resolve().parent.parent / "examples")
    print(f"inductor_default  platform={torch.tpu.get_device_name()}  (first step: fresh process, cold cache; "
          "steps/s after warm-up, median of 5 interleaved trials)")
    for name in ("mlp", "gpt"):
        mod = _example(name)
        first: dict[str, float] = {}
        for mode in ("tpu", "default"):
            with tempfile.TemporaryDirectory() as d:
                out = subprocess.run([sys.executable, "-c", _INDUCTOR_FIRST_STEP.format(examples=examples,
                                                                                         name=name, mode=mode)],
                                     env=dict(os.environ, TORCH_TPU_CACHE_DIR=d), capture_output=True, text=True,
                                     check=True, cwd="/")
            first[mode] = float([ln for ln in out.stdout.splitlines() if ln.startswith("RESULT")][-1].split()[1])
        steps: dict[str, Callable[[], object]] = {}
        for mode in ("default", "tpu"):
            torch._dynamo.reset()
            model, batches, loss_fn = mod.build(0)
            model = model.to("tpu")
            opt = mod.optimizer(model)
            x, y = (t.to("tpu") for t in next(batches))
            cm = torch.compile(model) if mode == "default" else torch.compile(model, backend="tpu")

            def step(cm=cm, opt=opt, x=x, y=y, loss_fn=loss_fn) -> None:
                opt.zero_grad()
                loss_fn(cm(x), y).backward()
                opt.step()

            steps[mode] = step
        r = steps_per_second(steps, 30 if name == "mlp" else 20, torch.tpu.synchronize)
        print(f"  {name:<4} default: first step {first['default']:5.2f} s, {r['default']:7.1f} steps/s   "
              f"backend=tpu: first step {first['tpu']:5.2f} s, {r['tpu']:7.1f} steps/s   -> default/tpu "
              f"{r['default'] / r['tpu']:.2f}x steps/s, {first['default'] / first['tpu']:.2f}x first step")


def bench_grouped_mm() -> None:
    """torch._grouped_mm on tpu (the MoE forward, 2d x 3d: 2048 tokens over 8 experts, 256 -> 512, float32) next to
    the per-expert loop of tpu matmuls it replaces and to CPU PyTorch's _grouped_mm, forward + backward, each call
    waited for."""
    g = torch.Generator().manual_seed(0)
    tokens, experts, k, n = 2048, 8, 256, 512
    sizes = torch.multinomial(torch.ones(experts), tokens, replacement=True, generator=g).bincount(minlength=experts)
    offs = torch.cumsum(sizes, 0, dtype=torch.int32)
    bounds = [0, *offs.tolist()]
    a_cpu = torch.randn(tokens, k, generator=g).requires_grad_()
    b_cpu = torch.randn(experts, k, n, generator=g).requires_grad_()
    a, b = a_cpu.detach().to("tpu").requires_grad_(), b_cpu.detach().to("tpu").requires_grad_()
    offs_t = offs.to("tpu")

    def step(a, b, offs, loop=False):
        def run():
            a.grad = b.grad = None
            if loop:
                out = torch.cat([a[s:e] @ b[i] for i, (s, e) in enumerate(zip(bounds, bounds[1:]))])
            else:
                out = torch._grouped_mm(a, b, offs)
            out.square().mean().backward()
            b.grad.cpu()
        return run

    r = side_by_side({"tpu _grouped_mm": step(a, b, offs_t), "tpu per-expert loop": step(a, b, offs_t, loop=True),
                      "cpu _grouped_mm": step(a_cpu, b_cpu, offs)}, calls=10, trials=5)
    print(f"grouped_mm  platform={torch.tpu.get_device_name()}  tokens={tokens} experts={experts} {k}->{n} float32 "
          "fwd+bwd")
    for key, v in r.items():
        print(f"  {key:<22} {v / 1000:8.2f} ms/step")
    print(f"  ratio tpu _grouped_mm / tpu per-expert loop : {r['tpu _grouped_mm'] / r['tpu per-expert loop']:.2f}x")
    print(f"  ratio tpu _grouped_mm / cpu _grouped_mm     : {r['tpu _grouped_mm'] / r['cpu _grouped_mm']:.2f}x")


def bench_paged_attention() -> None:
    """torch.tpu.ops.paged_attention (decode: batch 8, 16 query heads over 4 kv heads, head_dim 128, 1024-token
    sequences in 64 pages of 16, bfloat16 cache) next to what code without it does on tpu: gather each sequence's
    pages into a dense cache, then F.scaled_dot_product_attention with a length mask; each call waited for."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    batch, heads, kv, d, page, per_seq = 8, 16, 4, 128, 16, 64
    total = batch * per_seq
    q = torch.randn(batch, heads, d, generator=g).to("tpu")
    k_pages = torch.randn(kv, total, page, d, generator=g).bfloat16().to("tpu")
    v_pages = torch.randn(kv, total, page, d, generator=g).bfloat16().to("tpu")
    pages = torch.randperm(total, generator=g)[:batch * per_seq].reshape(batch, per_seq).int().to("tpu")
    lengths = torch.randint(1, per_seq * page + 1, (batch,), generator=g).int().to("tpu")
    tokens = per_seq * page

    def dense():
        k = k_pages[:, pages].reshape(kv, batch, tokens, d).transpose(0, 1).float()
        v = v_pages[:, pages].reshape(kv, batch, tokens, d).transpose(0, 1).float()
        mask = (torch.arange(tokens, device="tpu")[None, :] < lengths[:, None])[:, None, None, :]
        return F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=mask, enable_gqa=True)[:, :, 0]

    r = side_by_side({"paged_attention": lambda: torch.tpu.ops.paged_attention(q, k_pages, v_pages, lengths,
                                                                               pages).cpu(),
                      "gather + SDPA": lambda: dense().cpu()}, calls=20, trials=5)
    print(f"paged_attention  platform={torch.tpu.get_device_name()}  batch={batch} heads={heads}/{kv} head_dim={d} "
          f"tokens={tokens} pages of {page} bfloat16")
    for key, v in r.items():
        print(f"  {key:<18} {v / 1000:8.2f} ms/call")
    print(f"  ratio paged_attention / gather + SDPA : {r['paged_attention'] / r['gather + SDPA']:.2f}x")

# ---- functional collectives inside a compiled step (issue 15, item 4) ----


def _compiled_collectives_rank() -> None:
    """One rank of bench_compiled_collectives: a compiled matmul+tanh step whose all_reduce is inside the program,
    next to the same compiled step followed by an eager tpu_dist all_reduce, interleaved trials."""
    import os

    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    dist.init_process_group("tpu_dist")
    local = int(os.environ["LOCAL_RANK"])
    torch.tpu.set_device(local)
    rank, n, group = dist.get_rank(), dist.get_world_size(), dist.group.WORLD
    gloo = dist.new_group(backend="gloo")
    w = torch.randn(256, 256, device="tpu")
    x = torch.randn(64, 256, device="tpu")
    inside = torch.compile(lambda x, w: funcol.all_reduce(torch.tanh(x @ w), "sum", group) * 0.5, backend="tpu",
                           fullgraph=True)
    compute = torch.compile(lambda x, w: torch.tanh(x @ w), backend="tpu", fullgraph=True)

    def apart(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        y = compute(x, w)
        dist.all_reduce(y)
        return y * 0.5

    fns = {"in program": inside, "eager all_reduce": apart}
    calls = 50
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        fn(x, w).cpu()
    for _ in range(5):
        for name, fn in fns.items():
            dist.barrier(group=gloo)
            t0 = time.perf_counter()
            for _ in range(calls):
                out = fn(x, w)
            out.cpu()
            samples[name].append((time.perf_counter() - t0) / calls)
    if rank == 0:
        med = {k: statistics.median(v) for k, v in samples.items()}
        print(f"compiled_collectives  {n} ranks, (64x256 @ 256x256, tanh, all_reduce sum), "
              f"platform={torch.tpu.get_device_name()}")
        print(f"  all_reduce inside the compiled program {med['in program'] * 1e6:8.0f} us/step")
        print(f"  compiled program + eager all_reduce    {med['eager all_reduce'] * 1e6:8.0f} us/step")
        print(f"  ratio eager-apart / in-program         : {med['eager all_reduce'] / med['in program']:.2f}x",
              flush=True)
    dist.destroy_process_group()


def bench_compiled_collectives(ranks: int = 2) -> None:
    """A functional all_reduce inside a torch.compile(backend="tpu") step vs the same step with an eager
    all_reduce after it (2 ranks started like torchrun)."""
    _run_ranks("--compiled-collectives-rank", ranks, "compiled_collectives")


def bench_sdpa(L: int = 4096, heads: int = 2, head_dim: int = 64, trials: int = 3) -> None:
    """F.scaled_dot_product_attention at L = S = 4096 (causal, float32, batch 1), forward + backward on tpu: the fused
    op's blocked XLA path (kernels/pallas/flash_attention.py) next to PyTorch's math path (sdpa_kernel(MATH): the
    L x S scores as tensors). Two memory figures, which differ in what they see:
    - live peak: torch.tpu.max_memory_allocated over one step, the tensors alive at once (not a program's
      temporaries);
    - XLA temp: memory_analysis().temp_size_in_bytes of the compiled forward+backward program of each path (the
      blocked path's lax.scan vs the math path's softmax over the whole score matrix), the temporaries only."""
    import jax
    import jax.numpy as jnp
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from torch_tpu.kernels.pallas import flash_attention as fa

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, heads, L, head_dim, device="tpu", requires_grad=True) for _ in range(3))
    do = torch.randn(1, heads, L, head_dim, device="tpu")

    def step(math: bool) -> Callable[[], None]:
        def run() -> None:
            for t in (q, k, v):
                t.grad = None
            if math:
                with sdpa_kernel(SDPBackend.MATH):
                    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            o.backward(do)
            torch.tpu.synchronize()
        return run

    fns = {"blocked (fused op)": step(False), "math": step(True)}
    peaks = {}
    for name, fn in fns.items():
        fn()  # compile
        torch.tpu.synchronize()
        base = torch.tpu.memory_allocated()
        torch.tpu.reset_peak_memory_stats()
        fn()
        peaks[name] = torch.tpu.max_memory_allocated() - base
    times: dict[str, list[float]] = {n: [] for n in fns}
    for _ in range(trials):  # interleaved, one step each (a step is seconds on XLA:CPU)
        for name, fn in fns.items():
            times[name].append(per_call_us(fn, 1))
    r = {n: statistics.median(t) for n, t in times.items()}

    sc = head_dim ** -0.5
    a = [jnp.zeros((1, heads, L, head_dim), jnp.float32)] * 4

    def blocked(q, k, v, g):
        o, lse = fa._blocked_forward(q, k, v, None, True, sc, 0.0, None)
        return o, fa._blocked_backward(g, q, k, v, None, o, lse, True, sc, 0.0, None)

    def math_path(q, k, v, g):
        def f(q, k, v):
            s = jnp.einsum("bhle,bhse->bhls", q, k) * sc
            s = jnp.where(jnp.tril(jnp.ones((L, L), bool)), s, -jnp.inf)
            return jnp.einsum("bhls,bhse->bhle", jax.nn.softmax(s, -1), v)
        o, vjp = jax.vjp(f, q, k, v)
        return o, vjp(g)

    temp = {n: jax.jit(f).lower(*a).compile().memory_analysis().temp_size_in_bytes
            for n, f in (("blocked (fused op)", blocked), ("math", math_path))}
    mb = 1 / 2**20
    print(f"sdpa  L=S={L} heads={heads} head_dim={head_dim} causal float32 fwd+bwd  platform={torch.tpu.get_device_name()}")
    for n in fns:
        print(f"  {n:<20} {r[n] / 1e3:9.1f} ms/step   live peak {peaks[n] * mb:8.1f} MiB   XLA temp {temp[n] * mb:8.1f} MiB")
    print(f"  ratio blocked / math time        : {r['blocked (fused op)'] / r['math']:.2f}x")
    print(f"  ratio blocked / math live peak   : {peaks['blocked (fused op)'] / peaks['math']:.3f}x  (target < 0.25)")
    print(f"  ratio blocked / math XLA temp    : {temp['blocked (fused op)'] / temp['math']:.3f}x  (target < 0.25)")


BENCHMARKS = {"eager_overhead": bench_eager_overhead, "op_overhead": bench_op_overhead, "ops": bench_ops,
              "training": bench_training,
              "fuse": bench_fuse, "cold_start": bench_cold_start, "compile": bench_compile,
              "all_reduce": bench_all_reduce, "index_checks": bench_index_checks,
              "threads": bench_threads, "profiler": bench_profiler, "host": bench_host, "streams": bench_streams,
              "jax_op": bench_jax_op, "inductor_default": bench_inductor_default,
              "grouped_mm": bench_grouped_mm, "paged_attention": bench_paged_attention,
              "compiled_collectives": bench_compiled_collectives, "sdpa": bench_sdpa, "doctor": bench_doctor}


def main(argv: list[str]) -> int:
    if argv == ["--all-reduce-rank"]:
        _all_reduce_rank()
        return 0
    if argv == ["--compiled-collectives-rank"]:
        _compiled_collectives_rank()
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", help=f"benchmarks to run (default: all of {', '.join(BENCHMARKS)})")
    ap.add_argument("--rows", default=None, help=f"host: rows to run (default: all of {', '.join(HOST_ROWS)})")
    ap.add_argument("--quick", action="store_true", help="host: a few iterations only (checks the benchmark runs)")
    args = ap.parse_args(argv)
    unknown = [n for n in args.names if n not in BENCHMARKS]
    if unknown:
        ap.error(f"unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(BENCHMARKS)}")
    rows = args.rows.split(",") if args.rows else None
    bad = [r for r in rows or () if r not in HOST_ROWS]
    if bad:
        ap.error(f"unknown host row(s) {', '.join(bad)}; choose from {', '.join(HOST_ROWS)}")
    for name in args.names or BENCHMARKS:
        if name == "host":
            bench_host(rows, args.quick)
        else:
            BENCHMARKS[name]()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
