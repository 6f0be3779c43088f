// Autocast for tpu (torch.autocast("tpu", dtype=torch.bfloat16)): PyTorch's own per-op policy lists
// (AT_FORALL_LOWER_PRECISION_FP, AT_FORALL_FP32, ...), the same ones CUDA and XPU use, registered for
// AutocastPrivateUse1. Matmuls and convolutions run in the autocast dtype; precision-sensitive ops
// (reductions, losses, norms, exp/log) in float32; mixed-dtype ops promote.
#include <ATen/autocast_mode.h>
#include <torch/library.h>

namespace torch_tpu {
namespace {

using at::IntArrayRef;
using at::Scalar;
using at::ScalarType;
using at::Tensor;
using at::autocast::CastPolicy;

#define _KERNEL_TPU_LOW_PRECISION_FP(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, lower_precision_fp)
#define _KERNEL_TPU_FP32(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32)
#define _KERNEL_TPU_FP32_SET_OPT_DTYPE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32_set_opt_dtype)
#define _KERNEL_TPU_PROMOTE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, promote)

// Ops not on the lists pass through unchanged.
TORCH_LIBRARY_IMPL(_, AutocastPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFallthrough());
}

TORCH_LIBRARY_IMPL(aten, AutocastPrivateUse1, m) {
  AT_FORALL_LOWER_PRECISION_FP(_KERNEL_TPU_LOW_PRECISION_FP)
  AT_FORALL_FP32(_KERNEL_TPU_FP32)
  AT_FORALL_FP32_SET_OPT_DTYPE(_KERNEL_TPU_FP32_SET_OPT_DTYPE)
  AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE(KERNEL_DIFFERENT_REDISPATCH_SIGNATURE_PRIVATEUSEONE)
  AT_FORALL_PROMOTE(_KERNEL_TPU_PROMOTE)
}

}  // namespace
}  // namespace torch_tpu
