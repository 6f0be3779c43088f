// Execution-mode state (the policy lives in torch_tpu/_deferred.py): each thread's own mode, the process
// default that threads without one run in, and the depth of kernels that need concrete arrays ("suspended").
//
// A thread that records tpu work publishes itself in c10::ThreadLocalDebugInfo, which PyTorch carries into the
// threads that run work on its behalf (the autograd engine's device threads, at::launch). So a backward pass
// runs in the mode of the thread that called it and records into that thread's pending graph, as grad mode and
// autocast state follow the caller into the autograd engine.
#include "TpuRuntime.h"

#include <c10/util/ThreadLocalDebugInfo.h>

#include <atomic>
#include <memory>
#include <string_view>

namespace torch_tpu {
namespace {

constexpr int kFuse = 2;  // EagerMode.DEFER_AND_FUSE
constexpr std::string_view kCallerName = "torch_tpu.eager_mode";
const c10::DebugInfoKind kCaller(&kCallerName);

struct Caller final : c10::DebugInfoBase {
  explicit Caller(int64_t id) : id(id) {}
  const int64_t id;            // the thread whose pending graphs the work records into
  std::atomic<int> mode{-1};   // its own mode; -1: the process default
};

std::atomic<int> g_default{0};
std::atomic<int64_t> g_next_id{1};
thread_local int t_mode = -1;  // -1: no mode of its own
thread_local int t_suspended = 0;
thread_local std::shared_ptr<Caller> t_self;

Caller& self() {
  if (!t_self) t_self = std::make_shared<Caller>(g_next_id.fetch_add(1));
  return *t_self;
}

// The caller this thread runs work for (inside a backward pass another thread started), or nullptr.
const Caller* inherited() {
  if (t_mode >= 0) return nullptr;  // a mode of its own: its own graphs
  auto* c = static_cast<const Caller*>(c10::ThreadLocalDebugInfo::get(kCaller));
  return c != t_self.get() ? c : nullptr;
}

// Makes this thread visible to the work PyTorch runs for it (pushed again if a DebugInfoGuard dropped it).
void publish() {
  Caller& me = self();
  if (c10::ThreadLocalDebugInfo::get(kCaller) != &me) c10::ThreadLocalDebugInfo::_push(kCaller, t_self);
}

int effective_mode() {
  if (t_mode >= 0) return t_mode;
  if (const Caller* c = inherited()) {
    int m = c->mode.load(std::memory_order_relaxed);
    if (m >= 0) return m;
  }
  return g_default.load(std::memory_order_relaxed);
}

PyObject* py_mode(PyObject*, PyObject*) { return PyLong_FromLong(effective_mode()); }

PyObject* py_recording(PyObject*, PyObject*) {
  if (t_suspended == 0 && effective_mode() == kFuse) Py_RETURN_TRUE;
  Py_RETURN_FALSE;
}

PyObject* py_thread_mode(PyObject*, PyObject*) { return PyLong_FromLong(t_mode); }

bool mode_arg(PyObject* arg, int* out) {
  long m = PyLong_AsLong(arg);
  if (m == -1 && PyErr_Occurred()) return false;
  if (m < -1 || m > kFuse) {
    PyErr_Format(PyExc_ValueError, "torch_tpu: internal error: mode %ld", m);
    return false;
  }
  *out = static_cast<int>(m);
  return true;
}

PyObject* py_set_thread_mode(PyObject*, PyObject* arg) {
  int m;
  if (!mode_arg(arg, &m)) return nullptr;
  t_mode = m;
  self().mode.store(m, std::memory_order_relaxed);
  if (m >= 0) publish();
  Py_RETURN_NONE;
}

PyObject* py_default_mode(PyObject*, PyObject*) { return PyLong_FromLong(g_default.load()); }

PyObject* py_set_default_mode(PyObject*, PyObject* arg) {
  int m;
  if (!mode_arg(arg, &m)) return nullptr;
  if (m < 0) {
    PyErr_SetString(PyExc_ValueError, "torch_tpu: internal error: the default mode must be a mode");
    return nullptr;
  }
  g_default.store(m);
  Py_RETURN_NONE;
}

PyObject* py_suspend(PyObject*, PyObject* arg) {
  long d = PyLong_AsLong(arg);
  if (d == -1 && PyErr_Occurred()) return nullptr;
  t_suspended += static_cast<int>(d);
  Py_RETURN_NONE;
}

// The id of the thread whose pending graphs this thread's recorded work goes to: the caller's inside a backward
// pass it started, else this thread's own (published so the work it starts follows it).
PyObject* py_graph_owner(PyObject*, PyObject*) {
  if (const Caller* c = inherited()) return PyLong_FromLongLong(c->id);
  publish();
  return PyLong_FromLongLong(t_self->id);
}

PyObject* py_thread_id(PyObject*, PyObject*) { return PyLong_FromLongLong(self().id); }

PyMethodDef kModeMethods[] = {
    {"_mode", py_mode, METH_NOARGS, "the calling thread's effective execution mode (an EagerMode value)"},
    {"_recording", py_recording, METH_NOARGS, "True when tpu ops on this thread are recorded (DEFER_AND_FUSE)"},
    {"_thread_mode", py_thread_mode, METH_NOARGS, "the calling thread's own mode, -1 when it has none"},
    {"_set_thread_mode", py_set_thread_mode, METH_O, "set the calling thread's own mode (-1: the default)"},
    {"_default_mode", py_default_mode, METH_NOARGS, "the process default mode"},
    {"_set_default_mode", py_set_default_mode, METH_O, "set the process default mode"},
    {"_suspend", py_suspend, METH_O, "add to the calling thread's suspended depth"},
    {"_graph_owner", py_graph_owner, METH_NOARGS, "id of the thread whose pending graphs this thread records into"},
    {"_thread_id", py_thread_id, METH_NOARGS, "the calling thread's id (as _graph_owner counts)"},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

bool recording() { return t_suspended == 0 && effective_mode() == kFuse; }

PyMethodDef* mode_methods() { return kModeMethods; }

int current_mode() { return effective_mode(); }

}  // namespace torch_tpu
