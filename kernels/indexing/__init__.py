"""Indexing, joining and shape ops: advanced indexing (index / index_put), gather and scatter, the index_* family,
masked fills and masked_select, cat, nonzero / unique / bincount (data-dependent shapes, run eagerly), flips, rolls, repeats,
triangles, padding and diagonals.

Data-dependent lowerings (`jit=False`) receive concrete arrays; they do the shape-deciding work eagerly and
hand the rest to small cached `jax.jit` functions so results stay on the inputs' device.

Index values are checked on the device (torch_tpu/_checks.py): every op that indexes with a tensor (index /
index_put integer indices, gather, scatter*, index_select, index_add/copy/fill/reduce, take, put, embedding)
calls `report_bad_index` while it is traced, and an out-of-range index raises the error CPU raises (IndexError or
RuntimeError) at the next synchronization point, as CUDA's device-side asserts do. The computed values of such
an op are unspecified (XLA clamps gathers and drops scattered updates), never returned without the error.

One module per family: advanced (index / index_put and the masked-index ops), gather_scatter, index_ops (the
index_* family), masks (masked_fill / masked_scatter, nonzero, masked_select), take_put, rearrange (flips, rolls,
repeats, triangles), padding, diagonal, slicing (slicing copies and cat), unique and counting (bincount,
repeat_interleave, isin); the helpers they share, including the cached jitted count / bounds / nonzero functions,
are in _common. Importing this package imports every family module, which registers its lowerings: a new family
module is added to the imports below.
"""

from torch_tpu.kernels.indexing import (  # noqa: F401  (imported for their registrations, in this order)
    _common,
    advanced,
    gather_scatter,
    index_ops,
    masks,
    take_put,
    rearrange,
    padding,
    diagonal,
    slicing,
    unique,
    counting,
)

# The public names of the former module kernels/indexing.py stay importable from torch_tpu.kernels.indexing.
from torch_tpu.kernels.indexing._common import *  # noqa: E402,F401,F403
from torch_tpu.kernels.indexing.advanced import *  # noqa: E402,F401,F403
from torch_tpu.kernels.indexing.gather_scatter import *  # noqa: E402,F401,F403
from torch_tpu.kernels.indexing.index_ops import *  # noqa: E402,F401,F403
from torch_tpu.kernels.indexing.masks import *  # noqa: E402,F401,F403
from torch_tpu.kernels.indexing.take_put import *  # noqa: E402,F401,F403
from torch_tpu.kernels.indexing.rearrange import *  # noqa: E402,F401,F403
from torch_tpu.kernels.indexing.padding import *  # noqa: E402,F401,F403
from torch_tpu.kernels.indexing.diagonal import *  # noqa: E402,F401,F403
from torch_tpu.kernels.indexing.slicing import *  # noqa: E402,F401,F403
from torch_tpu.kernels.indexing.unique import *  # noqa: E402,F401,F403
from torch_tpu.kernels.indexing.counting import *  # noqa: E402,F401,F403
