// scaled_dot_product_attention on tpu: ATen's composite asks `_fused_sdp_choice_stub` (a DispatchStub, not the
// `_fused_sdp_choice` op) which backend to run. PyTorch's hook for out-of-tree devices is the PrivateUse1 entry of
// that stub plus the `overrideable` backend (`_scaled_dot_product_fused_attention_overrideable` and its backward),
// as torch_openreg registers them. The choice itself is Python's (kernels/pallas/flash_attention.py, `choose`):
// this file only forwards the stub, and the `_fused_sdp_choice` op, to it.
#include <ATen/native/transformers/attention.h>
#include <ATen/SDPBackend.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include "TpuRuntime.h"

namespace torch_tpu {
namespace {

namespace py = pybind11;

PyObject* g_sdp_choice = nullptr;  // (query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa) -> int

int64_t fused_sdp_choice_tpu(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                             const std::optional<at::Tensor>& attn_mask, double dropout_p, bool is_causal,
                             std::optional<double> scale, bool enable_gqa) {
  py::gil_scoped_acquire gil;
  if (g_sdp_choice == nullptr) return static_cast<int64_t>(at::SDPBackend::math);  // kernels not imported yet
  py::object mask = attn_mask.has_value() && attn_mask->defined()
                        ? py::reinterpret_steal<py::object>(THPVariable_Wrap(*attn_mask))
                        : py::none();
  py::object sc = scale.has_value() ? py::cast(*scale) : py::none();
  PyObject* r = PyObject_CallFunction(
      g_sdp_choice, "NNNOdOOO", THPVariable_Wrap(query), THPVariable_Wrap(key), THPVariable_Wrap(value),
      mask.ptr(), dropout_p, is_causal ? Py_True : Py_False, sc.ptr(), enable_gqa ? Py_True : Py_False);
  if (r == nullptr) {
    // The Python error (e.g. "no viable backend") becomes the C++ error the dispatcher reports.
    PyObject *type, *val, *tb;
    PyErr_Fetch(&type, &val, &tb);
    std::string msg = "scaled_dot_product_attention: choosing the tpu backend failed";
    if (val != nullptr) {
      PyObject* s = PyObject_Str(val);
      if (s != nullptr) {
        msg = PyUnicode_AsUTF8(s);
        Py_DECREF(s);
      }
    }
    Py_XDECREF(type);
    Py_XDECREF(val);
    Py_XDECREF(tb);
    TORCH_CHECK(false, msg);
  }
  int64_t choice = PyLong_AsLongLong(r);
  Py_DECREF(r);
  return choice;
}

}  // namespace

void add_attention_methods(py::module_& m) {
  m.def("_set_sdp_choice", [](py::object fn) {
    Py_XDECREF(g_sdp_choice);
    g_sdp_choice = fn.release().ptr();
  });
}

}  // namespace torch_tpu

namespace at::native {
REGISTER_PRIVATEUSE1_DISPATCH(_fused_sdp_choice_stub, &torch_tpu::fused_sdp_choice_tpu)
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("_fused_sdp_choice", &torch_tpu::fused_sdp_choice_tpu);
}
