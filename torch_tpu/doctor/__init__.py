"""`python -m torch_tpu.doctor [options] script.py [args]` and `torch.tpu.doctor.run(fn, ...)`: a TPU-readiness
report for a user's unchanged script, run on the tpu device (XLA:CPU when there is no TPU).

It reports operator coverage (ops without a tpu kernel, CPU fallbacks per op and call site, ops outside fused or
compiled programs), recompilations with the shapes that changed, host synchronisations with their source lines,
TPU-unfriendly shapes and dtypes, the first step split into tracing, compilation and the rest against the steady
state, optionally the loss per step against CPU PyTorch, and memory; in the terminal, as JSON (`--json`) and as a
self-contained HTML page with plots (`--html`). See docs/user_guide.md, "The doctor".

This is a top layer: it reads the runtime's metrics (torch_tpu/_metrics.py, whose `observer` switch it turns on
for the run) and nothing in the runtime imports it.
"""

from __future__ import annotations

import os
import runpy
import sys
import time
import traceback
from typing import Any, Callable

import torch
from torch.optim import optimizer as _optim

from torch_tpu.doctor._analyze import LEVELS, Finding, analyze
from torch_tpu.doctor._record import Recorder, Sites, StopRun

__all__ = ["run", "run_script", "Report", "Finding", "LEVELS"]

WARMUP_STEPS = 2


class Report(dict):
    """The report as a JSON-able dict (`findings`, `steps`, `timeline`, `coverage`, ...), with `.findings` as
    Finding objects and `.text()`, `.html()` renderings."""

    findings: list[Finding]

    def worst(self) -> str | None:
        levels = [f.level for f in self.findings]
        for lv in reversed(LEVELS):
            if lv in levels:
                return lv
        return None

    def exit_status(self, fail_on: str = "error") -> int:
        """0: nothing at or above `fail_on`; 1: findings at or above it; 3: the script raised."""
        if self["script"].get("exception"):
            return 3
        if fail_on == "never":
            return 0
        at = LEVELS.index(fail_on)
        return 1 if any(LEVELS.index(f.level) >= at for f in self.findings) else 0

    def text(self) -> str:
        from torch_tpu.doctor._report import text

        return text(self)

    def html(self) -> str:
        from torch_tpu.doctor._report import html

        return html(self)


def _exception_info(e: BaseException, sites: Sites) -> dict[str, Any]:
    tb = e.__traceback__
    site = None
    for frame, line in traceback.walk_tb(tb):
        if sites.is_user(frame.f_code.co_filename):
            site = f"{frame.f_code.co_filename}:{line}"
    msg = str(e)
    info: dict[str, Any] = {"type": type(e).__name__, "message": msg, "site": site,
                            "traceback": "".join(traceback.format_exception(type(e), e, tb))[-4000:]}
    if isinstance(e, NotImplementedError) and "has no tpu kernel" in msg:
        import re

        m = re.search(r"operator '([^']+)'", msg)
        if m:
            info["missing_op"] = m.group(1).removeprefix("aten::")
    return info


def _call(fn: Callable[[], Any], rec: Recorder) -> tuple[str, dict[str, Any] | None]:
    """Runs fn under the recorder; (how it ended, exception info)."""
    rec.start()
    ended, exc = "finished", None
    try:
        fn()
    except StopRun as e:
        ended = str(e)
    except SystemExit as e:
        if e.code not in (None, 0):
            ended = f"exited with status {e.code}"
            exc = {"type": "SystemExit", "message": f"status {e.code}", "site": None}
    except KeyboardInterrupt:
        ended = "interrupted"
    except BaseException as e:  # noqa: BLE001 - the report is written whatever the script raised
        ended = "raised"
        exc = _exception_info(e, rec.sites)
    finally:
        rec.stop()
    return ended, exc


class _ToCpu(torch.overrides.TorchFunctionMode):
    """The CPU comparison run: `device=` keywords and `.to(...)` targets naming tpu become cpu."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if "device" in kwargs and _is_tpu(kwargs["device"]):
            kwargs["device"] = "cpu"
        if getattr(func, "__name__", "") in ("to", "tpu") and args:
            args = tuple("cpu" if _is_tpu(a) else a for a in args)
            if getattr(func, "__name__", "") == "tpu":
                return args[0].cpu()
        return func(*args, **kwargs)


def _is_tpu(d: Any) -> bool:
    try:
        return isinstance(d, (str, torch.device)) and torch.device(d).type == "tpu"
    except (RuntimeError, TypeError):
        return False


def _compare_cpu(fn_cpu: Callable[[], Any], tpu_losses: list[torch.Tensor], steps: int, seed: int,
                 rtol: float, what: str) -> dict[str, Any]:
    cpu_losses: list[float] = []
    orig = torch.Tensor.backward

    inside = []

    def backward(t: torch.Tensor, *a: Any, **k: Any) -> Any:
        if inside:  # Tensor.backward re-entered through the device-mapping mode's __torch_function__
            return orig(t, *a, **k)
        if t.numel() == 1 and len(cpu_losses) < steps:
            cpu_losses.append(float(t.detach().double()))
        inside.append(1)
        try:
            return orig(t, *a, **k)
        finally:
            inside.pop()

    def stop(opt: Any, args: Any, kwargs: Any) -> None:
        if len(cpu_losses) >= steps:
            raise StopRun("compared steps done")

    handle = _optim.register_optimizer_step_post_hook(stop)
    torch.Tensor.backward = backward  # type: ignore[method-assign]
    error = None
    try:
        torch.manual_seed(seed)
        with _ToCpu():
            fn_cpu()
    except StopRun:
        pass
    except SystemExit as e:
        if e.code not in (None, 0):
            error = f"the CPU run exited with status {e.code}"
    except BaseException as e:  # noqa: BLE001
        error = f"the CPU run raised {type(e).__name__}: {e}"
    finally:
        torch.Tensor.backward = orig  # type: ignore[method-assign]
        handle.remove()
    tpu = [float(t.double().cpu()) for t in tpu_losses]
    rows = []
    for i, (a, b) in enumerate(zip(tpu, cpu_losses)):
        rel = abs(a - b) / max(abs(b), 1e-12)
        rows.append({"step": i + 1, "tpu": a, "cpu": b, "abs": abs(a - b), "rel": rel, "ok": rel <= rtol})
    return {"what": what, "rtol": rtol, "steps": rows, "error": error}


def run(fn: Callable[..., Any], *args: Any, steps: int | None = None, seconds: float | None = None,
        compare_cpu: bool = False, compare_steps: int = 5, rtol: float = 1e-3, seed: int = 0,
        html: str | None = None, json: str | None = None, quiet: bool = True, **kwargs: Any) -> Report:
    """Runs `fn(*args, **kwargs)` under the doctor (in a notebook: `torch.tpu.doctor.run(train, steps=10)`) and
    returns the Report; `html=`/`json=` also write those files. With `compare_cpu`, `fn` runs again with `device=`
    keywords and `.to()` targets naming tpu mapped to cpu."""
    return _run(lambda: fn(*args, **kwargs), lambda: fn(*args, **kwargs), script=None, name=getattr(
        fn, "__qualname__", repr(fn)), steps=steps, seconds=seconds, compare_cpu=compare_cpu,
        compare_steps=compare_steps, rtol=rtol, seed=seed, html_path=html, json_path=json, quiet=quiet)


def run_script(path: str, argv: list[str], **options: Any) -> Report:
    """Runs the script at `path` as `__main__` with `sys.argv = [path, *argv]` under the doctor."""
    path = os.path.abspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"torch_tpu.doctor: no script at {path}: give the path of a Python file, e.g. "
                                "python -m torch_tpu.doctor train.py --epochs 1")

    def make(args: list[str]) -> Callable[[], Any]:
        def go() -> None:
            old_argv, old_path = sys.argv, list(sys.path)
            sys.argv = [path, *args]
            sys.path.insert(0, os.path.dirname(path))
            try:
                runpy.run_path(path, run_name="__main__")
            finally:
                sys.argv, sys.path[:] = old_argv, old_path
        return go

    cpu_argv = [("cpu" + a[3:] if a == "tpu" or a.startswith("tpu:") else a) for a in argv]
    return _run(make(argv), make(cpu_argv), script=path, name=" ".join([path, *argv]), **options)


def _run(fn: Callable[[], Any], fn_cpu: Callable[[], Any], *, script: str | None, name: str,
         steps: int | None = None, seconds: float | None = None, compare_cpu: bool = False, compare_steps: int = 5,
         rtol: float = 1e-3, seed: int = 0, html_path: str | None = None, json_path: str | None = None,
         quiet: bool = True) -> Report:
    from torch_tpu import device_module

    import torch.optim  # noqa: F401  (imports torch._dynamo on first use: not the script's first step)

    if steps is not None and steps < 1:
        raise ValueError(f"torch_tpu.doctor: steps={steps}: give a positive number of steps (or none)")
    if seconds is not None and seconds <= 0:
        raise ValueError(f"torch_tpu.doctor: seconds={seconds}: give a positive time limit (or none)")
    device_module.synchronize()
    torch.manual_seed(seed)
    device_module.reset_metrics()
    cache0 = device_module.compile_cache.stats()
    rec = Recorder(script, steps=steps, seconds=seconds, record_losses=compare_steps if compare_cpu else 0)
    t0 = time.perf_counter()
    ended, exc = _call(fn, rec)
    wall = time.perf_counter() - t0
    cache1 = device_module.compile_cache.stats()
    fallback = device_module.fallback_report()
    compare = None
    if compare_cpu:
        what = ("the value passed to .backward() (the loss) at each of the first optimizer steps: the tpu run "
                "against the same script on CPU PyTorch from the same seed (torch.manual_seed(%d)), with 'tpu' in "
                "its arguments, device= keywords and .to() targets replaced by 'cpu'" % seed) if script else (
                "the value passed to .backward() at each of the first optimizer steps: fn on tpu against fn "
                "with device= keywords and .to() targets mapped to cpu, from the same seed")
        n = min(compare_steps, len(rec.losses))
        compare = _compare_cpu(fn_cpu, rec.losses[:n], n, seed, rtol, what) if n else {
            "what": what, "rtol": rtol, "steps": [], "error": None}
    report = _build(rec, name, script, ended, exc, wall, cache0, cache1, fallback, compare)
    if json_path:
        import json as _json

        with open(json_path, "w") as f:
            _json.dump(report, f, indent=1, default=str)
    if html_path:
        with open(html_path, "w") as f:
            f.write(report.html())
    if not quiet:
        print(report.text())
    return report


def _build(rec: Recorder, name: str, script: str | None, ended: str, exc: dict[str, Any] | None, wall: float,
           cache0: Any, cache1: Any, fallback: dict[str, int], compare: dict[str, Any] | None) -> Report:
    from torch_tpu import device_module

    steps = rec.steps
    if rec.optimizer_steps and len(steps) > rec.optimizer_steps:
        steps = steps[:rec.optimizer_steps]  # the tail after the last optimizer step is not a step (its syncs and
        # ops still count in the totals)
    rec.steps = steps
    findings = analyze(rec, WARMUP_STEPS, compare, exc, fallback)
    first = steps[0] if steps else None
    steady = [s.seconds for s in steps[WARMUP_STEPS:]] or [s.seconds for s in steps[1:]]
    hits = getattr(cache1, "hits", 0) - getattr(cache0, "hits", 0)
    misses = getattr(cache1, "misses", 0) - getattr(cache0, "misses", 0)
    m = rec.metrics_end
    report = Report(
        version=1,
        script={"run": name, "path": script, "ended": ended, "exception": exc, "seconds": round(wall, 4),
                "platform": device_module.platform() if device_module.is_initialized() else None,
                "device": (device_module.get_device_name() if device_module.is_initialized() else None),
                "eager_mode": device_module.default_eager_mode().name},
        summary={lv: sum(f.level == lv for f in findings) for lv in LEVELS},
        findings=[f.as_dict() for f in findings],
        steps=[{"step": s.index + 1, "seconds": round(s.seconds, 6), "compiles": s.compiles,
                "compile_seconds": round(s.compile_seconds, 6), "trace_seconds": round(s.trace_seconds, 6),
                "syncs": s.syncs, "ops": s.ops, "unfused_ops": s.unfused_ops, "h2d_bytes": s.h2d_bytes,
                "d2h_bytes": s.d2h_bytes, "peak_bytes": s.peak_bytes} for s in steps],
        step_kind="optimizer steps" if rec.optimizer_steps else "the whole run (no optimizer.step() was seen)",
        timeline={
            "first_step_seconds": round(first.seconds, 6) if first else None,
            "first_step_tracing_seconds": round(first.trace_seconds, 6) if first else None,
            "first_step_compile_seconds": round(first.compile_seconds, 6) if first else None,
            "first_step_other_seconds": round(max(0.0, first.seconds - first.trace_seconds
                                                  - first.compile_seconds), 6) if first else None,
            "first_step_compiles": first.compiles if first else 0,
            "steady_step_seconds": round(sorted(steady)[len(steady) // 2], 6) if steady else None,
            "warmup_steps": WARMUP_STEPS,
            "persistent_cache_hits": hits, "persistent_cache_misses": misses,
            "compiles": m.compiles, "compile_seconds": m.compile_seconds,
        },
        coverage={
            "tpu_ops": dict(rec.op_counts.most_common()),
            "no_kernel": [{"op": op, "site": site, "calls": n} for (op, site), n in rec.no_kernel.items()],
            "cpu_fallbacks": fallback,
            "outside_fused_or_compiled": dict(rec.unfused.most_common()),
            "fused_graph_runs": m.fused_graph_runs, "flushes": m.flushes,
        },
        recompilations=[c for c in rec.compiles],
        syncs=[{"what": w, "site": s, "count": n, "steps": len(rec.sync_steps[(w, s)])}
               for (w, s), n in rec.syncs.most_common()],
        transfers=[{"direction": d, "site": s, "bytes": b, "calls": rec.transfer_calls[(d, s)]}
                   for (d, s), b in rec.transfers.most_common()],
        memory={"peak_bytes_per_step": [s.peak_bytes for s in steps],
                "largest_tensors": [{"bytes": b, "op": op, "tensor": t, "site": s} for b, op, t, s in rec.largest]},
        correctness=compare,
    )
    report.findings = findings
    return report
