// The missing-operator policy. Strict by default: an ATen op with no tpu kernel raises
// NotImplementedError naming its overload and the way out. Opt-in (TORCH_TPU_CPU_FALLBACK=warn or
// torch.tpu.set_cpu_fallback(True)): run it on CPU through ATen's own boxed cpu_fallback, warn once per
// op and count every use. Never silent.
#include "TpuRuntime.h"

#include <ATen/native/CPUFallback.h>
#include <torch/library.h>

#include <atomic>
#include <map>
#include <mutex>

namespace torch_tpu {
namespace {

std::atomic<int> g_mode{static_cast<int>(FallbackMode::kStrict)};
std::mutex g_mu;
std::map<std::string, int64_t> g_counts;

std::string overload_name(const c10::OperatorHandle& op) {
  const auto& name = op.schema().operator_name();
  return name.overload_name.empty() ? name.name : name.name + "." + name.overload_name;
}

void tpu_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  std::string name = overload_name(op);
  if (fallback_mode() == FallbackMode::kStrict) {
    TORCH_CHECK_NOT_IMPLEMENTED(
        false, "torch_tpu: the operator '", name,
        "' has no tpu kernel yet. Ways out: run it on CPU for now with the opt-in fallback "
        "(TORCH_TPU_CPU_FALLBACK=warn, or torch.tpu.set_cpu_fallback(True)) — it warns once per op "
        "and torch.tpu.fallback_report() counts every use — or add a kernel in torch_tpu/kernels "
        "(see docs/adding_kernels.md) and open an issue.");
  }
  bool first = false;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    first = (g_counts[name]++ == 0);
  }
  if (first) {
    TORCH_WARN("torch_tpu: '", name, "' has no tpu kernel and runs on CPU (TORCH_TPU_CPU_FALLBACK): "
               "its inputs are copied to the host and back. torch.tpu.fallback_report() lists "
               "every op that fell back.");
  }
  at::native::cpu_fallback(op, stack);
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&tpu_fallback>());
}

}  // namespace

void set_fallback_mode(FallbackMode mode) { g_mode.store(static_cast<int>(mode)); }
FallbackMode fallback_mode() { return static_cast<FallbackMode>(g_mode.load()); }

std::vector<std::pair<std::string, int64_t>> fallback_counts() {
  std::lock_guard<std::mutex> lock(g_mu);
  return {g_counts.begin(), g_counts.end()};
}

void reset_fallback_counts() {
  std::lock_guard<std::mutex> lock(g_mu);
  g_counts.clear();
}

}  // namespace torch_tpu
