"""python -m torch_tpu.doctor [options] script.py [script args]: see torch_tpu/doctor/__init__.py."""

from __future__ import annotations

import argparse
import os
import sys

USAGE = "python -m torch_tpu.doctor [options] script.py [script args]"


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m torch_tpu.doctor", usage=USAGE,
        description="Run a script unchanged on the tpu device (XLA:CPU without a TPU) and report its TPU "
                    "readiness: op coverage, recompilations, host syncs, TPU-unfriendly shapes and dtypes, "
                    "warm-up vs steady state, memory, and (--compare-cpu) the loss against CPU PyTorch.")
    ap.add_argument("--steps", type=int, default=None, help="stop after this many optimizer steps")
    ap.add_argument("--seconds", type=float, default=None, help="stop at the first step boundary after this time")
    ap.add_argument("--compare-cpu", action="store_true",
                    help="run the first steps again on CPU PyTorch from the same seed and compare the losses")
    ap.add_argument("--compare-steps", type=int, default=5, help="steps compared with --compare-cpu (default 5)")
    ap.add_argument("--rtol", type=float, default=1e-3, help="relative loss tolerance of --compare-cpu (1e-3)")
    ap.add_argument("--seed", type=int, default=0, help="torch.manual_seed before each run (default 0)")
    ap.add_argument("--html", default=None, help="write the HTML report here (default: doctor_report.html)")
    ap.add_argument("--no-html", action="store_true", help="write no HTML report")
    ap.add_argument("--json", default=None, help="write the report as JSON here")
    ap.add_argument("--fail-on", choices=("info", "warning", "error", "never"), default="error",
                    help="exit with status 1 when findings at or above this level exist (default: error)")
    ap.add_argument("--quiet", action="store_true", help="print only the summary line")
    ap.add_argument("script", help="the Python script to run")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    a = ap.parse_args(argv)
    if not a.script.endswith(".py") or not os.path.isfile(a.script):
        ap.error(f"{a.script!r} is not a Python file: give the script to run, e.g. {USAGE}")
    if a.steps is not None and a.steps < 1:
        ap.error(f"--steps {a.steps}: give a positive number of optimizer steps")
    if a.seconds is not None and a.seconds <= 0:
        ap.error(f"--seconds {a.seconds}: give a positive number of seconds")

    import torch  # noqa: F401  (loads torch_tpu)

    from torch_tpu import doctor

    html_path = None if a.no_html else (a.html or "doctor_report.html")
    report = doctor.run_script(a.script, a.args, steps=a.steps, seconds=a.seconds, compare_cpu=a.compare_cpu,
                               compare_steps=a.compare_steps, rtol=a.rtol, seed=a.seed, html_path=html_path,
                               json_path=a.json, quiet=True)
    text = report.text()
    sys.stdout.flush()
    print(text.splitlines()[0] if a.quiet else text, file=sys.stderr if a.quiet else sys.stdout)
    if a.quiet:
        s = report["summary"]
        print(f"findings: {s['error']} error(s), {s['warning']} warning(s), {s['info']} info", file=sys.stderr)
    if html_path:
        print(f"HTML report: {os.path.abspath(html_path)}")
    if a.json:
        print(f"JSON report: {os.path.abspath(a.json)}")
    return report.exit_status(a.fail_on)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
