"""Every TORCH_TPU_* variable: one table, one parser per type, and what a bad value does.

`VARIABLES` lists each variable (name, parser, default, one-line doc); code reads a setting only through
`get(NAME)`, which parses the environment's current value (cached per raw value) and returns the default when
the variable is unset or empty. `python -m torch_tpu config` lists them with their current values
(`--markdown` prints the table of docs/user_guide.md; tests/test_config.py checks the two agree).

torch_tpu loads at `import torch` (the `torch.backends` entry point), so a bad value must not raise there:
every script, CPU-only ones too, would fail at `import torch`. Nor may it be ignored. While torch_tpu loads,
`load()` parses every variable: a bad value keeps the default for the moment, and its error, naming the
variable, the value and the valid values, is raised by `check()`. The runtime calls `check()` at the first
tpu use and at every later one (`torch_tpu._runtime.start`, `torch.tpu.is_available`), so the program stops
there instead of running with a setting it did not ask for. After the load, `get` of a bad value raises the
same error at once.

No C++ file reads the environment: runtime/*.cpp gets its settings from Python at wiring time
(`TORCH_TPU_CPU_FALLBACK` through `_C._set_fallback_mode`).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

T = TypeVar("T")

_errors: dict[str, str] = {}  # variable -> what is wrong with its value
_loading = True  # until load() ran: bad values are deferred to check() instead of raised


class Parser:
    """Parses a stripped, non-empty raw value, or raises ValueError("is not ...: use ...") saying what is
    valid. `valid` is the docs' short text of the accepted values."""

    def __init__(self, fn: Callable[[str], Any], valid: str) -> None:
        self.fn = fn
        self.valid = valid

    def __call__(self, raw: str) -> Any:
        return self.fn(raw)


def boolean(default: bool) -> Parser:
    on, off = ("1", "true", "on", "yes"), ("0", "false", "off", "no")
    on_text = "1 (or true, on, yes" + (", unset)" if default else ")")
    off_text = "0 (or false, off, no" + (")" if default else ", unset)")

    def parse(raw: str) -> bool:
        low = raw.lower()
        if low in on:
            return True
        if low in off:
            return False
        raise ValueError(f"is not understood: use {off_text} to turn it off, or {on_text} to keep it on"
                         if default else f"is not understood: use {on_text} to turn it on, or {off_text} to "
                         "keep it off")

    return Parser(parse, f"{on_text} / {off_text}")


def _int(raw: str, least: int, what: str) -> int:
    try:
        n = int(raw)
    except ValueError:
        raise ValueError(f"is not {what}") from None
    if n < least:
        raise ValueError(f"is not {what}")
    return n


positive_int = Parser(lambda raw: _int(raw, 1, "a positive integer"), "a positive integer")
non_negative_int = Parser(lambda raw: _int(raw, 0, "a non-negative integer"), "a non-negative integer")


def _byte_size(raw: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(raw[-1].upper(), 1)
    try:
        n = int(float(raw[:-1] if mult > 1 else raw) * mult)
    except (ValueError, OverflowError):  # OverflowError: inf
        n = -1
    if n < 0:
        raise ValueError("is not a size (e.g. 4G, 512M, 1000000)")
    return n


byte_size = Parser(_byte_size, "bytes, with an optional suffix K, M or G (e.g. 4G, 512M, 1000000)")


def one_of(*choices: str, upper: bool = False) -> Parser:
    """One of `choices`, case-insensitive (returned lower case, or upper case with upper=True)."""

    def parse(raw: str) -> str:
        key = raw.upper() if upper else raw.lower()
        if key not in choices:
            raise ValueError(f"is not one of {', '.join(choices)} (or unset it)")
        return key

    return Parser(parse, ", ".join(choices))


def choice(aliases: dict[str, Any], valid: str, explain: str) -> Parser:
    """One of the lower-case spellings in `aliases`, mapped to its value; `valid` lists them for the docs,
    `explain` says in an error what each means."""

    def parse(raw: str) -> Any:
        if raw.lower() not in aliases:
            raise ValueError(f"is not understood: use {explain}")
        return aliases[raw.lower()]

    return Parser(parse, valid)


def _path(raw: str) -> str:
    return os.path.abspath(os.path.expanduser(raw))


path = Parser(_path, "a folder (~ expanded, made absolute)")


def _recompile_warn(raw: str) -> int:
    try:
        return max(int(raw), 0)  # a negative count was always accepted and meant off
    except ValueError:
        raise ValueError("is not valid: use how many different shapes a call site may compile before it warns "
                         "(e.g. 8; 0 turns the warning off), or unset it") from None


_EAGER_MODES = ("DEFER_NEVER", "DEFER_NEVER_AND_LAUNCH_BLOCKING", "DEFER_AND_FUSE")


@dataclass(frozen=True)
class Var:
    name: str
    parse: Parser
    default: Any
    doc: str
    default_text: str = ""  # the docs' text for the default when it is not just repr-able (None: computed)


# Every value accepted before this table existed is still accepted with its meaning. Where files disagreed the
# documented meaning won: all booleans take the same spellings (TORCH_TPU_DIST_CHECKS=no used to mean on,
# TORCH_TPU_DIST_EARLY_INIT took only 0), and a value that is none of them (once silently "on") is an error.
VARIABLES: tuple[Var, ...] = (
    Var("TORCH_TPU_PLATFORM", one_of("cpu", "tpu", "cuda"), None,
        "force a PJRT platform (cuda: a test convenience)", "the TPU when libtpu finds one, else XLA:CPU"),
    Var("TORCH_TPU_NUM_DEVICES", positive_int, None,
        "N virtual XLA:CPU devices, `tpu:0`…`tpu:N-1` (selects XLA:CPU)", "one device per chip"),
    Var("TORCH_TPU_EAGER_MODE", one_of(*_EAGER_MODES, upper=True), None,
        "the process's default execution mode (`torch.tpu.EagerMode`)", "DEFER_NEVER"),
    Var("TORCH_TPU_CPU_FALLBACK",
        choice({"warn": 1, "1": 1, "strict": 0, "0": 0, "off": 0}, "warn (or 1), strict (or 0, off)",
               "'warn' (or 1) to run ops without a tpu kernel on CPU (warning once per op), or 'strict' (or 0, "
               "off, unset) for the strict default"), 0,
        "ops without a tpu kernel: raise (strict), or run on CPU warning once per op (warn)", "strict"),
    Var("TORCH_TPU_FUSE_OPTIMIZER_STEPS", boolean(True), True,
        "DEFER_NEVER: record each optimizer step (tpu parameters, not `fused=True`) and run it as one program"),
    Var("TORCH_TPU_FUSE_MAX_OPS", positive_int, 1000, "DEFER_AND_FUSE: ops in one pending graph before it runs"),
    Var("TORCH_TPU_FUSE_CACHE", positive_int, 512, "DEFER_AND_FUSE: compiled fused programs kept (LRU)"),
    Var("TORCH_TPU_INDEX_CHECKS", boolean(True), True,
        "device-side index bound checks and `_assert_async` assertions; 0 is an UNSAFE opt-out (out-of-range "
        "indices give wrong values)"),
    Var("TORCH_TPU_RECOMPILE_WARN", Parser(_recompile_warn, "an integer; 0 (or negative) turns the warning off"),
        8, "warn once a call site compiled this many different input shapes"),
    Var("TORCH_TPU_CACHE", boolean(True), True, "the persistent compile cache"),
    Var("TORCH_TPU_CACHE_DIR", path, None, "where the compile cache lives",
        "`$XDG_CACHE_HOME/torch_tpu/xla` (`~/.cache/torch_tpu/xla`)"),
    Var("TORCH_TPU_CACHE_MAX_BYTES", byte_size, 4 << 30,
        "the compile cache's size cap (least recently used entries are evicted)", "4G"),
    Var("TORCH_TPU_COMPILE_FALLBACK",
        choice({"eager": "eager", "strict": None, "0": None, "off": None}, "eager, strict (or 0, off)",
               "'eager' (graphs with ops that have no tpu lowering run op by op, with a warning), or 'strict' "
               "(or 0, off, unset: they raise)"), None,
        "`torch.compile(backend=\"tpu\")`: graphs with ops that have no tpu lowering", "strict"),
    Var("TORCH_TPU_DUMP_DIR", path, None,
        "`torch.compile(backend=\"tpu\")`: write each aten graph and its program here", "off"),
    Var("TORCH_TPU_DIST_EARLY_INIT", boolean(True), True,
        "under torchrun, join JAX's distributed world at the first tpu use"),
    Var("TORCH_TPU_DIST_CHECKS", boolean(True), True,
        "tpu_dist: check collective arguments agree across ranks before running"),
    Var("TORCH_TPU_MEMORY_LIMIT", byte_size, None,
        "bytes live tpu tensors may hold per device; an allocation past it raises torch.OutOfMemoryError",
        "no limit (a TPU's own memory)"),
    Var("TORCH_TPU_PALLAS", one_of("auto", "interpret", "reference"), "auto",
        "Pallas kernels (kernels/pallas/): on a TPU where they fit (auto), in Pallas interpret mode (interpret: "
        "tests on CPU) or never (reference: the XLA path); read when a program is traced"),
    Var("TORCH_TPU_INDUCTOR", one_of("auto", "pallas", "tpu"), "auto",
        "default torch.compile (Inductor) on tpu tensors: Inductor's Pallas code on a TPU and the 'tpu' backend "
        "elsewhere (auto), Inductor's Pallas code always (pallas: Mosaic kernels need a TPU) or the 'tpu' backend "
        "always (tpu)"),
    Var("TORCH_TPU_SPLIT_HOST", boolean(True), True,
        "under torchrun with several processes on a TPU host, give each its share of the chips (TPU_VISIBLE_CHIPS…)"),
)
_BY_NAME = {v.name: v for v in VARIABLES}
_parsed: dict[tuple[str, str], Any] = {}  # (name, raw value) -> parsed value


def _message(var: Var, raw: str, e: ValueError) -> str:
    return f"{var.name}={raw!r} {e}."


def get(name: str) -> Any:
    """The value of the TORCH_TPU_* variable `name` (see VARIABLES): its default when unset or empty. A bad
    value raises RuntimeError naming the variable, the value and the valid values; while torch_tpu loads it
    gives the default instead and the error is raised by check() (see the module doc)."""
    var = _BY_NAME[name]
    raw = os.environ.get(name, "")
    raw = raw.strip() if var.parse is not path else raw
    if not raw:
        return var.default
    key = (name, raw)
    try:
        return _parsed[key]
    except KeyError:
        pass
    try:
        value = var.parse(raw)
    except ValueError as e:
        message = _message(var, raw, e)
        if _loading:
            defer(name, message)
            return var.default
        raise RuntimeError(f"torch_tpu: {message} Fix or unset it.") from None
    if var.parse is not path:  # a relative path depends on the current directory
        _parsed[key] = value
    return value


def load() -> None:
    """Parses every variable while torch_tpu loads (bad values are deferred to check()); later reads raise."""
    global _loading
    for var in VARIABLES:
        get(var.name)
    _loading = False


def defer(name: str, message: str) -> None:
    """Records that `name` has a bad value (`message` says which and what is valid), raised by check()."""
    _errors.setdefault(name, message.replace("torch_tpu: ", ""))


def read(name: str, parse: Callable[[str], T], default: T) -> T:
    """`get` for a setting not (yet) in VARIABLES: `parse` raises ValueError("is not ...") saying what is
    valid; a bad value gives `default` and an error for check(). Prefer adding the variable to VARIABLES."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return parse(raw)
    except ValueError as e:
        defer(name, f"{name}={raw!r} {e}.")
        return default


def check() -> None:
    """Raises the errors of bad TORCH_TPU_* values read at load (see the module doc)."""
    if _errors:
        raise RuntimeError(
            "torch_tpu: " + " ".join(_errors.values())
            + " Fix or unset " + ("it" if len(_errors) == 1 else "them")
            + " (torch_tpu read the environment at `import torch`)."
        )


def _default_text(var: Var) -> str:
    if var.default_text:
        return var.default_text
    if isinstance(var.default, bool):
        return "1" if var.default else "0"
    if var.default is None:
        return "unset"
    return str(var.default)


def markdown_table() -> str:
    """The docs' table of every variable (docs/user_guide.md holds this text; tests/test_config.py checks)."""
    rows = ["| variable | values | default | effect |", "|---|---|---|---|"]
    for var in VARIABLES:
        valid = var.parse.valid.replace("|", "\\|")
        rows.append(f"| `{var.name}` | {valid} | {_default_text(var)} | {var.doc} |")
    return "\n".join(rows) + "\n"


def describe() -> str:
    """Every variable with its current value (as set in this process's environment) and what it does."""
    lines = []
    for var in VARIABLES:
        raw = os.environ.get(var.name)
        now = f"= {raw!r}" if raw is not None else f"unset (default: {_default_text(var)})"
        lines.append(f"{var.name} {now}\n    {var.doc}; values: {var.parse.valid}")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    """`python -m torch_tpu config [--markdown]` (torch_tpu/__main__.py)."""
    if "--markdown" in argv:
        print(markdown_table(), end="")
    else:
        print(describe())
