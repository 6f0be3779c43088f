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

    mod = _example(name)
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

        for fn in steps.values():
            for _ in range(5):
                fn()
        sync()
        n = 30 if name == "mlp" else 20
        samples: dict[str, list[float]] = {k: [] for k in steps}
        for _ in range(5):
            for k, fn in steps.items():
                t0 = time.perf_counter()
                for _ in range(n):
                    fn()
                sync()
                samples[k].append(n / (time.perf_counter() - t0))
        r = {k: statistics.median(v) for k, v in samples.items()}
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


BENCHMARKS = {"eager_overhead": bench_eager_overhead, "op_overhead": bench_op_overhead, "training": bench_training,
              "fuse": bench_fuse, "cold_start": bench_cold_start, "compile": bench_compile,
              "all_reduce": bench_all_reduce, "index_checks": bench_index_checks,
              "threads": bench_threads}


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
