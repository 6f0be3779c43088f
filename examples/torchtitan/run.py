"""TorchTitan 0.3.0's llama3_debugmodel on tpu, checked against the same run on CPU/gloo.

    python examples/torchtitan/run.py                 # 1 process, then FSDP on 2 (torchrun), tpu vs cpu
    python examples/torchtitan/run.py --nproc 1       # one process only
    tools/torchtitan_check                            # the same, with the project's .venv

Run it with the Python that has torch_tpu installed (the project's .venv). It
1. makes a venv under the cache dir (--cache, default ~/.cache/torch_tpu/torchtitan-0.3.0) that sees that
   Python's packages through a .pth file and pip-installs torchtitan==0.3.0 (or --wheel) and its
   dependencies, with torch, jax, jaxlib and numpy pinned to the versions already installed;
2. makes the offline assets: TorchTitan's llama3_debugmodel reads `./tests/assets/tokenizer` and the
   `c4_test` dataset from its source repository, which neither the wheel nor the sdist ships. The stand-ins
   are a byte-level BPE tokenizer (2000 tokens + <|begin_of_text|>/<|end_of_text|>, within the model's
   2048-entry vocabulary) trained with `tokenizers` on, and a `c4_test`-shaped JSON-lines dataset
   ({"text": ...}) made of, the source files of the installed torchtitan package (deterministic);
3. writes one seed checkpoint on CPU (TorchTitan's own --checkpoint.create_seed_checkpoint): the tpu and
   CPU generators differ, so both runs start from these weights (loaded through DCP);
4. trains `--module llama3 --config llama3_debugmodel` (TorchTitan's own config and CLI; steps, sequence
   length and batch size shortened on the command line so XLA:CPU finishes in minutes) on tpu and on CPU,
   on one process and with FSDP (data_parallel_shard_degree = nproc) under torchrun; tpu runs use
   tpu_dist, CPU runs gloo. TORCH_TPU_CPU_FALLBACK is removed from the runs' environment (strict);
5. prints the losses side by side and exits 1 when any step differs by more than --tol.
What examples/torchtitan/_entry.py changes in each training process is listed in its docstring and in
docs/user_guide.md ("TorchTitan").
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TITAN_VERSION = "0.3.0"
# What TorchTitan 0.3.0's training path imports beyond its own metadata: triton (torchtitan.train imports
# torchtitan/distributed/minimal_async_ep/kernels.py, which imports it at module level; no kernel of it runs).
EXTRA = ["triton"]
PINNED = ["torch", "jax", "jaxlib", "numpy"]

_MAKE_ASSETS = r"""
import json, pathlib, sys
import torchtitan
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

out = pathlib.Path(sys.argv[1])
(out / "tokenizer").mkdir(parents=True, exist_ok=True)
(out / "c4_test").mkdir(parents=True, exist_ok=True)
root = pathlib.Path(torchtitan.__file__).parent
texts = [t for p in sorted(root.rglob("*.py")) if len(t := p.read_text(encoding="utf-8", errors="replace")) > 200]
with open(out / "c4_test" / "data.json", "w") as f:
    for t in texts:
        f.write(json.dumps({"text": t}) + "\n")
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
special = ["<|begin_of_text|>", "<|end_of_text|>"]
trainer = trainers.BpeTrainer(vocab_size=2000, special_tokens=special, show_progress=False,
                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
tok.train_from_iterator(texts, trainer)
tok.save(str(out / "tokenizer" / "tokenizer.json"))
(out / "tokenizer" / "tokenizer_config.json").write_text(json.dumps(
    {"bos_token": special[0], "eos_token": special[1], "tokenizer_class": "PreTrainedTokenizerFast"}))
print(len(texts), tok.get_vocab_size())
"""

STEP_RE = re.compile(r"step:\s*(\d+)\s+loss:\s*([-+0-9.eEnaNinf]+)")


def _log(msg: str) -> None:
    print(f"[torchtitan_check] {msg}", flush=True)


def ensure_env(cache: Path, wheel: str | None) -> Path:
    venv = cache / "venv"
    py = venv / "bin" / "python"
    marker = venv / ".torch_tpu_ready"
    pins = {name: importlib.metadata.version(name) for name in PINNED}
    want = json.dumps({"titan": wheel or TITAN_VERSION, **pins}, sort_keys=True)
    if marker.exists() and marker.read_text() == want:
        return py
    _log(f"setting up {venv} (torchtitan {TITAN_VERSION}; pinned: {pins})")
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--clear", str(venv)], check=True)
    purelib = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    import sysconfig

    Path(purelib, "_torch_tpu_host.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    constraints = cache / "constraints.txt"
    constraints.write_text("".join(f"{n}=={v}\n" for n, v in pins.items()))
    titan = wheel or f"torchtitan=={TITAN_VERSION}"
    subprocess.run([py, "-m", "pip", "install", "-q", "-c", str(constraints), titan, *EXTRA], check=True)
    check = subprocess.run([py, "-c", "import torch, jax, numpy, torchtitan; print(torch.__version__, "
                            "jax.__version__, numpy.__version__)"], check=True, capture_output=True, text=True, cwd="/")
    got = check.stdout.split()
    if got != [pins["torch"], pins["jax"], pins["numpy"]]:
        sys.exit(f"torchtitan venv moved the pinned packages: {got} vs {pins}")
    marker.write_text(want)
    return py


def ensure_assets(py: Path, cache: Path) -> Path:
    assets = cache / "assets"
    if not (assets / "tokenizer" / "tokenizer.json").exists() or not (assets / "c4_test" / "data.json").exists():
        _log(f"making offline tokenizer and c4_test stand-in in {assets}")
        subprocess.run([py, "-c", _MAKE_ASSETS, str(assets)], check=True, cwd="/")
    return assets


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(device: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("TORCH_TPU_CPU_FALLBACK", None)
    env["PYTHONUNBUFFERED"] = "1"
    if device == "cpu":
        env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
    return env


def titan(py: Path, device: str, nproc: int, args: list[str], log: Path, timeout: float) -> str:
    cmd = [str(py), "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--rdzv_backend=c10d",
           f"--rdzv_endpoint=127.0.0.1:{_free_port()}", "--local-ranks-filter=0", "--role=rank",
           "--tee=3", str(HERE / "_entry.py"), "--device", device, "--", *args]
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=_env(device), timeout=timeout,
                                cwd=log.parent).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    out = log.read_text(errors="replace")
    if rc != 0:
        tail = "\n".join(out.splitlines()[-40:])
        raise RuntimeError(f"{device} x{nproc} failed (rc={rc}, {time.time() - t0:.0f}s); log {log}:\n{tail}")
    _log(f"{device} x{nproc}: done in {time.time() - t0:.0f}s (log {log})")
    return out


def losses(out: str) -> dict[int, float]:
    return {int(m.group(1)): float(m.group(2)) for m in STEP_RE.finditer(out)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cache", default=os.path.expanduser("~/.cache/torch_tpu/torchtitan-" + TITAN_VERSION))
    ap.add_argument("--wheel", help="a torchtitan 0.3.0 wheel to install instead of the registry's")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=2, help="local batch size")
    ap.add_argument("--nproc", default="1,2", help="process counts to run, e.g. 1,2")
    ap.add_argument("--tol", type=float, default=1e-3, help="largest |loss_tpu - loss_cpu| allowed per step")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds for one training run")
    ap.add_argument("--json", help="write the losses and the verdict here")
    ap.add_argument("--titan-arg", dest="titan_args", action="append", default=[],
                    help="one more torchtitan.train argument for every training run (repeatable)")
    a = ap.parse_args(argv)

    cache = Path(a.cache)
    py = ensure_env(cache, a.wheel)
    assets = ensure_assets(py, cache)
    runs = cache / "runs"
    common = ["--module", "llama3", "--config", "llama3_debugmodel",
              "--hf_assets_path", str(assets / "tokenizer"),
              "--dataloader.dataset_path", str(assets / "c4_test"),
              "--training.seq_len", str(a.seq_len), "--training.local_batch_size", str(a.batch),
              "--metrics.disable_color_printing", "--debug.seed", "42"]

    seed_dump = runs / "seed"
    seed_ckpt = seed_dump / "checkpoint" / "step-0"
    if not seed_ckpt.exists():
        titan(py, "cpu", 1, [*common, "--dump_folder", str(seed_dump), "--checkpoint.enable",
                             "--checkpoint.create_seed_checkpoint",
                             "--parallelism.data_parallel_shard_degree", "1"],
              runs / "seed.log", a.timeout)

    table: dict[str, dict[int, float]] = {}
    for nproc in [int(n) for n in a.nproc.split(",")]:
        for device in ("cpu", "tpu"):
            name = f"{device}x{nproc}"
            dump = runs / name
            # TorchTitan 0.3.0's default SPMD backend (spmd_types) stops FSDP2 at start-up under torch 2.13
            # on CPU/gloo as on tpu ("all parameters must be DTensors on the full SPMD mesh": it counts on a
            # newer fully_shard that makes DTensors from spmd_types annotations); its partial_dtensor
            # backend is the plain FSDP2 path (fully_shard over the dp mesh).
            fsdp = ["--parallelism.spmd_backend", "partial_dtensor"] if nproc > 1 else []
            args = [*common, "--training.steps", str(a.steps), "--dump_folder", str(dump),
                    "--parallelism.data_parallel_shard_degree", str(nproc), *fsdp, *a.titan_args,
                    "--checkpoint.enable", "--checkpoint.load_only",
                    "--checkpoint.folder", "checkpoint_" + name,
                    "--checkpoint.initial_load_path", str(seed_ckpt)]
            table[name] = losses(titan(py, device, nproc, args, runs / f"{name}.log", a.timeout))

    ok = True
    verdict: dict[str, float] = {}
    print(f"\n{'step':>4} " + " ".join(f"{k:>10}" for k in table) + "   max|tpu-cpu|")
    for step in range(1, a.steps + 1):
        row = [table[k].get(step, float("nan")) for k in table]
        diffs = []
        for nproc in a.nproc.split(","):
            c, t = table[f"cpux{nproc}"].get(step), table[f"tpux{nproc}"].get(step)
            diffs.append(abs(c - t) if c is not None and t is not None else float("inf"))
        worst = max(diffs)
        ok &= worst <= a.tol
        verdict[str(step)] = worst
        print(f"{step:>4} " + " ".join(f"{v:10.5f}" for v in row) + f"   {worst:.2e}")
    print(f"\n{'PASS' if ok else 'FAIL'}: tpu vs cpu/gloo losses within {a.tol:g} on every step")
    if a.json:
        Path(a.json).write_text(json.dumps({"losses": table, "max_diff": verdict, "ok": ok}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
