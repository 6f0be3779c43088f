#!/usr/bin/env bash
# Rebuild the wheel and reinstall it into .venv after an edit (what tools/setup.sh does, minus the checks).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bazel build //:wheel --config=wheel_common --config=no_rbe --repo_env=TORCH_TPU_PYTHON="$PWD/.venv/bin/python" 2>&1 | grep -E "ERROR|error:|FAILED" || true
VERSION="$(sed -n 's/^__version__ = "\(.*\)"$/\1/p' torch_tpu/_version.py)"
PLATFORM="$(sed -n 's/^PLATFORM = "\(.*\)"$/\1/p' BUILD)"
PYTAG="$(.venv/bin/python -c 'import sys; print("cp%d%d" % sys.version_info[:2])')"
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps --force-reinstall \
  "bazel-bin/torch_tpu-$VERSION-$PYTAG-$PYTAG-$PLATFORM.whl"
