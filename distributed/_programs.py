"""The XLA programs behind tpu_dist's collectives: one `shard_map` over a one-axis mesh ("r", one device per
rank of the group) per collective, jit-compiled and cached by (collective, ranks, static arguments); jit keys
the compiled executables on shapes and dtypes. On TPU they run over ICI/DCN, on XLA:CPU over gloo.

Each program takes, per tensor, a global array whose shard on rank i is rank i's local array (the global array
is their concatenation along axis 0: no copy to build it), and returns arrays of the same layout, so each
rank's result is its shard, again without a copy.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from torch_tpu._jax import jax, jnp, lax

AXIS = "r"
REDUCE_OPS = ("sum", "avg", "product", "min", "max", "band", "bor", "bxor", "premul_sum")


def _reduce_gathered(g: Any, op: str) -> Any:
    """Reduces an all-gathered stack (axis 0 = ranks) with one of the non-sum ops."""
    if op == "product":
        return jnp.prod(g, axis=0).astype(g.dtype)
    fn = {"band": jnp.bitwise_and, "bor": jnp.bitwise_or, "bxor": jnp.bitwise_xor}[op]
    return functools.reduce(fn, [g[i] for i in range(g.shape[0])])


def _allreduce_value(v: Any, op: str, n: int) -> Any:
    dtype = v.dtype
    if dtype == jnp.bool_:  # as NCCL: sum/max/bor are a logical or, product/min/band a logical and
        v = v.astype(jnp.int32)
        op = {"sum": "max", "avg": "max", "bor": "max", "product": "min", "band": "min"}.get(op, op)
    if op in ("sum", "avg"):
        out = lax.psum(v, AXIS)
        if op == "avg":
            out = out / n
    elif op == "min":
        out = lax.pmin(v, AXIS)
    elif op == "max":
        out = lax.pmax(v, AXIS)
    else:
        out = _reduce_gathered(lax.all_gather(v, AXIS), op)
    return out.astype(dtype)


def _mask_from_root(v: Any, root: int) -> Any:
    """v on the root rank, zeros elsewhere (bools as int8), for a psum that carries the root's value."""
    if v.dtype == jnp.bool_:
        v = v.astype(jnp.int8)
    return jnp.where(lax.axis_index(AXIS) == root, v, jnp.zeros_like(v))


# ---- bodies: each sees this rank's local arrays and returns this rank's local results ----

def _premultiplied(xs: tuple, op: str) -> tuple[tuple, str]:
    """PREMUL_SUM: the last input is this rank's factor, shape (1,); each tensor is multiplied by it, cast to
    the tensor's dtype (as NCCL casts its scalar), then summed."""
    if op != "premul_sum":
        return xs, op
    *xs, factor = xs
    return tuple(x * factor.reshape(()).astype(x.dtype) for x in xs), "sum"


def allreduce(op: str, n: int) -> Callable[..., Any]:
    def body(*xs: Any) -> tuple:
        xs, red = _premultiplied(xs, op)
        return tuple(_allreduce_value(x, red, n) for x in xs)
    return body


def broadcast(root: int) -> Callable[..., Any]:
    def body(*xs: Any) -> tuple:
        return tuple(lax.psum(_mask_from_root(x, root), AXIS).astype(x.dtype) for x in xs)
    return body


def allgather(tiled: bool = False) -> Callable[..., Any]:
    def body(x: Any) -> Any:
        return lax.all_gather(x, AXIS, tiled=tiled)  # (n, *shape), or (n * shape[0], *shape[1:]) tiled
    return body


def _with_axis0(v: Any) -> Any:
    return v.reshape(1) if v.ndim == 0 else v


def reduce_scatter(op: str, n: int, tiled: bool) -> Callable[..., Any]:
    """Local input (n, *chunk), or (n * k, *rest) when tiled: rank i gets the reduction over ranks of chunk i."""
    def body(*xs: Any) -> Any:
        (v,), red = _premultiplied(xs, op)
        if red in ("sum", "avg") and v.dtype != jnp.bool_:
            out = lax.psum_scatter(v, AXIS, scatter_dimension=0, tiled=tiled)
            if red == "avg":
                out = (out / n).astype(v.dtype)
        else:
            full = _allreduce_value(v, red, n)
            if tiled:
                k = v.shape[0] // n
                out = lax.dynamic_slice_in_dim(full, lax.axis_index(AXIS) * k, k, 0)
            else:
                out = lax.dynamic_index_in_dim(full, lax.axis_index(AXIS), 0, keepdims=False)
        return _with_axis0(out)
    return body


def all_to_all() -> Callable[..., Any]:
    """Local input (n, M, *rest): chunk j goes to rank j; output row j is what rank j sent here."""
    def body(x: Any) -> Any:
        return lax.all_to_all(x, AXIS, 0, 0)
    return body


def scatter(root: int) -> Callable[..., Any]:
    """Local input (n, *shape), meaningful on the root only: rank i gets the root's row i."""
    def body(x: Any) -> Any:
        out = lax.psum_scatter(_mask_from_root(x, root), AXIS, scatter_dimension=0, tiled=False)
        return _with_axis0(out.astype(x.dtype))
    return body


def transfer(src: int) -> Callable[..., Any]:
    """A two-device mesh (lower rank, higher rank): the other position gets position `src`'s array."""
    def body(x: Any) -> Any:
        return lax.ppermute(x, AXIS, [(src, 1 - src)])
    return body


def swap() -> Callable[..., Any]:
    """A two-device mesh: both positions send at once (x0 from position 0, x1 from position 1; each side passes
    zeros for the other's)."""
    def body(x0: Any, x1: Any) -> tuple:
        return lax.ppermute(x0, AXIS, [(0, 1)]), lax.ppermute(x1, AXIS, [(1, 0)])
    return body


# ---- compiled programs, cached ----

_cache: dict[tuple, Any] = {}


def program(kind: str, ranks: tuple[int, ...], static: tuple, n_in: int, build: Callable[[], Callable],
            n_out: int | None = None) -> Any:
    """n_out: the number of results when it differs from n_in (PREMUL_SUM's factor is an input only)."""
    n_out = n_in if n_out is None else n_out
    key = (kind, ranks, static, n_in, n_out)
    fn = _cache.get(key)
    if fn is None:
        from jax.sharding import PartitionSpec as P

        from torch_tpu.distributed import _world

        specs = tuple(P(AXIS) for _ in range(n_in))
        out_specs = tuple(P(AXIS) for _ in range(n_out))
        body = build()
        multi_out = n_out > 1 or kind in ("allreduce", "broadcast")
        fn = jax.jit(jax.shard_map(body, mesh=_world.mesh(ranks), in_specs=specs,
                                   out_specs=out_specs if multi_out else P(AXIS)))
        _cache[key] = fn
    return fn


def clear() -> None:
    _cache.clear()


def run(kind: str, ranks: tuple[int, ...], static: tuple, arrays: list, build: Callable[[], Callable],
        n_out: int | None = None) -> list:
    """Runs a collective over the devices of `ranks`; `arrays` are this rank's local values. Returns this
    rank's local results (the first n_out arrays' layouts). Scalars travel as shape (1,) (a shard needs an
    axis 0)."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from torch_tpu.distributed import _world

    n = len(ranks)
    sharding = NamedSharding(_world.mesh(ranks), P(AXIS))
    scalars = [a.ndim == 0 for a in arrays]
    arrays = [a.reshape(1) if s else a for a, s in zip(arrays, scalars)]
    glob = [jax.make_array_from_single_device_arrays((n * a.shape[0],) + tuple(a.shape[1:]), sharding, [a])
            for a in arrays]
    out = program(kind, ranks, static, len(arrays), build, n_out)(*glob)
    if not isinstance(out, (tuple, list)):
        out = (out,)
    local = [o.addressable_shards[0].data for o in out]
    # Wait here, on the group's worker thread: a collective that never completes (a dead or hung peer) then
    # shows up as a Work that does not finish within the timeout, never as a later host read that hangs.
    for v in local:
        v.block_until_ready()
    if kind in ("allreduce", "broadcast"):
        local = [v.reshape(()) if s else v for v, s in zip(local, scalars)]
    return local
