"""python -m torch_tpu.doctor: each finding category on small fixture scripts (exact source lines), the clean
examples, --compare-cpu, --json and the exit status, and the HTML report in a headless browser."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import pytest

from conftest import REPO

EXAMPLES = REPO / "examples"


def _doctor(tmp_path: Path, script: Path, *args: str, env: dict[str, str] | None = None,
            options: tuple[str, ...] = (), timeout: int = 300) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / f"{script.stem}.json"
    e = {k: v for k, v in os.environ.items() if k not in ("TORCH_TPU_EAGER_MODE", "TORCH_TPU_CPU_FALLBACK")}
    # A cache of its own: programs loaded from a persistent cache that earlier runs filled are not compiles, and
    # the recompilation findings count compiles.
    e["TORCH_TPU_CACHE_DIR"] = str(tmp_path / "cache")
    e.update(env or {})
    proc = subprocess.run([sys.executable, "-m", "torch_tpu.doctor", "--no-html", "--json", str(out), *options,
                           str(script), *args], capture_output=True, text=True, env=e, timeout=timeout,
                          cwd=str(tmp_path))
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads(out.read_text())


def _write(tmp_path: Path, name: str, body: str) -> Path:
    p = tmp_path / name
    p.write_text(textwrap.dedent(body))
    return p


def _findings(report: dict, category: str) -> list[dict]:
    return [f for f in report["findings"] if f["category"] == category]


SHAPES = """\
import torch

model = torch.nn.Linear(16, 4).to("tpu")
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(5):
    x = torch.randn(8 + step, 16, device="tpu")
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
"""

ITEM = """\
import torch

model = torch.nn.Linear(16, 4).to("tpu")
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(8, 16, device="tpu")
total = 0.0
for step in range(4):
    loss = model(x).square().mean()
    total += loss.item()
    loss.backward()
    opt.step()
    opt.zero_grad()
"""

MISSING = """\
import torch

model = torch.nn.Linear(16, 4).to("tpu")
opt = torch.optim.SGD(model.parameters(), lr=0.1)
rates = torch.full((8, 16), 3.0, device="tpu")
for step in range(3):
    x = torch.poisson(rates)
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
"""


def test_shape_change_per_step_is_a_recompilation_at_its_line(tmp_path: Path) -> None:
    script = _write(tmp_path, "shapes.py", SHAPES)
    proc, r = _doctor(tmp_path, script)
    assert proc.returncode == 0, proc.stderr[-3000:]  # warnings do not fail at the default --fail-on error
    rec = _findings(r, "recompilation")
    forward = [f for f in rec if f["site"] == f"{script}:7"]
    assert forward, rec
    assert "aten::addmm" in forward[0]["title"] and "4 later step(s)" in forward[0]["title"]
    assert "dim 0: 8, 9, 10, 11, 12" in forward[0]["detail"]
    assert "fixed batch size" in forward[0]["suggestion"]
    assert any(f["site"] == f"{script}:8 (backward)" for f in rec), rec  # the backward's ops, at .backward()
    assert len(r["steps"]) == 5
    assert not _findings(r, "sync") and not _findings(r, "coverage")
    # --fail-on warning turns the recompilation into a failing exit status
    proc, _ = _doctor(tmp_path, script, options=("--fail-on", "warning", "--steps", "3"))
    assert proc.returncode == 1


def test_shape_change_under_defer_and_fuse_is_a_recompiled_graph(tmp_path: Path) -> None:
    script = _write(tmp_path, "shapes.py", SHAPES)
    proc, r = _doctor(tmp_path, script, env={"TORCH_TPU_EAGER_MODE": "DEFER_AND_FUSE"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert r["script"]["eager_mode"] == "DEFER_AND_FUSE"
    rec = _findings(r, "recompilation")
    # x is made on the device inside the graph, so the graph's inputs keep their shapes: the graphs are reported
    # where they ran, in the backward pass (the forward pass's graph as it starts, each step a new shape, and the
    # backward pass's as it ends; the update's keeps its shapes)
    assert len(rec) == 1 and rec[0]["site"] == f"{script}:8 (backward)", rec
    assert "DEFER_AND_FUSE graph" in rec[0]["title"] and "4 later step(s)" in rec[0]["title"]
    assert r["coverage"]["fused_graph_runs"] >= 5
    assert sum(r["coverage"]["outside_fused_or_compiled"].values()) < sum(r["coverage"]["tpu_ops"].values())


def test_seconds_bound_stops_at_a_step_boundary_and_still_reports(tmp_path: Path) -> None:
    script = _write(tmp_path, "item.py", ITEM)
    proc, r = _doctor(tmp_path, script, options=("--seconds", "0.001"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert r["script"]["ended"] == "--seconds 0.001 reached" and len(r["steps"]) == 1
    assert not _findings(r, "transfer") and not _findings(r, "fusion")  # no steady state to judge


def test_item_in_the_loop_is_a_sync_at_its_line(tmp_path: Path) -> None:
    script = _write(tmp_path, "item.py", ITEM)
    proc, r = _doctor(tmp_path, script)
    assert proc.returncode == 0, proc.stderr[-3000:]
    syncs = _findings(r, "sync")
    assert [f["site"] for f in syncs] == [f"{script}:9"], syncs
    assert ".item()" in syncs[0]["title"] and "4 time(s) in 4 step(s)" in syncs[0]["title"]
    assert not _findings(r, "recompilation")
    assert r["syncs"] == [{"what": ".item() (aten::_local_scalar_dense)", "site": f"{script}:9", "count": 4,
                           "steps": 4}]


def test_op_without_a_kernel_strict_and_with_the_fallback(tmp_path: Path) -> None:
    script = _write(tmp_path, "missing.py", MISSING)
    proc, r = _doctor(tmp_path, script)
    assert proc.returncode == 3, proc.stderr[-3000:]  # the script raised; the report was still written
    cov = _findings(r, "coverage")
    assert cov and cov[0]["level"] == "error" and "aten::poisson" in cov[0]["title"], cov
    assert cov[0]["site"] == f"{script}:7"
    assert r["script"]["exception"]["type"] == "NotImplementedError"
    assert r["script"]["exception"]["site"] == f"{script}:7"

    proc, r = _doctor(tmp_path, script, env={"TORCH_TPU_CPU_FALLBACK": "warn"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    cov = _findings(r, "coverage")
    assert len(cov) == 1 and cov[0]["level"] == "warning" and cov[0]["site"] == f"{script}:7", cov
    assert "3 call(s) here, 3 in all" in cov[0]["title"]
    assert r["coverage"]["cpu_fallbacks"] == {"aten::poisson": 3}
    assert r["coverage"]["no_kernel"] == [{"op": "poisson", "site": f"{script}:7", "calls": 3}]


@pytest.mark.parametrize("name", ["mlp", pytest.param("lstm", marks=pytest.mark.extended)])
def test_clean_examples_report_only_what_is_true(tmp_path: Path, name: str) -> None:
    proc, r = _doctor(tmp_path, EXAMPLES / f"{name}.py", "--device", "tpu", options=("--steps", "4"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert r["summary"]["error"] == 0 and r["summary"]["warning"] == 0, r["findings"]
    assert not _findings(r, "coverage") and not _findings(r, "recompilation")
    assert len(r["steps"]) == 4 and r["script"]["ended"] == "--steps 4 reached"
    # the one host read per step the training loop makes: loss.item() in examples/_train.py
    item_line = next(i for i, line in enumerate((EXAMPLES / "_train.py").read_text().splitlines(), 1)
                     if "losses.append(loss.item())" in line)
    sites = [f["site"] for f in _findings(r, "sync")]
    assert sites and all(s.startswith(f"{EXAMPLES / '_train.py'}:{item_line}") for s in sites), sites
    t = r["timeline"]
    assert t["first_step_seconds"] >= t["first_step_compile_seconds"] > 0 and t["first_step_compiles"] > 0
    assert t["steady_step_seconds"] < t["first_step_seconds"]
    assert all(s["peak_bytes"] > 0 for s in r["steps"])
    assert r["coverage"]["tpu_ops"]["addmm"] >= 4


def test_compare_cpu_gives_small_differences(tmp_path: Path) -> None:
    proc, r = _doctor(tmp_path, EXAMPLES / "mlp.py", "--device", "tpu",
                      options=("--steps", "3", "--compare-cpu", "--compare-steps", "3"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    c = r["correctness"]
    assert c["error"] is None and len(c["steps"]) == 3, c
    assert all(row["ok"] and row["rel"] < 1e-4 for row in c["steps"]), c
    assert "backward" in c["what"] and "cpu" in c["what"]
    assert not _findings(r, "correctness")


def test_bad_input_names_the_way_out(tmp_path: Path) -> None:
    for args, text in ((["nope.py"], "is not a Python file"), (["--steps", "0", str(EXAMPLES / "mlp.py")],
                                                              "--steps 0")):
        proc = subprocess.run([sys.executable, "-m", "torch_tpu.doctor", *args], capture_output=True, text=True,
                              timeout=120, cwd=str(tmp_path))
        assert proc.returncode == 2 and text in proc.stderr, proc.stderr


def test_notebook_api_run_fn(tmp_path: Path) -> None:
    code = textwrap.dedent("""\
        import json, torch

        def train(n):
            model = torch.nn.Linear(8, 2).to("tpu")
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for _ in range(n):
                loss = model(torch.ones(4, 8, device="tpu")).sum()
                loss.backward()
                opt.step()
                print(loss.item())

        r = torch.tpu.doctor.run(train, 10, steps=3)
        from torch_tpu import _metrics
        print("RESULT", json.dumps({"steps": len(r["steps"]), "sync_sites": [s["site"] for s in r["syncs"]],
                                    "status": r.exit_status(), "observer_off": _metrics.observer is None}))
        """)
    p = _write(tmp_path, "nb.py", code)
    proc = subprocess.run([sys.executable, str(p)], capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.split("RESULT", 1)[1])
    assert res["steps"] == 3 and res["status"] == 0 and res["observer_off"]
    assert res["sync_sites"] == [f"{p}:10"], res


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


def _png_pixels(data: bytes) -> tuple[int, int, list[bytes]]:
    """(width, height, rows of RGB(A) bytes) of an 8-bit non-interlaced PNG."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width = 8, b"", 0
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + n]
        if kind == b"IHDR":
            width, height, depth, color = struct.unpack(">IIBB", body[:10])
            assert depth == 8 and color in (2, 6)
            bpp = 3 if color == 2 else 4
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    raw = zlib.decompress(idat)
    stride = width * bpp
    rows, prev = [], bytearray(stride)
    for y in range(height):
        f, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if f == 1:
                line[i] = (line[i] + a) & 255
            elif f == 2:
                line[i] = (line[i] + b) & 255
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line) if bpp == 3 else bytes(v for j, v in enumerate(line) if j % 4 != 3))
        prev = line
    return width, height, rows


def test_html_report_renders_its_plots_in_a_headless_browser(tmp_path: Path) -> None:
    chromium = _chromium()
    if chromium is None:
        pytest.skip("no chromium found (tools/setup.sh installs Debian's 'chromium' when run as root with apt-get)")
    script = _write(tmp_path, "shapes.py", SHAPES)
    page = tmp_path / "report.html"
    e = {k: v for k, v in os.environ.items() if k != "TORCH_TPU_EAGER_MODE"}
    proc = subprocess.run([sys.executable, "-m", "torch_tpu.doctor", "--html", str(page), str(script)],
                          capture_output=True, text=True, env=e, timeout=300, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = page.read_text()
    assert "<svg" in text and "http://" not in text.replace("http://www.w3.org/2000/svg", "")  # self-contained
    # only the plots: a page with the step-time plot first, so the screenshot's pixels come from it
    plot = text[text.index("<svg"):text.index("</svg>") + 6]
    only = tmp_path / "plot.html"
    only.write_text(f"<!DOCTYPE html><html><body style='margin:0;background:#fff'>{plot}</body></html>")
    shot = tmp_path / "shot.png"
    subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                    "--disable-background-networking", "--disable-component-update", "--disable-sync",
                    f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={shot}", "--window-size=1000,300",
                    f"file://{only}"], capture_output=True, timeout=120)
    assert shot.exists(), "chromium wrote no screenshot"
    w, h, rows = _png_pixels(shot.read_bytes())
    colored = sum(1 for row in rows[:260] for x in range(0, min(w, 900) * 3, 3)
                  if not (row[x] > 240 and row[x + 1] > 240 and row[x + 2] > 240))
    assert colored > 2000, f"the plot area is blank ({colored} non-white pixels)"
    # and the full report loads too
    full = tmp_path / "full.png"
    subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                    "--disable-background-networking", "--disable-component-update", "--disable-sync",
                    f"--user-data-dir={tmp_path / 'profile2'}", f"--screenshot={full}", "--window-size=1200,2000",
                    f"file://{page}"], capture_output=True, timeout=120)
    assert full.exists() and full.stat().st_size > 10000


HF_GPT2 = """\
import torch
from transformers import GPT2Config, GPT2LMHeadModel

torch.manual_seed(0)
cfg = GPT2Config(vocab_size=128, n_positions=16, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                 embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=127, eos_token_id=127)
model = GPT2LMHeadModel(cfg).to("tpu")
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
g = torch.Generator().manual_seed(0)
for step in range(4):
    ids = torch.randint(0, 128, (2, 16), generator=g).to("tpu")
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
"""


def test_hugging_face_model_random_init(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    script = _write(tmp_path, "hf_gpt2.py", HF_GPT2)
    proc, r = _doctor(tmp_path, script, options=("--compare-cpu", "--compare-steps", "3"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert len(r["steps"]) == 4 and not _findings(r, "coverage") and not _findings(r, "recompilation")
    assert all(row["ok"] for row in r["correctness"]["steps"]) and len(r["correctness"]["steps"]) == 3
    assert r["coverage"]["tpu_ops"] and r["timeline"]["first_step_compiles"] > 0


GRAPHED = """\
import torch, torch.nn as nn, torch.nn.functional as F
m = nn.Linear(16, 4).to("tpu")
opt = torch.optim.AdamW(m.parameters(), capturable=True)
x, y = torch.randn(8, 16, device="tpu"), torch.randint(0, 4, (8,), device="tpu")
for _ in range(2):
    opt.zero_grad(set_to_none=True); F.cross_entropy(m(x), y).backward(); opt.step()
opt.zero_grad(set_to_none=True)
g = torch.tpu.TPUGraph()
with torch.tpu.graph(g):
    loss = F.cross_entropy(m(x), y); loss.backward(); opt.step()
for _ in range(3):
    g.replay()
print("replayed", loss.item())
"""


def test_a_script_that_captures_a_graph_runs_under_the_doctor(tmp_path: Path) -> None:
    """The doctor waits for the device after each optimizer step; inside a graph capture that wait would end the
    capture, so a captured step() is not a step boundary."""
    script = _write(tmp_path, "graphed.py", GRAPHED)
    proc, r = _doctor(tmp_path, script)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "replayed" in proc.stdout and not _findings(r, "script")
