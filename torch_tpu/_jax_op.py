"""`torch.tpu.jax_op`: a JAX (or Pallas) function as a torch custom op that runs in every execution mode.

`jax_op(fn)` defines two ops with `torch.library.custom_op` under the namespace `tpu_jax`:

- `tpu_jax::<name>(Tensor[] xs, str spec) -> Tensor[]`, the function on its flattened tensor arguments;
- `tpu_jax::<name>_vjp(Tensor[] xs, Tensor[] cts, str spec) -> Tensor[]`, its pullback (`jax.vjp` of the function,
  or of `jax.custom_vjp` with the user's `backward`), the gradients of the floating inputs.

Both are entries of the one kernel table (kernels/registry.py, `@lower("tpu_jax::<name>")`), so every executor runs
them the way it runs an aten lowering: the eager executor installs a PrivateUse1 kernel (jitted, cached per
shapes), DEFER_AND_FUSE records the call into the pending graph, and `torch.compile(backend="tpu")` lowers the node
inline through the registry. The fake (meta) implementation is `jax.eval_shape`; autograd is registered with
`register_autograd` and calls the `_vjp` op, so the backward is a tpu op too (and a node of compiled backward graphs).

A call's structure (the pytree of its arguments, its non-tensor leaves and static keyword arguments) is interned as
a `spec` string: one op serves every structure, and the string is process-local (marked so: a fused graph holding
it is never cached on disk, where another process's function of the same name could take its place).
"""

from __future__ import annotations

import functools
import itertools
import re
import threading
from typing import Any, Callable, Sequence

import torch
from torch._dynamo import assume_constant_result, dont_skip_tracing  # (this module loads on first use only)

from torch_tpu import _deferred, _eager, _runtime
from torch_tpu.kernels.registry import lower

__all__ = ["jax_op", "JaxOp", "NAMESPACE"]

NAMESPACE = "tpu_jax"
_LOCK = threading.Lock()
_NAMES: set[str] = set()
_SPECS: dict[str, "_Spec"] = {}
_OPS: dict[str, "JaxOp"] = {}


_TENSOR = ("T",)


def _flatten(x: Any, leaves: list, is_leaf: Callable[[Any], bool]) -> tuple:
    """A pytree's structure as nested tuples of constants (what Dynamo can pass around as a constant): leaves for
    which `is_leaf` holds are appended to `leaves` and stand as ("T",); tuples, lists and dicts are nodes; any
    other value is a static leaf ("static", value)."""
    if is_leaf(x):
        leaves.append(x)
        return _TENSOR
    if isinstance(x, tuple):
        return ("tuple", tuple([_flatten(v, leaves, is_leaf) for v in x]))
    if isinstance(x, list):
        return ("list", tuple([_flatten(v, leaves, is_leaf) for v in x]))
    if isinstance(x, dict):
        keys = tuple(x.keys())
        return ("dict", keys, tuple([_flatten(x[k], leaves, is_leaf) for k in keys]))
    return ("static", x)


def _build(desc: tuple, leaves: Any) -> Any:
    """The pytree `desc` describes, with values from iterator `leaves` in its ("T",) places."""
    kind = desc[0]
    if kind == "T":
        return next(leaves)
    if kind == "static":
        return desc[1]
    if kind == "dict":
        return {k: _build(d, leaves) for k, d in zip(desc[1], desc[2])}
    items = [_build(d, leaves) for d in desc[1]]
    return tuple(items) if kind == "tuple" else items


def _count(desc: tuple) -> int:
    kind = desc[0]
    if kind == "T":
        return 1
    if kind == "static":
        return 0
    return sum(_count(d) for d in desc[-1])


def _is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


def _is_array(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype") and not isinstance(x, (tuple, list, dict))


class _Spec:
    """One call structure of one JaxOp: the arguments' structure (with the static values in it) and the static
    keyword arguments; the output structure once the function has been traced."""

    __slots__ = ("op", "desc", "static_kw", "out_desc", "key")

    def __init__(self, op: "JaxOp", desc: tuple, static_kw: tuple, key: str) -> None:
        self.op, self.desc, self.static_kw, self.key = op, desc, static_kw, key
        self.out_desc: tuple | None = None

    def args_of(self, xs: Sequence[Any]) -> tuple[tuple, dict]:
        """The function's arguments with arrays `xs` in the tensor leaves' places and the statics in theirs."""
        args, kwargs = _build(self.desc, iter(xs))
        return args, {**kwargs, **dict(self.static_kw)}

    def call(self, xs: Sequence[Any]) -> tuple[list[Any], tuple]:
        """The user's function on arrays `xs` (the tensor leaves): its flat outputs and their structure."""
        args, kwargs = self.args_of(xs)
        flat: list[Any] = []
        desc = _flatten(self.op.fn(*args, **kwargs), flat, _is_array)
        return flat, desc


def _describe(xs: Sequence[Any]) -> str:
    parts = []
    for x in xs:
        shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
        parts.append(f"{list(shape)} {str(dtype).removeprefix('torch.')}" if shape is not None else repr(x))
    return "(" + ", ".join(parts) + ")"


def _jax() -> Any:
    from torch_tpu._jax import jax

    return jax


class JaxOp:
    """A JAX function callable on tpu tensors (see `jax_op`)."""

    def __init__(self, fn: Callable[..., Any], name: str | None, static_argnames: Sequence[str],
                 backward: Callable[..., Any] | None) -> None:
        self.fn = fn
        self.backward = backward
        self.static_argnames = tuple(static_argnames)
        self.fn_name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
        self.name = self._unique_name(name)
        self.qualname = f"{NAMESPACE}::{self.name}"
        self._keys: dict[Any, str] = {}
        self._define()
        _OPS[self.name] = self

    # ---- definition ----
    def _unique_name(self, name: str | None) -> str:
        with _LOCK:
            if name is not None:
                if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name) or name.endswith("_vjp"):
                    raise ValueError(f"torch.tpu.jax_op: name {name!r} must be a Python identifier not ending in "
                                     "'_vjp' (it names the op torch.ops.tpu_jax.<name>)")
                if name in _NAMES:
                    raise ValueError(f"torch.tpu.jax_op: an op named {NAMESPACE}::{name} exists already; pass "
                                     "another name=")
                _NAMES.add(name)
                return name
            base = re.sub(r"\W", "_", getattr(self.fn, "__name__", "fn")).strip("_") or "fn"
            if base[0].isdigit() or base.endswith("_vjp"):
                base = "fn_" + base
            for i in itertools.count(1):
                cand = base if i == 1 else f"{base}_{i}"
                if cand not in _NAMES:
                    _NAMES.add(cand)
                    return cand
        raise AssertionError  # unreachable

    def _define(self) -> None:
        fwd_name, vjp_name = self.qualname, self.qualname + "_vjp"
        fwd = torch.library.custom_op(fwd_name, self._eager_only, mutates_args=(),
                                      schema="(Tensor[] xs, str spec) -> Tensor[]")
        vjp = torch.library.custom_op(vjp_name, self._eager_only, mutates_args=(),
                                      schema="(Tensor[] xs, Tensor[] cts, str spec) -> Tensor[]")
        fwd.register_fake(self._fake_forward)
        vjp.register_fake(self._fake_vjp)
        fwd.register_autograd(self._backward, setup_context=self._setup_context)
        # The table's entries: every executor (eager, fused, torch.compile) finds them there.
        lower(fwd_name, variants=False)(self._lower_forward)
        lower(vjp_name, variants=False)(self._lower_vjp)
        _eager.install_lowering(fwd_name)
        _eager.install_lowering(vjp_name)
        self._fwd = getattr(torch.ops.tpu_jax, self.name).default
        self._vjp = getattr(torch.ops.tpu_jax, self.name + "_vjp").default

    def _eager_only(self, *args: Any) -> Any:  # the kernel of devices other than tpu
        tensors = [t for a in args if isinstance(a, (list, tuple)) for t in a]
        if not tensors:
            raise RuntimeError(f"torch.tpu.jax_op {self.fn_name}: a call needs at least one tpu tensor argument (it "
                               "places the call on that tensor's device); pass the inputs as tensors")
        raise RuntimeError(f"torch.tpu.jax_op {self.fn_name}: runs on tpu tensors only; got tensors on "
                           f"{sorted({str(t.device) for t in tensors})} with shapes {_describe(tensors)}. "
                           "Move them with .to('tpu') first.")

    # ---- the call ----
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(*args, **kwargs)

    def _call(self, *args: Any, **kwargs: Any) -> Any:
        """The call (what `jax_op` returns, wrapped so that Dynamo traces it: torch_tpu's files are on its skip
        list). It flattens the arguments, interns the call's structure and calls the op."""
        static_kw = []
        for k in self.static_argnames:
            if k in kwargs:
                static_kw.append((k, kwargs.pop(k)))
        tensors: list[torch.Tensor] = []
        desc = _flatten((args, kwargs), tensors, _is_tensor)
        self._check(tensors)
        key = _intern(self.name, desc, tuple(static_kw))  # (run by Dynamo at trace time: a constant string)
        out = self._fwd(tensors, key)
        return _build(_out_desc(key), iter(out))

    def _check(self, tensors: list[torch.Tensor]) -> None:
        for i, t in enumerate(tensors):
            try:
                _runtime.jax_dtype(t.dtype)
            except RuntimeError as e:
                raise RuntimeError(f"torch.tpu.jax_op {self.fn_name}: tensor argument {i} has dtype {t.dtype}, which "
                                   f"JAX cannot take (inputs {_describe(tensors)}): {e}") from None
            if t.device.type != "tpu":
                raise RuntimeError(
                    f"torch.tpu.jax_op {self.fn_name}: tensor argument {i} (shape {list(t.shape)}, {t.dtype}) is on "
                    f"{t.device}; every tensor argument must be a tpu tensor (inputs {_describe(tensors)}). "
                    "Move it with .to('tpu').")
            if t.device != tensors[0].device:
                raise RuntimeError(
                    f"torch.tpu.jax_op {self.fn_name}: tensor argument {i} is on {t.device} and argument 0 on "
                    f"{tensors[0].device}; one call runs on one device (inputs {_describe(tensors)})")

    def _spec(self, desc: tuple, static_kw: tuple) -> str:
        ident = (desc, static_kw)
        try:
            hash(ident)
        except TypeError:
            raise TypeError(f"torch.tpu.jax_op {self.fn_name}: static arguments (non-tensor values and "
                            f"static_argnames {list(self.static_argnames)}) must be hashable; got the structure "
                            f"{desc} and {dict(static_kw)}") from None
        key = self._keys.get(ident)
        if key is None:
            with _LOCK:
                key = self._keys.get(ident)
                if key is None:
                    key = f"{self.name}#{len(self._keys)}{_deferred._LOCAL}"
                    _SPECS[key] = _Spec(self, desc, static_kw, key)
                    self._keys[ident] = key
        return key

    # ---- lowerings (functions of arrays) ----
    def _traced(self, spec: _Spec, xs: Sequence[Any]) -> list[Any]:
        try:
            flat, tree = spec.call(xs)
        except Exception as e:
            raise type(e)(f"torch.tpu.jax_op {self.fn_name} failed on inputs {_describe(xs)} "
                          f"(static {dict(spec.static_kw)}): {e}") if _plain(e) else e
        bad = [repr(d[1])[:40] for d in _statics(tree)]
        if bad:
            raise TypeError(f"torch.tpu.jax_op {self.fn_name}: outputs must be arrays in tuples/lists/dicts; got "
                            f"the non-array values {bad} (inputs {_describe(xs)})")
        if spec.out_desc is None:
            spec.out_desc = tree
        elif spec.out_desc != tree:
            raise RuntimeError(f"torch.tpu.jax_op {self.fn_name}: its output structure changed with the input shapes "
                               f"{_describe(xs)} ({spec.out_desc} before, {tree} now); one op call must keep one "
                               "output structure")
        return flat

    def _lower_forward(self, xs: list, spec: str) -> tuple:
        return tuple(self._traced(_SPECS[spec], xs))

    def _lower_vjp(self, xs: list, cts: list, spec: str) -> tuple:
        jax = _jax()
        import jax.numpy as jnp
        import numpy as np

        s = _SPECS[spec]
        diff = [i for i, x in enumerate(xs) if jnp.issubdtype(x.dtype, jnp.inexact)]
        f = self._differentiable(s, xs)
        outs, pull = jax.vjp(f, *xs)
        # PyTorch's complex gradients are the conjugates of JAX's (conjugate Wirtinger calculus): its gradient is
        # conj(vjp(conj(cotangent))); for real dtypes conj is the identity.
        cts = [jnp.conj(c.astype(o.dtype)) if jnp.issubdtype(o.dtype, jnp.inexact)
               else np.zeros(o.shape, jax.dtypes.float0) for c, o in zip(cts, outs)]
        grads = pull(tuple(cts))
        return tuple(jnp.conj(grads[i]) if jnp.iscomplexobj(xs[i]) else grads[i] for i in diff)

    def _differentiable(self, s: _Spec, xs: Sequence[Any]) -> Callable[..., Any]:
        """The flat function of all tensor leaves, with the user's backward where one is given."""
        def f(*a: Any) -> tuple:
            return tuple(self._traced(s, a))

        if self.backward is None:
            return f
        jax = _jax()
        import jax.numpy as jnp

        g = jax.custom_vjp(f)

        def g_fwd(*a: Any) -> tuple:
            return f(*a), a

        def g_bwd(res: tuple, ct: tuple) -> tuple:
            args, kwargs = s.args_of(res)
            ct_tree = _build(s.out_desc, iter(ct))
            given = self.backward(ct_tree, *args, **kwargs)
            arg_descs = s.desc[1][0][1]  # (the structure is ((args...), {kwargs}))
            if not isinstance(given, (tuple, list)) or len(given) != len(arg_descs):
                raise TypeError(f"torch.tpu.jax_op {self.fn_name}: backward must return a tuple with one gradient "
                                f"(or None) per positional argument ({len(arg_descs)}); got {type(given).__name__}"
                                + (f" of length {len(given)}" if isinstance(given, (tuple, list)) else ""))
            grads: list[Any] = []
            arrays = iter(res)
            for d, g_arg in zip(arg_descs, given):
                n = _count(d)
                g_leaves: list[Any] = []
                if g_arg is not None:
                    _flatten(g_arg, g_leaves, _is_array)
                    if len(g_leaves) != n:
                        raise TypeError(f"torch.tpu.jax_op {self.fn_name}: backward gave {len(g_leaves)} gradient "
                                        f"arrays for an argument with {n} tensors")
                for j in range(n):
                    x = next(arrays)
                    grads.append(None if g_arg is None or not jnp.issubdtype(x.dtype, jnp.inexact)
                                 else jnp.asarray(g_leaves[j]).astype(x.dtype).reshape(x.shape))
            grads.extend(None for _ in arrays)  # tensors passed by keyword: no gradient
            return tuple(grads)

        g.defvjp(g_fwd, g_bwd)
        return g

    # ---- fake implementations (jax.eval_shape) ----
    def _fake_forward(self, xs: list[torch.Tensor], spec: str) -> list[torch.Tensor]:
        jax = _jax()
        structs = [_struct(jax, t) for t in xs]
        out = jax.eval_shape(lambda *a: self._lower_forward(list(a), spec), *structs)
        return [_empty(o, xs) for o in out]

    def _fake_vjp(self, xs: list[torch.Tensor], cts: list[torch.Tensor], spec: str) -> list[torch.Tensor]:
        return [torch.empty_like(x) for x in xs if x.dtype.is_floating_point or x.dtype.is_complex]

    # ---- autograd ----
    @staticmethod
    def _setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        xs, spec = inputs
        ctx.spec = spec
        ctx.save_for_backward(*xs)
        ctx.outs = [(o.shape, o.dtype, o.device) for o in output]

    def _backward(self, ctx: Any, grads: Sequence[torch.Tensor | None]) -> tuple:
        xs = list(ctx.saved_tensors)
        cts = [g if g is not None else torch.zeros(shape, dtype=dtype, device=device)
               for g, (shape, dtype, device) in zip(grads, ctx.outs)]
        got = iter(self._vjp(xs, cts, ctx.spec))
        return [next(got) if x.dtype.is_floating_point or x.dtype.is_complex else None for x in xs], None


def _statics(desc: tuple) -> list[tuple]:
    if desc[0] == "static":
        return [desc]
    if desc[0] == "T":
        return []
    return [x for d in desc[-1] for x in _statics(d)]


@assume_constant_result
def _intern(name: str, desc: tuple, static_kw: tuple) -> str:
    """The spec string of a call structure of op `name` (Dynamo runs this at trace time: the result is a constant
    of the graph, and the table entry exists for the fake implementation and the lowering)."""
    return _OPS[name]._spec(desc, static_kw)


@assume_constant_result
def _out_desc(key: str) -> tuple:
    """The output structure of spec `key`, known once the op has run or been traced (fake implementation)."""
    desc = _SPECS[key].out_desc
    if desc is None:
        raise RuntimeError(f"torch.tpu.jax_op: the output structure of {key} is unknown after its call")
    return desc


def _plain(e: Exception) -> bool:
    """An exception whose type takes one message (so the function's name and shapes can be added to it)."""
    try:
        type(e)("")
    except Exception:
        return False
    return type(e).__module__ == "builtins"


def _struct(jax: Any, t: torch.Tensor) -> Any:
    shape = tuple(int(s) for s in t.shape)  # symbolic sizes are specialised: XLA programs have static shapes
    return jax.ShapeDtypeStruct(shape, _runtime.jax_dtype(t.dtype))


def _empty(o: Any, xs: list[torch.Tensor]) -> torch.Tensor:
    dtype = _runtime.torch_dtype(o.dtype)
    if xs:
        return xs[0].new_empty(tuple(o.shape), dtype=dtype)
    return torch.empty(tuple(o.shape), dtype=dtype, device="tpu")


def jax_op(fn: Callable[..., Any] | None = None, *, name: str | None = None,
           static_argnames: Sequence[str] | str = (), backward: Callable[..., Any] | None = None) -> Any:
    """Turns a JAX (or Pallas) function into a torch op on tpu tensors: `jax_op(fn)` or `@jax_op(name=...)`.

    Tensor leaves of the arguments (nested tuples, lists, dicts) become JAX arrays; other leaves, and the keyword
    arguments named in `static_argnames`, are static: passed as the Python values (hashable; a new value traces and
    compiles again). The function returns an array or a pytree of arrays, which come back as tpu tensors. Autograd
    is `jax.vjp` of the function, or `backward(cotangents, *args, **kwargs)` (a JAX function returning one gradient
    or None per positional argument). Runs in DEFER_NEVER, DEFER_AND_FUSE and `torch.compile(backend="tpu")`.
    """
    if isinstance(static_argnames, str):
        static_argnames = (static_argnames,)

    def make(f: Callable[..., Any]) -> Callable[..., Any]:
        if not callable(f):
            raise TypeError(f"torch.tpu.jax_op: expected a function, got {type(f).__name__}")
        op = JaxOp(f, name, static_argnames, backward)
        call = dont_skip_tracing(op._call)  # a function Dynamo traces (torch_tpu's own files are skipped)
        functools.update_wrapper(call, f)
        call.jax_op = op  # type: ignore[attr-defined]
        return call

    return make(fn) if fn is not None else make
