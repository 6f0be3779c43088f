"""`python -m torch_tpu config [--markdown]`: every TORCH_TPU_* variable, its current value and what it does
(`--markdown`: the table of docs/user_guide.md)."""

from __future__ import annotations

import sys

from torch_tpu import _config

if __name__ == "__main__":
    if sys.argv[1:2] != ["config"]:
        sys.exit("usage: python -m torch_tpu config [--markdown]  (lists every TORCH_TPU_* variable)")
    _config.main(sys.argv[2:])
