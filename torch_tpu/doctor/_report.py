"""The doctor's report as terminal text and as one self-contained HTML page (inline SVG plots, no scripts, no
network)."""

from __future__ import annotations

import html as _html
from typing import Any

_COLORS = {"error": "#c0392b", "warning": "#d68910", "info": "#2e86c1"}


def _mib(n: int | float) -> str:
    return f"{n / 2**20:.2f} MiB"


def _s(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.2f} s"


def text(r: Any) -> str:
    sc, tl, cov = r["script"], r["timeline"], r["coverage"]
    out = [f"torch_tpu doctor: {sc['run']}",
           f"  device {sc['device']}, mode {sc['eager_mode']}; {len(r['steps'])} step(s) ({r['step_kind']}); "
           f"the run {sc['ended']} after {sc['seconds']:.2f} s"]
    out.append(f"  first step {_s(tl['first_step_seconds'])}: tracing {_s(tl['first_step_tracing_seconds'])}, "
               f"compilation {_s(tl['first_step_compile_seconds'])} ({tl['first_step_compiles']} compiles; "
               f"persistent cache over the run: {tl['persistent_cache_hits']} hits, "
               f"{tl['persistent_cache_misses']} misses), the rest {_s(tl['first_step_other_seconds'])}; "
               f"steady step {_s(tl['steady_step_seconds'])}")
    ops = cov["tpu_ops"]
    out.append(f"  ops: {len(ops)} distinct aten ops on tpu, {sum(ops.values())} calls; "
               f"{sum(cov['outside_fused_or_compiled'].values())} ran outside fused/compiled programs; "
               f"no tpu kernel: {len(cov['no_kernel'])}; CPU fallbacks: "
               f"{', '.join(f'{k}={v}' for k, v in cov['cpu_fallbacks'].items()) or 'none'}")
    peaks = r["memory"]["peak_bytes_per_step"]
    if peaks:
        out.append(f"  peak device memory per step: max {_mib(max(peaks))}")
    c = r.get("correctness")
    if c and c.get("steps"):
        worst = max(row["rel"] for row in c["steps"])
        out.append(f"  compared with CPU over {len(c['steps'])} step(s): largest relative loss difference "
                   f"{worst:.2e} (tolerance {c['rtol']:g})")
    s = r["summary"]
    out.append(f"findings: {s['error']} error(s), {s['warning']} warning(s), {s['info']} info")
    for f in r["findings"]:
        out.append(f"  [{f['level']}] {f['category']}: {f['title']}")
        if f["site"]:
            out.append(f"      at {f['site']}")
        if f["detail"]:
            out.append(f"      {f['detail']}")
        if f["suggestion"]:
            out.append(f"      -> {f['suggestion']}")
    return "\n".join(out)


def _bars(values: list[float], labels: list[str], colors: list[str], title: str, unit: str,
          width: int = 900, height: int = 260) -> str:
    """An inline SVG bar chart."""
    pad_l, pad_b, pad_t = 70, 40, 30
    n = max(1, len(values))
    top = max(values) if values and max(values) > 0 else 1.0
    bw = (width - pad_l - 10) / n
    parts = [f'<svg class="plot" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}">',
             f'<rect x="0" y="0" width="{width}" height="{height}" fill="#ffffff"/>',
             f'<text x="{pad_l}" y="18" font-size="14" font-family="sans-serif">{_html.escape(title)}</text>']
    h = height - pad_b - pad_t
    for i in range(5):
        y = pad_t + h - h * i / 4
        parts.append(f'<line x1="{pad_l}" y1="{y:.1f}" x2="{width - 10}" y2="{y:.1f}" stroke="#dddddd"/>')
        parts.append(f'<text x="{pad_l - 6}" y="{y + 4:.1f}" font-size="11" text-anchor="end" '
                     f'font-family="sans-serif">{top * i / 4:.3g}{unit}</text>')
    for i, (v, c) in enumerate(zip(values, colors)):
        bh = h * (v / top)
        x = pad_l + i * bw
        parts.append(f'<rect x="{x + 1:.1f}" y="{pad_t + h - bh:.1f}" width="{max(1.0, bw - 2):.1f}" '
                     f'height="{bh:.1f}" fill="{c}"><title>{_html.escape(labels[i])}: {v:.4g}{unit}</title></rect>')
        if n <= 40 or i % max(1, n // 20) == 0:
            parts.append(f'<text x="{x + bw / 2:.1f}" y="{height - pad_b + 14}" font-size="10" text-anchor="middle" '
                         f'font-family="sans-serif">{_html.escape(labels[i][:14])}</text>')
    parts.append("</svg>")
    return "".join(parts)


def html(r: Any) -> str:
    e = _html.escape
    sc, tl, cov = r["script"], r["timeline"], r["coverage"]
    steps = r["steps"]
    warm = tl["warmup_steps"]
    step_plot = _bars([s["seconds"] * 1e3 for s in steps], [str(s["step"]) for s in steps],
                      ["#e67e22" if i < warm else "#2e86c1" for i in range(len(steps))],
                      f"step time (orange: the first {warm} steps, warm-up; blue: steady state)", " ms")
    mem_plot = _bars([s["peak_bytes"] / 2**20 for s in steps], [str(s["step"]) for s in steps],
                     ["#27ae60"] * len(steps), "peak device memory per step", " MiB")
    first = [("tracing", tl["first_step_tracing_seconds"] or 0.0), ("compilation", tl["first_step_compile_seconds"]
             or 0.0), ("the rest (execution, host)", tl["first_step_other_seconds"] or 0.0),
             ("steady step", tl["steady_step_seconds"] or 0.0)]
    first_plot = _bars([v * 1e3 for _, v in first], [k for k, _ in first],
                       ["#8e44ad", "#c0392b", "#2e86c1", "#27ae60"], "first step, split; and a steady step", " ms",
                       width=600)
    top_ops = list(cov["tpu_ops"].items())[:20]
    ops_plot = _bars([float(v) for _, v in top_ops], [k for k, _ in top_ops], ["#7f8c8d"] * len(top_ops),
                     "most called aten ops on tpu (calls)", "")
    rows = []
    for f in r["findings"]:
        rows.append(f'<tr><td style="color:{_COLORS[f["level"]]};font-weight:bold">{e(f["level"])}</td>'
                    f'<td>{e(f["category"])}</td><td>{e(f["title"])}<br><small>{e(f["detail"])}</small>'
                    + (f'<br><small><b>fix:</b> {e(f["suggestion"])}</small>' if f["suggestion"] else "")
                    + f'</td><td><code>{e(f["site"] or "")}</code></td></tr>')

    def table(head: list[str], body: list[list[Any]]) -> str:
        if not body:
            return "<p><i>none</i></p>"
        return ("<table><tr>" + "".join(f"<th>{e(h)}</th>" for h in head) + "</tr>"
                + "".join("<tr>" + "".join(f"<td>{e(str(c))}</td>" for c in row) + "</tr>" for row in body)
                + "</table>")

    comp = r.get("correctness")
    comp_html = "<p><i>not run (use --compare-cpu)</i></p>"
    if comp:
        comp_html = f"<p>{e(comp['what'])}</p>" + (f"<p><b>{e(comp['error'])}</b></p>" if comp.get("error") else "") \
            + table(["step", "tpu", "cpu", "abs diff", "rel diff", "ok"],
                    [[x["step"], f"{x['tpu']:.8g}", f"{x['cpu']:.8g}", f"{x['abs']:.3e}", f"{x['rel']:.3e}", x["ok"]]
                     for x in comp["steps"]])
    s = r["summary"]
    exc = sc.get("exception")
    return f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>torch_tpu doctor: {e(sc['run'])}</title>
<style>body{{font-family:sans-serif;margin:24px;max-width:1200px}}table{{border-collapse:collapse;margin:8px 0}}
td,th{{border:1px solid #ccc;padding:4px 8px;vertical-align:top;font-size:13px}}th{{background:#f4f4f4}}
code{{font-size:12px}}</style></head><body>
<h1>torch_tpu doctor</h1>
<p><code>{e(sc['run'])}</code><br>device {e(str(sc['device']))}, mode {e(sc['eager_mode'])};
{len(steps)} step(s) ({e(r['step_kind'])}); the run {e(sc['ended'])} after {sc['seconds']:.2f} s.</p>
{f"<pre>{e(exc.get('traceback', exc['message']))}</pre>" if exc else ""}
<h2>Findings: {s['error']} error(s), {s['warning']} warning(s), {s['info']} info</h2>
{('<table><tr><th>level</th><th>category</th><th>finding</th><th>source line</th></tr>' + ''.join(rows)
  + '</table>') if rows else '<p><i>none</i></p>'}
<h2>Timeline</h2>
<p>First step {_s(tl['first_step_seconds'])}: tracing {_s(tl['first_step_tracing_seconds'])}, compilation
{_s(tl['first_step_compile_seconds'])} ({tl['first_step_compiles']} compiles), the rest
{_s(tl['first_step_other_seconds'])}. Persistent compile cache over the run: {tl['persistent_cache_hits']} hits,
{tl['persistent_cache_misses']} misses. Steady step (median after {warm} warm-up steps):
{_s(tl['steady_step_seconds'])}. Step times include waiting for the device at each step boundary.</p>
<div>{step_plot}</div><div>{first_plot}</div>
<h2>Operator coverage</h2>
<p>{len(cov['tpu_ops'])} distinct aten ops ran on tpu tensors ({sum(cov['tpu_ops'].values())} calls);
{sum(cov['outside_fused_or_compiled'].values())} calls ran outside fused/compiled programs.</p>
<div>{ops_plot}</div>
<h3>Without a tpu kernel</h3>{table(['op', 'source line', 'calls'],
                                    [[x['op'], x['site'], x['calls']] for x in cov['no_kernel']])}
<h3>CPU fallbacks (runtime count)</h3>{table(['op', 'calls'], [[k, v] for k, v in cov['cpu_fallbacks'].items()])}
<h3>All ops</h3>{table(['op', 'calls', 'outside fused/compiled'],
                       [[k, v, cov['outside_fused_or_compiled'].get(k, 0)] for k, v in cov['tpu_ops'].items()])}
<h2>Host synchronisations</h2>{table(['what', 'source line', 'count', 'steps'],
                                       [[x['what'], x['site'], x['count'], x['steps']] for x in r['syncs']])}
<h2>Host/device transfers</h2>{table(['direction', 'source line', 'bytes', 'calls'],
                                       [[x['direction'], x['site'], x['bytes'], x['calls']] for x in r['transfers']])}
<h2>Compilations</h2>{table(['step', 'what', 'source line', 'shapes', 'seconds'],
                            [[c['step'] + 1, c['what'], c['site'], c['shapes'], f"{c['seconds']:.4f}"]
                             for c in r['recompilations'][:200]])}
<h2>Correctness</h2>{comp_html}
<h2>Memory</h2><div>{mem_plot}</div>
<h3>Largest tensors made on tpu</h3>{table(['bytes', 'op', 'tensor', 'source line'],
                                             [[x['bytes'], x['op'], x['tensor'], x['site']]
                                              for x in r['memory']['largest_tensors']])}
</body></html>
"""
