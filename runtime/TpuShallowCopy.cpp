// Whether `var.data = other` may keep `var`'s TensorImpl (aten::_has_compatible_shallow_copy_type).
//
// nn.Module._apply (`.to()`, `.cpu()`, `.tpu()`, `.double()`...) keeps each Parameter, buffer and `.grad`
// object, and so tied weights and the optimizers that hold them, only when this op says the old and new
// tensors are compatible; `Variable.set_data` checks it again before `TensorImpl::shallow_copy_from`
// copies the key set, storage and device over. c10's default rule counts only the in-tree dense backends
// (CPU, CUDA, MPS, HIP, XPU, HPU, MTIA), so without this kernel every move between cpu and tpu made a new
// Parameter: ties split and an optimizer built before the move updated tensors the model no longer used.
// The rule here is c10's rule with PrivateUse1 (tpu) added to the dense backends, nothing else: sparse,
// meta and other layouts get exactly c10's answer, as on CUDA. A tpu tensor's TensorImpl is a plain
// TensorImpl whose storage owns a device array; nothing in it depends on the backend once the storage,
// key set and device are swapped, so shallow-copying between cpu and tpu is what CUDA does.
#include "TpuRuntime.h"

#include <ATen/core/Tensor.h>
#include <c10/core/DispatchKeySet.h>
#include <torch/library.h>

namespace torch_tpu {
namespace {

bool is_dense_tensor(c10::DispatchKeySet ks) {
  constexpr auto dense_backends = c10::DispatchKeySet(
      {c10::BackendComponent::CPUBit, c10::BackendComponent::CUDABit, c10::BackendComponent::MPSBit,
       c10::BackendComponent::HIPBit, c10::BackendComponent::XPUBit, c10::BackendComponent::HPUBit,
       c10::BackendComponent::MTIABit, c10::BackendComponent::PrivateUse1Bit});
  return ks.has(c10::DispatchKey::Dense) && ks.has_any(dense_backends);
}

bool has_compatible_shallow_copy_type(const at::Tensor& self, const at::Tensor& from) {
  if (self.unsafeGetTensorImpl()->has_compatible_shallow_copy_type(from.key_set())) return true;
  return is_dense_tensor(self.key_set()) && is_dense_tensor(from.key_set());
}

// The op is CompositeImplicitAutograd; a call with a tpu argument dispatches to AutogradPrivateUse1, or to
// PrivateUse1 under torch.inference_mode (no autograd keys). Both get this kernel.
TORCH_LIBRARY_IMPL(aten, AutogradPrivateUse1, m) {
  m.impl("_has_compatible_shallow_copy_type", TORCH_FN(has_compatible_shallow_copy_type));
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("_has_compatible_shallow_copy_type", TORCH_FN(has_compatible_shallow_copy_type));
}

}  // namespace
}  // namespace torch_tpu
