"""Random numbers on tpu: how a tpu generator's state becomes JAX keys, in one place for every executor.

- Generator state: a tpu `torch.Generator` is a (seed, offset) pair kept in C++ (runtime/TpuGenerator.cpp), like
  CUDA's Philox state. Each random op call takes one step: it reads (seed, offset) and advances the offset by 1
  (`draw`, `program_draw`), so runs are reproducible under a seed and get_state/set_state round-trip.
- Key: `key(seed, offset)` is jax.random.key(seed) folded with the offset's low and then its high 32 bits. It is
  computed inside the jitted program from (seed, offset) passed as uint64 arguments, so a new draw never
  recompiles.
- Eager draws (kernels/creation.py, dropout): each op call draws its own (seed, offset) from the generator it
  was given (the device's default one otherwise) and its sampler builds `key(seed, offset)`.
- Traced programs (torch.compile graphs, torch_tpu/_compile.py): each program call draws one (seed, offset) from
  the device's default generator; the program traces its graph under `trace_random(key(seed, offset))`, and
  its i-th random lowering (1-based, in graph order) draws from `next_trace_key()` = fold_in(that key, i).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch

from torch_tpu import _C
from torch_tpu._jax import jax, jnp


_default_generators: tuple[torch.Generator, ...] | None = None


def default_generators() -> tuple[torch.Generator, ...]:
    """The default generator of each tpu device (`torch.tpu.default_generators`), made once."""
    global _default_generators
    if _default_generators is None:
        _default_generators = tuple(_C._default_generator(i) for i in range(_C._device_count()))
    return _default_generators


def generator_for(generator: torch.Generator | None, t: torch.Tensor) -> torch.Generator:
    """The generator a random op on tensor `t` draws from: `generator`, or the default one of t's device."""
    if generator is None:
        return default_generators()[t.device.index]
    if generator.device.type != "tpu":
        raise RuntimeError(
            f"Expected a 'tpu' device type for generator but found '{generator.device.type}'"
        )
    return generator


def draw(generator: torch.Generator | None, t: torch.Tensor) -> tuple[Any, Any]:
    """One step of the generator of an eager random op on `t`: (seed, offset) as uint64 scalars for its
    sampler, which makes them a key with `key`. Host (numpy) scalars, program inputs like any argument:
    `jnp.uint64(...)` would be a device transfer each (dropout on a 64x64 tensor took 461 us a call with them, 204
    us without; 239 vs 38 us under DEFER_AND_FUSE)."""
    return _step(generator_for(generator, t))


def program_draw(index: int) -> tuple[Any, Any]:
    """One step of tpu:`index`'s default generator for one call of a traced program: (seed, offset) as host
    uint64 scalars, passed to the program as its last two arguments."""
    return _step(default_generators()[index])


# ---- draws inside a tpu graph capture (torch_tpu/_graphs.py) ----
# While a thread's ops are captured into a graph, its draws (and those of the autograd threads working for it: keyed
# by _C._graph_owner()) are `Drawn` values: inputs of the captured program that each replay draws again from the
# same generator, in capture order, so every replay gets new random numbers (CUDA graphs advance their Philox
# offsets per replay the same way). A plain number would be a constant of the program: the same mask every replay.
_capturing: dict[int, list[tuple["Drawn", "Drawn"]]] = {}  # graph owner thread -> its capture's draws


def capturing() -> bool:
    """True while the calling thread's tpu work is captured into a graph (`torch.tpu.is_current_stream_capturing`)."""
    return bool(_capturing) and _C._graph_owner() in _capturing


class Drawn:
    """A (seed or offset) uint64 of a generator step drawn while a graph was captured: a program input."""

    __slots__ = ("generator", "value", "shape", "dtype", "weak_type", "aval")

    def __init__(self, generator: torch.Generator, value: Any) -> None:
        self.generator = generator
        self.value = value  # the capture's own draw (what the program is compiled with)
        self.shape, self.dtype, self.weak_type, self.aval = (), value.dtype, False, None

    def __repr__(self) -> str:
        return "Drawn(uint64)"


def _step(gen: torch.Generator) -> tuple[Any, Any]:
    seed, offset = _C._philox_step(gen, 1)
    if _capturing:
        draws = _capturing.get(_C._graph_owner())
        if draws is not None:
            pair = (Drawn(gen, np.uint64(seed)), Drawn(gen, np.uint64(offset)))
            draws.append(pair)
            return pair
    return np.uint64(seed), np.uint64(offset)


def key(seed: Any, offset: Any) -> Any:
    """The JAX key of one generator step (seed, offset), both uint64 (traced or concrete)."""
    k = jax.random.key(seed)
    k = jax.random.fold_in(k, (offset & 0xFFFFFFFF).astype(jnp.uint32))
    return jax.random.fold_in(k, (offset >> 32).astype(jnp.uint32))


# ---- key streams of traced programs ----

_trace_rng = threading.local()


class trace_random:
    """`with trace_random(key):` random lowerings traced inside draw from `key` (one fold per random op)."""

    def __init__(self, key: Any) -> None:
        self.key = key

    def __enter__(self) -> None:
        self.saved = getattr(_trace_rng, "state", None)
        _trace_rng.state = [self.key, 0]

    def __exit__(self, *exc: Any) -> None:
        _trace_rng.state = self.saved


def next_trace_key() -> Any:
    """The key of the next random lowering traced under `trace_random`."""
    state = getattr(_trace_rng, "state", None)
    if state is None:
        raise NotImplementedError("a random op traced without a key: the executor must trace it under trace_random")
    state[1] += 1
    return jax.random.fold_in(state[0], state[1])
