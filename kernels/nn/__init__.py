"""torch.nn.functional's ATen ops and their backward ops: convolution, pooling, normalization, softmax,
activations, losses, upsampling and dropout.

Conventions: bfloat16/float16 inputs compute in float32 ("opmath", as PyTorch's CPU kernels do) and round once
at the end; float32 matmul-like work (convolution) runs at HIGHEST precision. Window and interpolation indices
depend only on static shapes, so they are computed with numpy at trace time. Backward ops of linear forward ops
(convolution, average pooling, upsampling) are the JAX VJP of the forward lowering. Where ATen returns an
undefined tensor (an output masked off by `output_mask`), these kernels return None, which the executors pass
through and the dispatcher turns into an undefined tensor (DTensor's sharding rules give such outputs no spec and
refuse a tensor there).

One module per family: conv, pooling (with im2col / col2im and channel_shuffle), normalization, softmax,
activation, loss, embedding (the embedding's backward, embedding_bag), upsample, sampling (grid_sample),
distance (cdist, pdist), dropout and rnn (fused LSTM / GRU cells); the
helpers they share are in _common. Importing this package imports every family module, which registers its
lowerings: a new family module is added to the imports below.
"""

from torch_tpu.kernels.nn import (  # noqa: F401  (imported for their registrations, in this order)
    _common,
    conv,
    pooling,
    normalization,
    softmax,
    activation,
    loss,
    embedding,
    upsample,
    sampling,
    distance,
    dropout,
    rnn,
    flex_attention,
)

# The public names of the former module kernels/nn.py stay importable from torch_tpu.kernels.nn.
from torch_tpu.kernels.nn._common import *  # noqa: E402,F401,F403
from torch_tpu.kernels.nn.conv import *  # noqa: E402,F401,F403
from torch_tpu.kernels.nn.pooling import *  # noqa: E402,F401,F403
from torch_tpu.kernels.nn.normalization import *  # noqa: E402,F401,F403
from torch_tpu.kernels.nn.softmax import *  # noqa: E402,F401,F403
from torch_tpu.kernels.nn.activation import *  # noqa: E402,F401,F403
from torch_tpu.kernels.nn.loss import *  # noqa: E402,F401,F403
from torch_tpu.kernels.nn.embedding import *  # noqa: E402,F401,F403
from torch_tpu.kernels.nn.upsample import *  # noqa: E402,F401,F403
from torch_tpu.kernels.nn.sampling import *  # noqa: E402,F401,F403
from torch_tpu.kernels.nn.distance import *  # noqa: E402,F401,F403
from torch_tpu.kernels.nn.dropout import *  # noqa: E402,F401,F403
from torch_tpu.kernels.nn.rnn import *  # noqa: E402,F401,F403
