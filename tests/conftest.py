"""Shared test setup. Tests run against the installed torch_tpu wheel (tools/setup.sh builds and installs
it), never the source tree; CPU PyTorch is the oracle."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

# The suite's compile caches live in a folder of its own, made fresh for each run, so that what a test sees does not
# depend on what an earlier run on this machine left in ~/.cache/torch_tpu or PyTorch's Inductor/AOTAutograd cache:
# a graph loaded whole from a warm cache is never traced, and tests that count traces would pass or fail by the
# machine's history. Set before torch (and with it torch_tpu) loads; subprocesses the tests start inherit it. Tests
# of the cache itself give their own folders.
_CACHES = tempfile.mkdtemp(prefix="torch_tpu_tests_")
os.environ["TORCH_TPU_CACHE_DIR"] = os.path.join(_CACHES, "xla")
os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(_CACHES, "inductor")

import torch  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def _extract_test_fn():
    """torch.testing._internal.common_utils.extract_test_fn, the same search without inspect.stack(): PyTorch's
    OpInfo machinery calls it twice per `op.sample_inputs(...)` to find the running unittest method, and
    inspect.stack() reads every frame's source and scans sys.modules for each (0.1 s a call under pytest, 45% of
    the lazy-bit OpInfo sweep's time). Under pytest's plain test functions it finds none, as the original does."""
    import unittest

    try:
        frame = sys._getframe(1)
        while frame is not None:
            self_val = frame.f_locals.get("self")
            if isinstance(self_val, unittest.TestCase):
                *_, cls_name, test_name = self_val.id().rsplit(".", 2)
                if cls_name == type(self_val).__name__ and test_name.startswith("test"):
                    return getattr(self_val, test_name).__func__
            frame = frame.f_back
    except Exception:  # noqa: BLE001 - as the original: no test function
        pass
    return None


def _patch_opinfo_stack_walk() -> None:
    from torch.testing._internal import common_utils
    from torch.testing._internal.opinfo import core

    for module in (common_utils, core):
        assert callable(getattr(module, "extract_test_fn", None)), module  # PyTorch renamed it: update this
        module.extract_test_fn = _extract_test_fn


def pytest_configure(config: pytest.Config) -> None:
    # Here, not at import: a scenario subprocess imports conftest too (through test_distributed), and importing
    # PyTorch's testing modules there would start the tpu runtime before its init_process_group.
    _patch_opinfo_stack_walk()
    import torch_tpu

    where = Path(torch_tpu.__file__).resolve()
    if REPO in where.parents and "site-packages" not in str(where):
        raise pytest.UsageError(
            f"torch_tpu was imported from the source tree ({where}), not the installed wheel. Run the tests "
            "as the README says (bash tools/setup.sh && .venv/bin/pytest tests), not from the repo root "
            "with `python -m pytest`."
        )


_EXTENDED_LEFT = pytest.StashKey[int]()  # how many tests marked extended the run left out


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--extended", action="store_true",
                     help="also run the tests marked `extended` (bash tools/test_extended runs only those)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `extended` (the further variants of a behaviour CI checks once: more modes and dtypes of the
    OpInfo sweeps, more world sizes and start-up orders) run only with --extended, or when named by node id, so
    that the README's test command stays well inside CI's time limit on a 2-core machine."""
    if config.getoption("--extended"):
        return
    named = [a.split("::", 1)[1] for a in config.args if "::" in a]

    def wanted(item: pytest.Item) -> bool:
        if item.get_closest_marker("extended") is None:
            return True
        test = item.nodeid.split("::", 1)[1]
        return any(test == n or test.startswith(n + "[") or test.startswith(n + "::") for n in named)

    kept, left = [], []
    for item in items:
        (kept if wanted(item) else left).append(item)
    if left:
        config.hook.pytest_deselected(items=left)
        config.stash[_EXTENDED_LEFT] = len(left)
        items[:] = kept


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    left = config.stash.get(_EXTENDED_LEFT, 0)
    if left:
        terminalreporter.write_line(f"{left} test{'s' if left > 1 else ''} marked extended not run: "
                                    "bash tools/test_extended runs them (or pytest --extended)")


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(_CACHES, ignore_errors=True)


def run_python(code: str, env: dict[str, str] | None = None, timeout: int = 300,
               args: list[str] | None = None) -> subprocess.CompletedProcess:
    """Runs `code` in a fresh interpreter (cwd outside the repo, so the source tree cannot shadow the wheel)."""
    full_env = dict(os.environ)
    full_env.pop("TORCH_TPU_NUM_DEVICES", None)
    full_env.pop("TORCH_TPU_PLATFORM", None)
    full_env.pop("TORCH_TPU_CPU_FALLBACK", None)
    full_env.pop("TORCH_TPU_EAGER_MODE", None)
    if env:
        full_env.update(env)
    return subprocess.run(
        [sys.executable, "-c", code, *(args or [])], capture_output=True, text=True, env=full_env, timeout=timeout, cwd="/"
    )


def version() -> str:
    """torch_tpu's version, from the one place it is written (torch_tpu/_version.py)."""
    return re.search(r'^__version__ = "([^"]+)"$', (REPO / "torch_tpu" / "_version.py").read_text(), re.M).group(1)


def built_wheel() -> Path:
    """The wheel `bazel build //:wheel` writes for this Python, by its exact name: version, tag and BUILD's
    PLATFORM (bazel-bin may still hold a wheel that an older build named differently)."""
    plat = re.search(r'^PLATFORM = "([^"]+)"$', (REPO / "BUILD").read_text(), re.M).group(1)
    py = "cp%d%d" % sys.version_info[:2]
    wheel = REPO / "bazel-bin" / f"torch_tpu-{version()}-{py}-{py}-{plat}.whl"
    assert wheel.exists(), f"{wheel} is missing: run tools/setup.sh"
    return wheel


def rss_bytes() -> int:
    """Resident set size of this process."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.fixture
def tpu() -> torch.device:
    return torch.device("tpu:0")


def load_example(name: str):
    """examples/<name>.py as a module (build, optimizer, ...), registered in sys.modules under example_<name>
    (Dynamo looks classes' modules up by name), with examples/ on sys.path for its helpers (_train)."""
    import importlib.util

    if str(REPO / "examples") not in sys.path:
        sys.path.insert(0, str(REPO / "examples"))
    spec = importlib.util.spec_from_file_location(f"example_{name}", REPO / "examples" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def fresh_dynamo():
    """Each compile test starts with Dynamo's caches and counters empty and leaves none behind (a test module
    uses it for all its tests with `pytestmark = pytest.mark.usefixtures("fresh_dynamo")`)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def check_fused_step_like_cpu(base: dict, step, dtype) -> None:
    """A fused optimizer kernel called as GradScaler's step calls it: `step(tensors, device)` updates the lists of
    `base` (cloned to each device) in place with grad_scale and found_inf on that device; tpu must match CPU, and
    found_inf == 1 must leave every tensor as it was."""
    import torch

    for inf in (0.0, 1.0):
        got = {}
        for device in ("cpu", "tpu"):
            t = {k: [x.clone().to(device) for x in v] for k, v in base.items()}
            step(t, device, torch.tensor(inf, device=device))
            got[device] = {k: [x.cpu() for x in v] for k, v in t.items()}
        tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
        for k in base:
            for a, b in zip(got["cpu"][k], got["tpu"][k]):
                assert b.dtype == a.dtype
                torch.testing.assert_close(b, a, **tol, msg=f"{k} found_inf={inf}")
        if inf == 1.0:
            for k in base:
                for a, b in zip(base[k], got["tpu"][k]):
                    assert torch.equal(a, b), k


def jax_pairs(donated_sigs: list[tuple], out_sigs: list[tuple]) -> dict[int, int]:
    """How JAX pairs a program's donated inputs with its outputs (jax/_src/interpreters/mlir.py, _set_up_aliases):
    each output in order takes the first donated input of its shape and dtype not yet taken. Donated input's index
    (among the donated) -> output index."""
    free: dict[tuple, list[int]] = {}
    for k, sig in enumerate(donated_sigs):
        free.setdefault(sig, []).append(k)
    pairs = {}
    for j, sig in enumerate(out_sigs):
        if free.get(sig):
            pairs[free[sig].pop(0)] = j
    return pairs

