#!/usr/bin/env bash
# One idempotent setup: Bazel, a .venv with torch (CPU build) + jax, then the torch_tpu wheel built by Bazel
# and installed into that venv. Safe to run again: each step is skipped when already satisfied.
#
#   bash tools/setup.sh            # everything
#   TORCH_TPU_SKIP_BUILD=1 ...     # only Bazel + venv
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
REQUIRED_TORCH="2.13.0"
VENV="${TORCH_TPU_VENV:-$ROOT/.venv}"
PY="${TORCH_TPU_BOOTSTRAP_PYTHON:-python3}"

say() { printf '[setup] %s\n' "$*" >&2; }
die() { printf '[setup] error: %s\n' "$*" >&2; exit 1; }

# torch_tpu's version is written once, in torch_tpu/_version.py.
VERSION="$(sed -n 's/^__version__ = "\(.*\)"$/\1/p' torch_tpu/_version.py)"
[ -n "$VERSION" ] || die "torch_tpu/_version.py has no '__version__ = \"X.Y.Z\"' line."

# 1. Python 3.11+
"$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' 2>/dev/null \
  || die "torch_tpu needs Python 3.11 or newer as '$PY' (set TORCH_TPU_BOOTSTRAP_PYTHON to another interpreter)."

# 2. Bazel (Debian's bazel-bootstrap 4.2.3 works offline with the stand-ins in tools/offline).
if ! command -v bazel >/dev/null 2>&1; then
  if [ "${TORCH_TPU_NO_APT:-0}" != "1" ] && [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    say "Bazel not found: installing Debian's bazel-bootstrap with apt-get"
    (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q bazel-bootstrap) >&2 \
      || die "could not install Bazel. Install it yourself: 'apt-get install bazel-bootstrap' (Debian/Ubuntu), then rerun tools/setup.sh."
  else
    die "Bazel is not installed. Install it: 'sudo apt-get install bazel-bootstrap' (Debian/Ubuntu; Bazel 4.2+), then rerun tools/setup.sh."
  fi
fi

# 2b. Chromium, best effort: the test of the doctor's HTML report (tests/test_doctor.py) opens it headless and
# skips, saying why, without it. Nothing else needs it.
if ! command -v chromium >/dev/null 2>&1; then
  if [ "${TORCH_TPU_NO_APT:-0}" != "1" ] && [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    say "chromium not found: installing Debian's chromium with apt-get (for the doctor's HTML report test)"
    (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium) >&2 \
      || say "could not install chromium (the HTML report test will skip); 'apt-get install chromium' installs it"
  else
    say "chromium not found: the doctor's HTML report test will skip ('sudo apt-get install chromium' installs it)"
  fi
fi

# 3. The venv with pinned torch/jax. Probes run with -P (from the repo root the source folder torch_tpu/ would
# otherwise shadow the installed wheel) and without the backend autoload, so that a broken installed torch_tpu
# (the very thing this script rebuilds) cannot stop it.
if [ ! -x "$VENV/bin/python" ]; then
  say "creating $VENV"
  "$PY" -m venv "$VENV"
fi
have_torch="$(TORCH_DEVICE_BACKEND_AUTOLOAD=0 "$VENV/bin/python" -P -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null || true)"
if [ -n "$have_torch" ] && [ "$have_torch" != "$REQUIRED_TORCH" ]; then
  die "the venv $VENV has torch $have_torch, but torch_tpu is built for torch==$REQUIRED_TORCH. Remove the venv ('rm -rf $VENV') and rerun, or 'pip install torch==$REQUIRED_TORCH' into it."
fi
# Every package of tools/requirements.txt present, each `name==X` pin at exactly X (torch is checked below).
if ! "$VENV/bin/python" - tools/requirements.txt <<'PYEOF' 2>/dev/null
import importlib.metadata as md, re, sys
for line in open(sys.argv[1]):
    m = re.match(r"^\s*([A-Za-z0-9_.-]+)\s*(==\s*([^\s;#]+))?", line)
    if not m or line.lstrip().startswith("#"):
        continue
    v = md.version(m.group(1))
    if m.group(3) and m.group(1) != "torch" and v != m.group(3):
        sys.exit(1)
PYEOF
then
  say "installing pinned packages from tools/requirements.txt"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check -r tools/requirements.txt >&2 \
    || die "pip could not install tools/requirements.txt into $VENV."
fi
have_torch="$(TORCH_DEVICE_BACKEND_AUTOLOAD=0 "$VENV/bin/python" -P -c 'import torch; print(torch.__version__.split("+")[0])')"
[ "$have_torch" = "$REQUIRED_TORCH" ] || die "pip installed torch $have_torch, torch_tpu needs torch==$REQUIRED_TORCH (CPU build)."

[ "${TORCH_TPU_SKIP_BUILD:-0}" = "1" ] && exit 0

# 4. Build the wheel with Bazel and install it into the venv (only when it changed).
say "bazel build //:wheel"
TORCH_TPU_PYTHON="$VENV/bin/python" bazel build //:wheel --config=wheel_common --config=no_rbe \
  --repo_env=TORCH_TPU_PYTHON="$VENV/bin/python" >&2 || die "the Bazel build failed (see above)."
# The wheel's exact name (bazel-bin may still hold a wheel an older build named differently).
PLATFORM="$(sed -n 's/^PLATFORM = "\(.*\)"$/\1/p' BUILD)"
PYTAG="$("$VENV/bin/python" -c 'import sys; print("cp%d%d" % sys.version_info[:2])')"
WHEEL="bazel-bin/torch_tpu-$VERSION-$PYTAG-$PYTAG-$PLATFORM.whl"
[ -f "$WHEEL" ] || die "Bazel did not produce $WHEEL"
stamp="$VENV/.torch_tpu_wheel.sha256"
sum="$(sha256sum "$WHEEL" | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$sum" ] || ! "$VENV/bin/python" -c 'import importlib.metadata as m; m.version("torch_tpu")' >/dev/null 2>&1; then
  say "installing $(basename "$WHEEL")"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps --force-reinstall "$WHEEL" >&2
  echo "$sum" > "$stamp"
fi
say "ready: $VENV (torch $have_torch, $(basename "$WHEEL"))"
