"""PyTorch's functional collectives (`torch.ops._c10d_functional`) inside `torch.compile(backend="tpu")` graphs.

A compiled graph with a collective becomes one SPMD XLA program over the group's devices (torch_tpu/_compile.py
wraps it in `jax.shard_map` over the group's one-axis mesh, the same mesh tpu_dist's eager collectives use,
distributed/_programs.py): every rank runs the same program on its own arrays, and the collective is an XLA
collective inside it (`all-reduce`, `all-gather`, `reduce-scatter`, `all-to-all`), fused with the compute around
it; no eager collective and no graph break. The lowerings below are the same bodies as the eager programs'
(`_programs`), called on the program's local values; `wait_tensor` is the identity (XLA orders the collective).

They are trace-only entries of the kernel table: eager calls of these ops keep their tpu_dist kernels
(distributed/_functional.py). One graph runs on one mesh: every collective of a graph must use groups over the same
ranks.
"""

from __future__ import annotations

from typing import Any, Sequence

from torch_tpu._jax import lax
from torch_tpu.distributed import _programs
from torch_tpu.kernels.registry import lower

NAMESPACE = "_c10d_functional"
_T = dict(trace_only=True, variants=False)
_N = NAMESPACE + "::"


def _group(group_name: Any) -> Any:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


def _op(reduce_op: str) -> str:
    op = reduce_op.lower()
    if op == "premul_sum" or op not in _programs.REDUCE_OPS:
        raise ValueError(f"tpu_dist: functional collectives in compiled graphs support reduce ops "
                         f"{', '.join(o for o in _programs.REDUCE_OPS if o != 'premul_sum')}, not {reduce_op!r} "
                         "(a string carries no PREMUL_SUM factor: multiply the input and use 'sum')")
    return op


def _size(group_name: Any, group_size: int | None = None) -> int:
    n = _group(group_name).size()
    if group_size is not None and group_size != n:
        raise ValueError(f"tpu_dist: group_size={group_size} but group {group_name!r} has {n} ranks")
    return n


@lower(_N + "all_reduce", **_T)
def all_reduce(input: Any, reduce_op: str, group_name: str) -> Any:
    return _programs._allreduce_value(input, _op(reduce_op), _size(group_name))


@lower(_N + "all_reduce_coalesced", **_T)
def all_reduce_coalesced(inputs: Sequence[Any], reduce_op: str, group_name: str) -> list[Any]:
    return [all_reduce(x, reduce_op, group_name) for x in inputs]


@lower(_N + "all_gather_into_tensor", **_T)
def all_gather_into_tensor(input: Any, group_size: int, group_name: str) -> Any:
    _size(group_name, group_size)
    if input.ndim == 0:
        return lax.all_gather(input, _programs.AXIS)
    return lax.all_gather(input, _programs.AXIS, tiled=True)


@lower(_N + "all_gather_into_tensor_coalesced", **_T)
def all_gather_into_tensor_coalesced(inputs: Sequence[Any], group_size: int, group_name: str) -> list[Any]:
    return [all_gather_into_tensor(x, group_size, group_name) for x in inputs]


@lower(_N + "reduce_scatter_tensor", **_T)
def reduce_scatter_tensor(input: Any, reduce_op: str, group_size: int, group_name: str) -> Any:
    n = _size(group_name, group_size)
    if input.ndim == 0 or input.shape[0] % n:
        raise RuntimeError(f"tpu_dist: reduce_scatter_tensor: dimension 0 of {list(input.shape)} is not divisible "
                           f"by the group size {n}")
    return _programs.reduce_scatter(_op(reduce_op), n, tiled=True)(input)


@lower(_N + "reduce_scatter_tensor_coalesced", **_T)
def reduce_scatter_tensor_coalesced(inputs: Sequence[Any], reduce_op: str, group_size: int, group_name: str
                                    ) -> list[Any]:
    return [reduce_scatter_tensor(x, reduce_op, group_size, group_name) for x in inputs]


@lower(_N + "all_to_all_single", **_T)
def all_to_all_single(input: Any, output_split_sizes: Sequence[int], input_split_sizes: Sequence[int],
                      group_name: str) -> Any:
    n = _size(group_name)
    rows = input.shape[0]
    even = [rows // n] * n
    if rows % n or list(output_split_sizes or even) != even or list(input_split_sizes or even) != even:
        raise NotImplementedError(
            f"tpu_dist: all_to_all_single with uneven splits (input {list(input.shape)}, output splits "
            f"{list(output_split_sizes)}, input splits {list(input_split_sizes)}) cannot be one XLA program (its "
            "output shape depends on other ranks' values): use equal splits, or call it outside the compiled region")
    chunks = input.reshape((n, rows // n) + tuple(input.shape[1:]))
    return _programs.all_to_all()(chunks).reshape(input.shape)


@lower(_N + "broadcast", **_T)
def broadcast(input: Any, src: int, group_name: str) -> Any:
    _size(group_name)
    return _programs.broadcast(src)(input)[0]


@lower(_N + "wait_tensor", **_T)
def wait_tensor(tensor: Any) -> Any:
    return tensor


def is_collective(op: Any) -> bool:
    """True for an OpOverload of the functional collectives' namespace."""
    return getattr(op, "namespace", None) == NAMESPACE


def _group_arg(node: Any) -> Any:
    schema = node.target._schema
    for i, a in enumerate(schema.arguments):
        if a.name == "group_name":
            return node.args[i] if i < len(node.args) else node.kwargs.get("group_name")
    return None


def program_mesh(nodes: Sequence[Any], graph: str) -> tuple[Any, Any] | None:
    """For an aten graph's nodes: None when it has no collective; else (the JAX mesh its program runs on, the
    tpu_dist process group). Raises when the collectives use groups over different ranks or another backend."""
    groups: dict[tuple[int, ...], list[Any]] = {}
    for node in nodes:
        if node.op != "call_function" or not is_collective(node.target):
            continue
        name = _group_arg(node)
        if name is None:
            continue  # wait_tensor
        pg = _group(name)
        from torch_tpu.distributed.process_group import ProcessGroupTPU

        backend = pg._get_backend(None) if hasattr(pg, "_get_backend") else pg
        if not isinstance(pg, ProcessGroupTPU) and not isinstance(backend, ProcessGroupTPU):
            raise NotImplementedError(
                f"torch.compile(backend='tpu'): {node.target} (node {node.name} of {graph}) uses group {name!r}, "
                f"which is not a tpu_dist group ({type(pg).__name__}): create the group with backend='tpu_dist'")
        tpg = pg if isinstance(pg, ProcessGroupTPU) else backend
        groups.setdefault(tpg.ranks, []).append(tpg)
    if not groups:
        return None
    if len(groups) > 1:
        raise NotImplementedError(
            f"torch.compile(backend='tpu'): {graph} has collectives over several groups "
            f"({', '.join(str(list(r)) for r in groups)}); one compiled program runs on one mesh. Split the step so "
            "that each compiled function uses one group, or run the other collectives outside it.")
    from torch_tpu.distributed import _world

    (ranks, pgs), = groups.items()
    return _world.mesh(ranks), pgs[0]


def wait_for_group(pg: Any) -> None:
    """Waits until the group's eager collectives issued before this point have run (its communication stream), so a
    compiled program's collectives come after them on every rank, in program order."""
    pg._submit("compiled program (ordering)", lambda: []).wait()


def axis_name() -> str:
    return _programs.AXIS
