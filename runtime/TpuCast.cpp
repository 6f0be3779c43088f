// aten::_to_copy on tpu: every x.to(dtype), .float(), .half(), autocast's casts and ToCopyBackward's, and every
// x.cpu() / x.to("cpu").
//
// ATen's own kernel is a composite (CompositeExplicitAutograd): it allocates the result with empty_like and then
// dispatches copy_, whose tpu kernel is Python (kernels/copy.py): an allocation, a second dispatch into Python and,
// for the host, a second copy on the CPU. Two forms, of a contiguous strided tensor into a contiguous result, are
// instead one call of a Python function in kernels/copy.py:
// - a cast that stays on its tpu device (`_cast`: the storage read, one jitted conversion, the new tensor;
//   DEFER_AND_FUSE records it like any other op);
// - a copy to the host with the same dtype (`_to_host`: the download is the result).
// Every other form (a cast to or from the host, no dtype change on tpu, another layout or memory format, pinned
// memory, a non-contiguous source) runs ATen's composite itself (at::native::_to_copy), so its semantics stay
// PyTorch's.
#include <ATen/core/Tensor.h>
#include <ATen/ops/_to_copy_native.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include "TpuRuntime.h"

namespace torch_tpu {
namespace {

namespace py = pybind11;

PyObject* g_cast = nullptr;     // (tensor, dtype) -> tensor: kernels/copy.py's `_cast` (owned)
PyObject* g_to_host = nullptr;  // (tensor) -> CPU tensor: kernels/copy.py's `_to_host` (owned)

bool keeps_layout(const at::Tensor& self, std::optional<at::Layout> layout, std::optional<bool> pin_memory,
                  std::optional<at::MemoryFormat> memory_format) {
  if (layout.has_value() && *layout != at::kStrided) return false;
  if (self.layout() != at::kStrided) return false;
  if (pin_memory.has_value() && *pin_memory) return false;
  if (memory_format.has_value() && *memory_format != at::MemoryFormat::Preserve &&
      *memory_format != at::MemoryFormat::Contiguous)
    return false;
  return self.is_contiguous();  // (then Preserve gives a contiguous result too)
}

bool same_device_cast(const at::Tensor& self, std::optional<at::ScalarType> dtype, std::optional<at::Device> device) {
  if (!dtype.has_value() || *dtype == self.scalar_type()) return false;
  return !device.has_value() || (device->type() == self.device().type() &&
                                 (!device->has_index() || device->index() == self.device().index()));
}

// The tensor `fn(args...)` returned (a new reference), or the Python error thrown.
at::Tensor tensor_from(PyObject* r) {
  if (r == nullptr) throw python_error();
  auto out = py::reinterpret_steal<py::object>(r);
  TORCH_CHECK(THPVariable_Check(out.ptr()), "torch_tpu: internal error: a tpu copy returned ",
              Py_TYPE(out.ptr())->tp_name, ", not a tensor");
  return THPVariable_Unpack(out.ptr());
}

at::Tensor to_copy_tpu(const at::Tensor& self, std::optional<at::ScalarType> dtype, std::optional<at::Layout> layout,
                       std::optional<at::Device> device, std::optional<bool> pin_memory, bool non_blocking,
                       std::optional<at::MemoryFormat> memory_format) {
  if (keeps_layout(self, layout, pin_memory, memory_format)) {
    if (g_cast != nullptr && same_device_cast(self, dtype, device)) {
      py::gil_scoped_acquire gil;
      auto t = py::reinterpret_steal<py::object>(THPVariable_Wrap(self));
      if (!t) throw python_error();
      return tensor_from(PyObject_CallFunctionObjArgs(
          g_cast, t.ptr(), reinterpret_cast<PyObject*>(torch::getTHPDtype(*dtype)), nullptr));
    }
    if (g_to_host != nullptr && device.has_value() && device->is_cpu() &&
        (!dtype.has_value() || *dtype == self.scalar_type())) {
      py::gil_scoped_acquire gil;
      auto t = py::reinterpret_steal<py::object>(THPVariable_Wrap(self));
      if (!t) throw python_error();
      return tensor_from(PyObject_CallFunctionObjArgs(g_to_host, t.ptr(), nullptr));
    }
  }
  return at::native::_to_copy(self, dtype, layout, device, pin_memory, non_blocking, memory_format);
}

}  // namespace

void add_cast_methods(py::module_& m) {
  // (None: that form runs ATen's composite too)
  m.def("_set_casts", [](py::object cast, py::object to_host) {
    Py_XDECREF(g_cast);
    Py_XDECREF(g_to_host);
    g_cast = cast.is_none() ? nullptr : cast.release().ptr();
    g_to_host = to_host.is_none() ? nullptr : to_host.release().ptr();
  });
}

}  // namespace torch_tpu

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("_to_copy", TORCH_FN(torch_tpu::to_copy_tpu));
}
