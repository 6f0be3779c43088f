"""Findings from what the recorder saw: each with a level (info < warning < error), a category, the source line
and, where one applies, what to do."""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Any

LEVELS = ("info", "warning", "error")

# TPU tiles: a matrix operand's last dimension maps to 128 lanes, the one before to 8 sublanes (16 in bfloat16,
# whose values pack two per 32-bit word); the MXU multiplies 128x128 blocks (256 on v6e).
LANE = 128


@dataclasses.dataclass
class Finding:
    level: str
    category: str
    title: str
    site: str | None = None
    detail: str = ""
    suggestion: str = ""

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _pad(n: int, to: int) -> int:
    return max(to, int(math.ceil(n / to)) * to) if n > 0 else 0


def _sublane(dtype: str) -> int:
    return 16 if dtype in ("bfloat16", "float16") else 8


def matmul_dims(op: str, shapes: tuple, dtype: str) -> tuple[int, int, int, int] | None:
    """(batch, M, K, N) of a matmul-like op from its operand shapes, or None."""
    base = op.split(".", 1)[0]
    try:
        if base in ("mm",):
            (m, k), (_, n) = shapes[0], shapes[1]
            return 1, m, k, n
        if base in ("addmm",):
            (m, k), (_, n) = shapes[1], shapes[2]
            return 1, m, k, n
        if base in ("bmm",):
            (b, m, k), (_, _, n) = shapes[0], shapes[1]
            return b, m, k, n
        if base in ("baddbmm", "addbmm"):
            (b, m, k), (_, _, n) = shapes[1], shapes[2]
            return b, m, k, n
        if base in ("convolution", "_convolution", "convolution_overrideable"):
            x, w = shapes[0], shapes[1]
            # channels map to lanes: K = input channels per group x kernel window, N = output channels
            window = math.prod(w[2:]) if len(w) > 2 else 1
            spatial = math.prod(x[2:]) if len(x) > 2 else 1
            return 1, x[0] * spatial, w[1] * window, w[0]
        if base == "linear":
            x, w = shapes[0], shapes[1]
            return 1, math.prod(x[:-1]), x[-1], w[0]
    except (ValueError, IndexError, TypeError):
        return None
    return None


def padding_waste(b: int, m: int, k: int, n: int, dtype: str, op: str) -> float:
    base = op.split(".", 1)[0]
    if base.startswith("conv") or base.startswith("_conv"):  # only the channels pad: N and the per-tap channels
        useful = n
        padded = _pad(n, LANE)
        return 1.0 - useful / padded if padded else 0.0
    useful = m * k * n
    padded = _pad(m, _sublane(dtype)) * _pad(k, LANE) * _pad(n, LANE)
    return 1.0 - useful / padded if padded else 0.0


def analyze(rec: Any, warmup: int, compare: dict[str, Any] | None, exc_info: dict[str, Any] | None,
            fallback_counts: dict[str, int]) -> list[Finding]:
    out: list[Finding] = []
    n_steps = max(1, len(rec.steps))

    # -- operator coverage --
    missing_ops: dict[str, list[tuple[str | None, int]]] = {}
    for (op, site), n in rec.no_kernel.items():
        missing_ops.setdefault(op, []).append((site, n))
    for op, sites in sorted(missing_ops.items()):
        fell_back = fallback_counts.get(f"aten::{op}", fallback_counts.get(op, 0))
        for site, n in sites:
            if fell_back:
                out.append(Finding("warning", "coverage", f"aten::{op} has no tpu kernel: ran on CPU through the "
                                   f"opt-in fallback ({n} call(s) here, {fell_back} in all)", site,
                                   "each call copies its inputs to the host and the results back",
                                   "add a kernel (docs/adding_kernels.md) or open an issue; meanwhile keep "
                                   "TORCH_TPU_CPU_FALLBACK=warn"))
            else:
                out.append(Finding("error", "coverage", f"aten::{op} has no tpu kernel ({n} call(s))", site,
                                   "the strict default raises NotImplementedError here",
                                   "TORCH_TPU_CPU_FALLBACK=warn runs it on CPU for now; add a kernel "
                                   "(docs/adding_kernels.md) or open an issue"))
    if exc_info and exc_info.get("missing_op") and exc_info["missing_op"] not in missing_ops:
        out.append(Finding("error", "coverage", f"aten::{exc_info['missing_op']} has no tpu kernel",
                           exc_info.get("site"), "the strict default raised NotImplementedError",
                           "TORCH_TPU_CPU_FALLBACK=warn runs it on CPU for now"))

    # -- recompilations --
    groups: dict[tuple[str, str | None], list[dict[str, Any]]] = {}
    for c in rec.compiles:
        if c["what"] == "an XLA program" and c["site"] is None:
            continue
        groups.setdefault((c["what"], c["site"]), []).append(c)
    per_site: dict[str | None, dict[str, Any]] = {}
    for (what, site), cs in groups.items():
        # A recompilation: a compile for input shapes this site had not compiled in an earlier step. Several
        # shapes in one step are warm-up (several layers at one line); the same shapes again are not a change.
        first_step = cs[0]["step"]
        seen: list[Any] = []
        new_later: list[dict[str, Any]] = []
        for c in cs:
            if c["shapes"] not in seen:
                # Another number or rank of inputs is another program (a fused step whose optimizer state now
                # exists), not the same one for new sizes.
                if c["step"] > first_step and any(_structure(c["shapes"]) == _structure(o) for o in seen):
                    new_later.append(c)
                seen.append(c["shapes"])
        if "DEFER_AND_FUSE" in what:
            # A fused graph's inputs may keep their shapes while shapes inside it change (tensors made on the
            # device): any compile at this line after the warm-up steps is a new graph.
            fused_later = [c for c in cs if c["step"] > first_step and c["step"] >= warmup]
            if fused_later and not new_later:
                g = per_site.setdefault(site, {"ops": [], "shapes": [cs[0]["shapes"]], "steps": set(),
                                               "what": what, "inner": True})
                g["ops"].append(what)
                g["steps"].update(c["step"] for c in fused_later)
                continue
        if not new_later:
            continue
        shapes = [c["shapes"] for c in cs if c["step"] == first_step][:1] + [c["shapes"] for c in new_later]
        steps = sorted({c["step"] for c in new_later})
        g = per_site.setdefault(site, {"ops": [], "shapes": shapes, "steps": set(), "what": what})
        g["ops"].append(what)
        g["steps"].update(steps)
    for site, g in per_site.items():
        changed = "" if g.get("inner") else _changed_dims(g["shapes"])
        ops = g["ops"]
        out.append(Finding(
            "warning", "recompilation",
            f"{', '.join(ops[:4])}{f' and {len(ops) - 4} more' if len(ops) > 4 else ''} compiled again for new "
            f"input shapes in {len(g['steps'])} later step(s)" if not g.get("inner") else
            f"{', '.join(ops[:1])} compiled again in {len(g['steps'])} later step(s) (new shapes inside the graph)",
            site,
            (f"its inputs kept their shapes ({_short(g['shapes'][0])[:200]}): shapes inside the graph changed "
             "(e.g. of tensors made on the device); the graph ran at this line" if g.get("inner") else
             f"{ops[0]} shapes: {', '.join(_short(s) for s in g['shapes'][:6])}"
             f"{' ...' if len(g['shapes']) > 6 else ''}" + (f"; changing: {changed}" if changed else "")),
            _recompile_advice(changed, g["what"])))

    # -- host synchronisations --
    steady = rec.steps[warmup:]  # per-step findings read the steady state only (none before it exists)
    for (what, site), n in sorted(rec.syncs.items(), key=lambda kv: -kv[1]):
        in_steps = len(rec.sync_steps[(what, site)])
        per_step = n / n_steps
        level = "warning" if (in_steps >= 2 and per_step > 1.0) or "data-dependent" in what else "info"
        out.append(Finding(level, "sync", f"host synchronisation: {what}, {n} time(s) in {in_steps} step(s) "
                           f"({per_step:.1g} per step)", site,
                           "the host waits for the device here: on a TPU every one stalls the pipeline",
                           _sync_advice(what)))

    # -- TPU-unfriendly patterns --
    flops_total = 0.0
    flops32 = 0.0
    by_site: dict[tuple[str, str | None], list[Any]] = {}  # (op, site) -> [wasted flops, flops, calls, shapes]
    f32_sites: dict[str | None, float] = {}
    for (op, shapes, dtype, site), n in rec.matmuls.items():
        dims = matmul_dims(op, shapes, dtype)
        if dims is None:
            continue
        b, m, k, nn = dims
        flops = 2.0 * b * m * k * nn * n
        flops_total += flops
        if dtype == "float32":
            flops32 += flops
            f32_sites[site] = f32_sites.get(site, 0.0) + flops
        w = padding_waste(b, m, k, nn, dtype, op)
        if w >= 0.25:
            g = by_site.setdefault((op, site), [0.0, 0.0, 0, []])
            g[0] += w * flops
            g[1] += flops
            g[2] += n
            g[3].append(f"({m}, {k}, {nn}){f' x {b}' if b > 1 else ''} {dtype}: {w:.0%}")
    for (op, site), (wf, fl, n, shapes) in sorted(by_site.items(), key=lambda kv: -kv[1][0])[:8]:
        out.append(Finding(
            "info", "tpu-shapes", f"aten::{op}: ~{wf / fl:.0%} of its TPU matrix-unit work would be padding", site,
            f"(M, K, N) and padding share: {'; '.join(shapes[:4])}{' ...' if len(shapes) > 4 else ''} ({n} call(s)); "
            f"TPU tiles are 8 rows (16 in bfloat16) x {LANE} columns and sizes round up to them",
            f"use multiples of {LANE} for feature/channel dimensions where the model allows"))
    if flops_total and flops32 / flops_total >= 0.5:
        top = max(f32_sites.items(), key=lambda kv: kv[1])[0]
        out.append(Finding("info", "dtype", f"{flops32 / flops_total:.0%} of matmul/convolution work is float32",
                           top, "TPU matrix units run bfloat16 natively; float32 matmuls take several passes",
                           "wrap the forward pass in `with torch.autocast('tpu'):` (bfloat16; no GradScaler "
                           "needed)"))
    total_ops = sum(rec.op_counts.values()) or 1
    n64 = sum(rec.int64_ops.values())
    if n64 / total_ops >= 0.2 and n64 >= 10:
        site = max(rec.int64_ops.items(), key=lambda kv: kv[1])[0][1]
        out.append(Finding("info", "dtype", f"{n64} of {total_ops} tpu ops ({n64 / total_ops:.0%}) compute in int64",
                           site, "TPUs have no native 64-bit integer arithmetic: it is emulated",
                           "use int32 for indices and counters where the range allows"))
    unfused = [s.unfused_ops for s in steady]
    tiny = [s.tiny_unfused_ops for s in steady]
    if unfused and statistics.median(unfused) >= 20 and statistics.median(tiny) >= 0.5 * statistics.median(unfused):
        out.append(Finding("info", "fusion", f"{statistics.median(unfused):.0f} ops per step ran one at a time, "
                           f"{statistics.median(tiny):.0f} of them on fewer than 4096 elements", None,
                           "outside a fused or compiled program each op is its own launch: on a TPU such small "
                           "ops are bound by dispatch, not compute",
                           "torch.tpu.eager_mode = torch.tpu.EagerMode.DEFER_AND_FUSE, torch.compile(model, "
                           "backend='tpu'), or capture the step once with torch.tpu.graph and replay() it (CUDA "
                           "graphs' API: no Python per op)"))
    h2d = [s.h2d_bytes for s in steady]
    if h2d and statistics.median(h2d) >= (1 << 20):
        site = max(((k, v) for k, v in rec.transfers.items() if k[0] == "host to device"),
                   key=lambda kv: kv[1], default=((None, None), 0))[0][1]
        out.append(Finding("info", "transfer", f"{statistics.median(h2d) / 2**20:.1f} MiB copied host to device "
                           "per step", site, "host-to-device copies are on the step's critical path",
                           "keep data on the device, or overlap copies (`.to('tpu', non_blocking=True)`, "
                           "prefetch the next batch)"))

    # -- correctness --
    if compare is not None:
        if compare.get("error"):
            out.append(Finding("warning", "correctness", "the CPU comparison run failed", None,
                               compare["error"], ""))
        else:
            rows = compare.get("steps", [])
            bad = [r for r in rows if not r["ok"]]
            if bad:
                r = bad[0]
                out.append(Finding("error", "correctness", f"step {r['step']}: tpu loss {r['tpu']:.6g} vs CPU "
                                   f"{r['cpu']:.6g} (relative difference {r['rel']:.2e} > {compare['rtol']:g})",
                                   None, compare["what"], "rerun with DEFER_NEVER_AND_LAUNCH_BLOCKING and compare "
                                   "intermediate values with CPU"))
            elif not rows:
                out.append(Finding("warning", "correctness", "nothing was compared: no scalar passed to "
                                   ".backward() was seen", None, compare["what"], ""))

    # -- the script itself --
    if exc_info and exc_info.get("type"):
        out.append(Finding("error", "script", f"the script raised {exc_info['type']}: {exc_info['message'][:300]}",
                           exc_info.get("site"), "", ""))
    return out


def _structure(shapes: Any) -> Any:
    """The number and ranks of the inputs: shapes with the sizes left out."""
    if isinstance(shapes, (list, tuple)):
        if all(isinstance(d, int) for d in shapes):
            return len(shapes)
        return tuple(_structure(s) for s in shapes)
    return shapes


def _short(shapes: Any) -> str:
    return str(shapes).replace(" ", "")


def _changed_dims(shapes: list[Any]) -> str:
    """Which argument dimensions differ between the compiled shape lists: 'arg 0 dim 0: 3, 4, 5'."""
    flat = [_flatten(s) for s in shapes]
    if len({len(f) for f in flat}) != 1:
        return "the number or rank of the inputs"
    parts = []
    for i in range(len(flat[0])):
        vals = [f[i][1] for f in flat]
        if len(set(vals)) > 1:
            arg, dim = flat[0][i][0]
            seen = []
            for v in vals:
                if v not in seen:
                    seen.append(v)
            parts.append(f"arg {arg} dim {dim}: {', '.join(map(str, seen[:8]))}")
    return "; ".join(parts[:4])


def _flatten(shapes: Any) -> list[tuple[tuple[int, int], Any]]:
    out = []
    for a, s in enumerate(shapes or []):
        if isinstance(s, (list, tuple)) and all(isinstance(d, int) for d in s):
            out.extend(((a, d), v) for d, v in enumerate(s))
        else:
            out.append(((a, -1), str(s)))
    return out


def _recompile_advice(changed: str, what: str) -> str:
    tips = []
    if "dim 0" in changed and changed.count("dim") <= 2:
        tips.append("a fixed batch size (DataLoader(drop_last=True), or pad the last batch)")
    if changed:
        tips.append("pad/bucket the changing dimension to a few sizes (e.g. multiples of 128 or powers of two)")
    if "DEFER_AND_FUSE" in what:
        tips.append("keep the shapes of the step's tensors fixed (pad/bucket them); a dimension that must vary "
                    "compiles once per size")
    elif "graph" in what or "program" in what:
        tips.append("under torch.compile, torch._dynamo.mark_dynamic(tensor, dim) for a dimension that must vary")
    return "; ".join(tips) or "keep input shapes static"


def _sync_advice(what: str) -> str:
    if "item" in what:
        return "read values less often (accumulate on the device, read every N steps), or keep them as tensors"
    if "data-dependent" in what:
        return "use a static-shape form (torch.where / masks, nonzero_static, a fixed-size topk) instead"
    if "printing" in what:
        return "print less often, or print values read once with .item() every N steps"
    if "cpu" in what:
        return "keep the value on the device; move results to the host every N steps"
    if "synchronize" in what:
        return "needed only for timing; drop it from the training loop"
    return "avoid host reads inside the step"
