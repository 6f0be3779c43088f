#!/usr/bin/env bash
# Rebuild the wheel and reinstall it into .venv after an edit (what tools/setup.sh does, minus the checks).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bazel build //:wheel --config=wheel_common --config=no_rbe --repo_env=TORCH_TPU_PYTHON="$PWD/.venv/bin/python" 2>&1 | grep -E "ERROR|error:|FAILED" || true
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps --force-reinstall bazel-bin/torch_tpu-0.2.0-*.whl
