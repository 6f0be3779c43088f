// torch.accelerator.Graph on tpu: PyTorch's device-generic graph API finds a backend's implementation in
// at::GraphImplRegistry under the device type's name ("TPU" for PrivateUse1 renamed to tpu). This one forwards each
// call to a torch_tpu._graphs.TPUGraph (the capture and replay live there, on the fused executor).
#include <ATen/core/GraphImplInterface.h>
#include <torch/csrc/utils/pybind.h>

#include <string>

namespace torch_tpu {
namespace {

namespace py = pybind11;

const char* mode_name(at::GraphCaptureMode mode) {
  switch (mode) {
    case at::GraphCaptureMode::Global:
      return "global";
    case at::GraphCaptureMode::ThreadLocal:
      return "thread_local";
    case at::GraphCaptureMode::Relaxed:
      return "relaxed";
    default:
      return "default";
  }
}

struct TpuGraphImpl final : at::GraphImplInterface {
  explicit TpuGraphImpl(const at::GraphImplArgs& args) {
    py::gil_scoped_acquire gil;
    graph_ = new py::object(py::module_::import("torch_tpu._graphs").attr("TPUGraph")(args.keep_graph));
  }

  ~TpuGraphImpl() override {
    if (!Py_IsInitialized()) return;  // at interpreter exit: leak the Python object rather than touch a dead VM
    py::gil_scoped_acquire gil;
    delete graph_;
  }

  void capture_begin(at::MempoolId_t pool, at::GraphCaptureMode capture_mode) override {
    py::gil_scoped_acquire gil;
    graph_->attr("capture_begin")(py::make_tuple(pool.first, pool.second), mode_name(capture_mode));
  }
  void capture_end() override { call("capture_end"); }
  void instantiate() override { call("instantiate"); }
  void replay() override { call("replay"); }
  void reset() override { call("reset"); }
  at::MempoolId_t pool() const override {
    py::gil_scoped_acquire gil;
    auto t = graph_->attr("pool")().cast<std::pair<int64_t, int64_t>>();
    return {static_cast<c10::CaptureId_t>(t.first), static_cast<c10::CaptureId_t>(t.second)};
  }
  void enable_debug_mode() override { call("enable_debug_mode"); }
  void debug_dump(const std::string& path) override {
    py::gil_scoped_acquire gil;
    graph_->attr("debug_dump")(path);
  }

 private:
  void call(const char* name) {
    py::gil_scoped_acquire gil;
    graph_->attr(name)();
  }
  py::object* graph_;  // owned; a pointer so the destructor can skip it after interpreter exit
};

}  // namespace
}  // namespace torch_tpu

// The registry's key is c10::DeviceTypeName(PrivateUse1, /*lower_case=*/false): the backend's name upper-cased.
// (Registered in namespace at, where the registry's registerer type is declared.)
namespace at {
REGISTER_GRAPH_IMPL(TPU, torch_tpu::TpuGraphImpl);
}  // namespace at
