// aten::_to_copy on tpu: every x.to(dtype), .float(), .half(), autocast's casts and ToCopyBackward's, and every
// x.cpu() / x.to("cpu"); and aten::_local_scalar_dense, every .item() (at the end).
//
// ATen's own kernel is a composite (CompositeExplicitAutograd): it allocates the result with empty_like and then
// dispatches copy_, whose tpu kernel is Python (kernels/copy.py): an allocation, a second dispatch into Python and,
// for the host, a second copy on the CPU. Two forms, of a contiguous strided tensor into a contiguous result, are
// instead one call of a Python function in kernels/copy.py:
// - a cast that stays on its tpu device (`_cast`: the storage read, one jitted conversion, the new tensor;
//   DEFER_AND_FUSE records it like any other op). Under DEFER_NEVER, a tensor viewing its whole computed array is
//   cast here without entering Python code but for the jitted call (`_cast_program`'s, one per target dtype), as
//   the op table's cache hits are (TpuDispatch.cpp): x.to(torch.bfloat16) of a 2x2 took 32 us through `_cast`
//   against 10 us for the jitted conversion alone;
// - a copy to the host with the same dtype (`_to_host`: the download is the result; for the whole of a computed
//   array, the common case, `to_host_direct` below does it without entering Python but for the read itself).
// Every other form (a cast to or from the host, no dtype change on tpu, another layout or memory format, pinned
// memory, a non-contiguous source) runs ATen's composite itself (at::native::_to_copy), so its semantics stay
// PyTorch's.
#include <ATen/core/Tensor.h>
#include <ATen/ops/_to_copy_native.h>
#include <ATen/ops/_local_scalar_dense.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include <cstring>

#include "TpuRuntime.h"

namespace torch_tpu {
namespace {

namespace py = pybind11;

PyObject* g_cast = nullptr;       // (tensor, dtype) -> tensor: kernels/copy.py's `_cast` (owned)
PyObject* g_to_host = nullptr;    // (tensor) -> CPU tensor: kernels/copy.py's `_to_host` (owned)
PyObject* g_host_read = nullptr;  // (device array) -> numpy array: torch_tpu/_runtime.py's `host_array` (owned)
PyObject* g_item = nullptr;       // (tensor) -> CPU tensor: kernels/copy.py's `_item_host` (owned)
// (torch.dtype) -> the jitted cast of an array to that dtype, or None: kernels/copy.py's `_cast_program` (owned),
// asked once per dtype; its answers are kept by ScalarType (Py_None: that dtype always takes `_cast`).
PyObject* g_cast_program = nullptr;
PyObject* g_cast_fns[static_cast<int>(c10::ScalarType::NumOptions)] = {};

// The jitted cast to `dtype` (borrowed), or nullptr: `_cast` computes it (with a Python error set: raise it).
PyObject* cast_program(c10::ScalarType dtype) {
  PyObject*& fn = g_cast_fns[static_cast<int>(dtype)];
  if (fn == nullptr) {
    if (g_cast_program == nullptr) return nullptr;
    fn = PyObject_CallOneArg(g_cast_program, reinterpret_cast<PyObject*>(torch::getTHPDtype(dtype)));
    if (fn == nullptr) return nullptr;
  }
  return fn == Py_None ? nullptr : fn;
}

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

// The tensor a Python half returns for `self`: `fn(self)`, or `fn(self, extra)` (the GIL held), or the Python error
// it raised.
at::Tensor call_python(PyObject* fn, const at::Tensor& self, PyObject* extra = nullptr) {
  auto t = py::reinterpret_steal<py::object>(THPVariable_Wrap(self));
  if (!t) throw python_error();
  auto out = py::reinterpret_steal<py::object>(
      extra == nullptr ? PyObject_CallOneArg(fn, t.ptr()) : PyObject_CallFunctionObjArgs(fn, t.ptr(), extra, nullptr));
  if (!out) throw python_error();
  TORCH_CHECK(THPVariable_Check(out.ptr()), "torch_tpu: internal error: a tpu copy returned ",
              Py_TYPE(out.ptr())->tp_name, ", not a tensor");
  return THPVariable_Unpack(out.ptr());
}

// `_to_host(self)` without its Python frames, when `self` is the whole of its storage's computed array (the common
// case: the result of an op, read right after it): the host read itself (`host_array`: the wait, the synchronization
// hooks, the error of a failed program), then one copy of its bytes into a new CPU tensor. An undefined tensor when
// that form does not apply (a placeholder still to compute, a view, a lazy bit): `_to_host` takes it.
at::Tensor to_host_direct(const at::Tensor& self, PyObject* reason) {
  c10::TensorImpl* impl = self.unsafeGetTensorImpl();
  if (g_host_read == nullptr || reason == nullptr || impl->storage_offset() != 0 || !is_buffer(impl->storage()))
    return at::Tensor();
  TpuBuffer* buf = buffer_of(impl->unsafe_storage());
  dispatch_resolve_pending(buf);  // (computes a placeholder unless this thread records: then it stays one)
  if (!views_whole_array(impl, buf) || !dispatch_is_array(buf->array)) return at::Tensor();
  auto arr = py::reinterpret_borrow<py::object>(buf->array);  // (the storage may change its array meanwhile)
  segment_end(arr.ptr(), reason);
  auto host = py::reinterpret_steal<py::object>(PyObject_CallOneArg(g_host_read, arr.ptr()));
  if (!host) throw python_error();
  Py_buffer view;  // (PyBUF_SIMPLE: numpy exports bfloat16 and float8 arrays too, C-contiguous ones only)
  if (PyObject_GetBuffer(host.ptr(), &view, PyBUF_SIMPLE) != 0) {
    PyErr_Clear();
    return at::Tensor();
  }
  at::Tensor out;
  if (static_cast<size_t>(view.len) == self.nbytes()) {
    out = at::empty(self.sizes(), self.options().device(at::kCPU));
    if (view.len > 0) std::memcpy(out.data_ptr(), view.buf, view.len);
  }
  PyBuffer_Release(&view);
  return out;
}

at::Tensor to_copy_tpu(const at::Tensor& self, std::optional<at::ScalarType> dtype, std::optional<at::Layout> layout,
                       std::optional<at::Device> device, std::optional<bool> pin_memory, bool non_blocking,
                       std::optional<at::MemoryFormat> memory_format) {
  if (keeps_layout(self, layout, pin_memory, memory_format)) {
    if (g_cast != nullptr && same_device_cast(self, dtype, device)) {
      py::gil_scoped_acquire gil;
      if (current_mode() == 0 && !g_in_bad_fork) {  // DEFER_NEVER: the whole computed array cast without Python
        PyObject* fn = cast_program(*dtype);
        if (fn == nullptr && PyErr_Occurred()) throw python_error();
        if (fn != nullptr) {
          at::Tensor out = dispatch_call_unary(fn, self, *dtype, "aten::_to_copy");
          if (out.defined()) return out;
        }
      }
      return call_python(g_cast, self, reinterpret_cast<PyObject*>(torch::getTHPDtype(*dtype)));
    }
    if (g_to_host != nullptr && device.has_value() && device->is_cpu() &&
        (!dtype.has_value() || *dtype == self.scalar_type())) {
      check_not_forked();
      py::gil_scoped_acquire gil;
      static PyObject* reason = PyUnicode_InternFromString("to_cpu");  // (the reason _to_host gives: one object)
      at::Tensor out = to_host_direct(self, reason);
      return out.defined() ? out : call_python(g_to_host, self);
    }
  }
  return at::native::_to_copy(self, dtype, layout, device, pin_memory, non_blocking, memory_format);
}

// aten::_local_scalar_dense (every .item(), and the reads of Python control flow on tpu values): the element read
// as to_host_direct reads (or, for a placeholder, a view, a lazy bit: `_item_host`, the same read in Python), then
// CPU PyTorch's own kernel on that one-element CPU tensor, so the Python number is CPU's in every dtype. Under
// DEFER_AND_FUSE only the graph computing the value runs (a read, not a boundary: no other pending work is flushed).
c10::Scalar local_scalar_dense_tpu(const at::Tensor& self) {
  TORCH_CHECK(self.numel() == 1, "a Tensor with ", self.numel(), " elements cannot be converted to Scalar");
  check_not_forked();
  at::Tensor host;
  {
    py::gil_scoped_acquire gil;
    static PyObject* reason = PyUnicode_InternFromString("item");  // (the reason _item_host gives: one object)
    host = to_host_direct(self, reason);
    if (!host.defined()) {
      TORCH_CHECK(g_item != nullptr, "torch_tpu: internal error: .item() of a tpu tensor before kernels/copy.py set "
                  "its Python half (_C._set_item)");
      host = call_python(g_item, self);
    }
  }
  return at::_local_scalar_dense(host);
}

}  // namespace

void add_cast_methods(py::module_& m) {
  // (None: that form runs ATen's composite too; host_read None: every copy to the host calls `to_host`)
  m.def(
      "_set_casts",
      [](py::object cast, py::object to_host, py::object host_read, py::object cast_program) {
        Py_XDECREF(g_cast);
        Py_XDECREF(g_to_host);
        Py_XDECREF(g_host_read);
        Py_XDECREF(g_cast_program);
        for (PyObject*& fn : g_cast_fns) Py_CLEAR(fn);
        g_cast = cast.is_none() ? nullptr : cast.release().ptr();
        g_to_host = to_host.is_none() ? nullptr : to_host.release().ptr();
        g_host_read = host_read.is_none() ? nullptr : host_read.release().ptr();
        g_cast_program = cast_program.is_none() ? nullptr : cast_program.release().ptr();
      },
      py::arg("cast"), py::arg("to_host"), py::arg("host_read") = py::none(), py::arg("cast_program") = py::none());
  m.def("_set_item", [](py::object item) {
    Py_XDECREF(g_item);
    g_item = item.release().ptr();
  });
}

}  // namespace torch_tpu

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("_to_copy", TORCH_FN(torch_tpu::to_copy_tpu));
  m.impl("_local_scalar_dense", TORCH_FN(torch_tpu::local_scalar_dense_tpu));
}
