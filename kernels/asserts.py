"""Device-side assertions: `aten::_assert_async` (`torch._assert_async(cond)` and `(cond, msg)`), what CUDA runs
as a device assert. The condition is read on the device as a flag of torch_tpu/_checks.py (the mechanism of the
index checks) and the error is raised at the next synchronization point, as CPU's error (RuntimeError with
CPU's text or the given message); under DEFER_NEVER_AND_LAUNCH_BLOCKING at the op. There is no host round trip
per assertion.

Eagerly the flag is a program of its own (recorded into the pending graph under DEFER_AND_FUSE, where the
held flag keeps the assertion alive); in a torch.compile graph the lowerings below report it as an output of the
graph's program. The shape check (one element) is static and raises at the call, as on CUDA.
"""

from __future__ import annotations

from typing import Any

from torch_tpu import _checks, _executor, _storage
from torch_tpu.kernels.registry import direct, lower

_NONZERO = "Expected Tensor with single nonzero value, but got zero"  # CPU's text (aten::_assert_async)
_FAILED = "Assertion is failed"  # CPU's text for _assert_async.msg with an empty message


def _message(assert_msg: str | None) -> str:
    if assert_msg is None:
        return _NONZERO
    return assert_msg or _FAILED


def _check_numel(numel: int) -> None:
    if numel == 0:
        raise RuntimeError("Boolean value of Tensor with no values is ambiguous")
    if numel > 1:
        raise RuntimeError("Boolean value of Tensor with more than one value is ambiguous")


_FLAG = _executor.jitted(_checks.assert_flag, key="assert_async")


@direct("_assert_async", "_assert_async.msg", defer=True)
def assert_async(self: Any, assert_msg: str | None = None) -> None:
    _check_numel(self.numel())
    if not _checks.enabled:
        return None
    _checks.register({_checks.assert_key(_message(assert_msg)): _FLAG(_storage.read(self))})
    return None


# ---- torch.compile graphs ----

@lower("_assert_async", "_assert_async.msg", trace_only=True, variants=False, checks=True)
def assert_async_traced(self: Any, assert_msg: str | None = None) -> None:
    _check_numel(int(self.size))
    _checks.report_assert("_assert_async", self, _message(assert_msg))
    return None


@lower("_functional_assert_async.msg", trace_only=True, variants=False, checks=True)
def functional_assert_async(self: Any, assert_msg: str, dep_token: Any) -> Any:
    _check_numel(int(self.size))
    _checks.report_assert("_functional_assert_async", self, _message(assert_msg))
    return dep_token
