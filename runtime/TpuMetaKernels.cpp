// Metadata kernels: creation, views and storage re-pointing. They touch no device data, so FakeTensor/meta
// propagation and torch.compile see an ordinary device.
#include "TpuRuntime.h"

#include <ATen/EmptyTensor.h>
#include <ATen/TensorUtils.h>
#include <ATen/core/Tensor.h>
#include <ATen/native/Resize.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/unfold_native.h>
#include <ATen/ops/view_as_complex_native.h>
#include <ATen/ops/view_as_real_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

namespace torch_tpu {
namespace {

c10::DeviceGuard guard_for(std::optional<c10::Device> device) {
  c10::Device d = device.value_or(c10::Device(kTpu, current_device()));
  TORCH_CHECK(d.type() == kTpu, "torch_tpu: expected a tpu device, got ", d);
  if (!d.has_index()) d = c10::Device(kTpu, current_device());
  check_device_index(d.index());
  return c10::DeviceGuard(d);
}

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<c10::ScalarType> dtype,
                               std::optional<c10::Layout> layout, std::optional<c10::Device> device,
                               std::optional<bool> /*pin_memory*/,
                               std::optional<c10::MemoryFormat> memory_format) {
  TORCH_CHECK(!layout.has_value() || *layout == c10::Layout::Strided,
              "torch_tpu: only strided tensors are supported on tpu, got layout ", *layout);
  auto g = guard_for(device);
  constexpr c10::DispatchKeySet ks(c10::DispatchKey::PrivateUse1);
  return at::detail::empty_generic(size, tpu_allocator(), ks,
                                   c10::dtype_or_default(dtype), memory_format);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride,
                         std::optional<c10::ScalarType> dtype, std::optional<c10::Layout> layout,
                         std::optional<c10::Device> device, std::optional<bool> /*pin_memory*/) {
  TORCH_CHECK(!layout.has_value() || *layout == c10::Layout::Strided,
              "torch_tpu: only strided tensors are supported on tpu, got layout ", *layout);
  auto g = guard_for(device);
  constexpr c10::DispatchKeySet ks(c10::DispatchKey::PrivateUse1);
  return at::detail::empty_strided_generic(size, stride, tpu_allocator(), ks,
                                           c10::dtype_or_default(dtype));
}

// Grows the storage when the tensor's geometry needs more bytes than it has (never shrinks).
void maybe_grow_storage(const at::Tensor& self) {
  auto* impl = self.unsafeGetTensorImpl();
  if (impl->numel() == 0) return;
  size_t need = at::detail::computeStorageNbytes(impl->sizes(), impl->strides(),
                                                 impl->dtype().itemsize(), impl->storage_offset());
  const c10::Storage& storage = impl->unsafe_storage();
  if (need > storage.nbytes()) resize_storage_bytes(storage, need);
}

const at::Tensor& resize_(const at::Tensor& self, c10::IntArrayRef size,
                          std::optional<c10::MemoryFormat> memory_format) {
  auto* impl = self.unsafeGetTensorImpl();
  at::native::resize_impl_cpu_(impl, size, std::nullopt, /*resize_storage=*/false);
  if (memory_format.has_value()) {
    TORCH_CHECK(*memory_format != c10::MemoryFormat::Preserve,
                "Unsupported memory format Preserve for resize_ on tpu");
    impl->empty_tensor_restride(*memory_format);
  }
  maybe_grow_storage(self);
  return self;
}

at::Tensor& set_source_storage_offset(at::Tensor& result, c10::Storage storage, int64_t offset,
                                      c10::IntArrayRef size, c10::IntArrayRef stride) {
  at::native::checkSetStorage(result, std::move(storage), offset, size, stride);
  result.unsafeGetTensorImpl()->set_storage_offset(offset);
  at::OptionalIntArrayRef stride_opt =
      stride.data() != nullptr ? at::OptionalIntArrayRef(stride) : std::nullopt;
  at::native::resize_impl_cpu_(result.unsafeGetTensorImpl(), size, stride_opt,
                               /*resize_storage=*/false);
  maybe_grow_storage(result);
  return result;
}

at::Tensor& set_source_storage(at::Tensor& result, c10::Storage source) {
  int64_t numel = static_cast<int64_t>(source.nbytes() / result.dtype().itemsize());
  return set_source_storage_offset(result, std::move(source), 0, {numel}, {});
}

at::Tensor& set_source_tensor(at::Tensor& result, const at::Tensor& source) {
  if (result.unsafeGetTensorImpl() == source.unsafeGetTensorImpl()) return result;
  return set_source_storage_offset(result, source.storage(), source.storage_offset(), source.sizes(),
                                   source.strides());
}

at::Tensor& set_empty(at::Tensor& result) {
  c10::Storage storage(c10::Storage::use_byte_size_t(), 0, tpu_allocator(), /*resizable=*/true);
  return set_source_storage_offset(result, std::move(storage), 0, {0}, {});
}

bool is_set_to(const at::Tensor& self, const at::Tensor& src) {
  return self.storage().unsafeGetStorageImpl() == src.storage().unsafeGetStorageImpl() &&
         self.storage_offset() == src.storage_offset() && self.sizes().equals(src.sizes()) &&
         self.strides().equals(src.strides());
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", TORCH_FN(empty_memory_format));
  m.impl("empty_strided", TORCH_FN(empty_strided));
  m.impl("view", TORCH_FN(at::native::view));
  m.impl("as_strided", TORCH_FN(at::native::as_strided_tensorimpl));
  m.impl("_reshape_alias", TORCH_FN(at::native::_reshape_alias));
  m.impl("unfold", TORCH_FN(at::native::unfold));
  m.impl("view_as_real", TORCH_FN(at::native::view_as_real));
  m.impl("view_as_complex", TORCH_FN(at::native::view_as_complex));
  m.impl("resize_", TORCH_FN(resize_));
  m.impl("set_.source_Storage", TORCH_FN(set_source_storage));
  m.impl("set_.source_Storage_storage_offset", TORCH_FN(set_source_storage_offset));
  m.impl("set_.source_Tensor", TORCH_FN(set_source_tensor));
  m.impl("set_", TORCH_FN(set_empty));
  m.impl("is_set_to", TORCH_FN(is_set_to));
}

}  // namespace
}  // namespace torch_tpu
