// Execution-mode state (the policy lives in torch_tpu/_deferred.py): each thread's own mode, the process
// default that threads without one run in, and the depth of kernels that need concrete arrays ("suspended").
//
// A thread that records tpu work publishes itself in c10::ThreadLocalDebugInfo, which PyTorch carries into the
// threads that run work on its behalf (the autograd engine's device threads, at::launch). So a backward pass
// runs in the mode of the thread that called it and records into that thread's pending graph, as grad mode and
// autocast state follow the caller into the autograd engine.
#include "TpuRuntime.h"

#include <c10/util/ThreadLocalDebugInfo.h>
#include <torch/csrc/autograd/graph_task.h>

#include <atomic>
#include <memory>
#include <string_view>
#include <utility>
#include <vector>

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

// Makes this thread visible to the work PyTorch runs for it (pushed again if a DebugInfoGuard dropped it). Only
// onto an empty stack: an entry pushed on top of another's would stay above it, and PyTorch pops its own entries
// expecting them on top (torch.profiler's exit synchronizes the tpu, then pops PROFILER_STATE: "Expected debug
// info of type PROFILER_STATE" if the synchronize published this thread). torch_tpu publishes the importing thread
// at import; a thread first published under such an entry is published at its next call outside it, and until
// then its backward passes run in the process default mode instead of its own.
void publish() {
  Caller& me = self();
  if (c10::ThreadLocalDebugInfo::get(kCaller) != &me && c10::ThreadLocalDebugInfo::current() == nullptr) {
    c10::ThreadLocalDebugInfo::_push(kCaller, t_self);
  }
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

// ---- DEFER_AND_FUSE: one-op segments dispatched through the eager cache hit ----
// Sync-heavy code under DEFER_AND_FUSE (an op, then a read of its result, again and again) flushes graphs of one
// op; such a graph runs the op's own program (the eager op's values), after paying for recording the op and for
// a flush. When a thread's own graphs have flushed with one op `need` times in a row (torch_tpu/_deferred.py
// reports every flush: `_fuse_flushed`), the thread goes direct: the first op of each segment (the ops between
// two synchronization points) runs through the eager cache hit (runtime/TpuDispatch.cpp asks
// `direct_dispatch()`), which is the program its one-op flush would have run. A second op in the same segment, or
// an op the cache hit does not take (it is recorded: `_fuse_recorded`), ends the direct state; the ops from there
// on are recorded. Each end doubles `need` (up to 64 times the base), so code that alternates does not flap.
// The state is the recording thread's own (threads inheriting a caller's graphs record as before).
thread_local bool t_direct = false;
thread_local int t_streak = 0;        // this thread's one-op flushes in a row
thread_local int t_backoff = 0;       // need = base << t_backoff
thread_local int t_seg = 0;           // ops run directly in the current segment (0 or 1)
thread_local const void* t_last = nullptr;  // the last direct op's result (compared by identity only)

void leave_direct() {
  if (!t_direct) return;
  t_direct = false;
  t_streak = 0;
  t_seg = 0;
  t_last = nullptr;
  if (t_backoff < 6) ++t_backoff;
}

// _fuse_flushed(n_ops, base): a graph of this thread's with n_ops ops flushed; base: one-op flushes in a row
// before going direct (0: never, and the thread's state is reset).
PyObject* py_fuse_flushed(PyObject*, PyObject* args) {
  long n, base;
  if (!PyArg_ParseTuple(args, "ll", &n, &base)) return nullptr;
  if (base <= 0) {  // the policy off: this thread's state starts afresh
    t_direct = false;
    t_streak = t_seg = t_backoff = 0;
    t_last = nullptr;
  } else if (n == 1) {
    if (++t_streak >= (base << t_backoff) && !t_direct) {
      t_direct = true;
      t_seg = 0;
      t_last = nullptr;
    }
  } else {
    t_streak = 0;
  }
  Py_RETURN_NONE;
}

// _fuse_recorded(): this thread recorded the first op of a graph (an op the direct path did not take).
PyObject* py_fuse_recorded(PyObject*, PyObject*) {
  leave_direct();
  Py_RETURN_NONE;
}

// Segments whose op ran directly, by the reason of the synchronization point that ended them (the reason strings
// are held): torch.tpu.metrics() counts each as the one-op flush it stands for (torch_tpu/_metrics.py). Read and
// written with the GIL held; counted here because a Python counter under a lock costs as much as the op.
std::vector<std::pair<PyObject*, int64_t>> g_direct_ends;

// _fuse_segment_end(value or None, reason): a synchronization point of this thread (None: all of its work; else
// a read of `value`); it ends the segment of an op that ran directly if there is one.
PyObject* py_fuse_segment_end(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2) {
    PyErr_SetString(PyExc_TypeError, "torch_tpu: internal error: _fuse_segment_end(value, reason)");
    return nullptr;
  }
  segment_end(args[0], args[1]);
  Py_RETURN_NONE;
}

// _fuse_direct_ends(reset) -> {reason: segments}: the counts above (then cleared, with `reset`).
PyObject* py_fuse_direct_ends(PyObject*, PyObject* reset) {
  PyObject* d = PyDict_New();
  if (d == nullptr) return nullptr;
  for (auto& [reason, n] : g_direct_ends) {
    PyObject* v = PyLong_FromLongLong(n);
    if (v == nullptr || PyDict_SetItem(d, reason, v) < 0) {
      Py_XDECREF(v);
      Py_DECREF(d);
      return nullptr;
    }
    Py_DECREF(v);
  }
  if (PyObject_IsTrue(reset)) {
    for (auto& e : g_direct_ends) Py_DECREF(e.first);
    g_direct_ends.clear();
  }
  return d;
}

PyObject* py_fuse_direct(PyObject*, PyObject*) { return PyBool_FromLong(t_direct); }

// ---- recording a list argument (torch_tpu/_deferred.py `_arg_list`, the per-element loop of a foreach op) ----
// The recorder's types and its Python fallbacks, set once by _deferred (_fuse_arg_types): the placeholder type, the
// set of device array types _arg has seen (the same set object, so its later additions count here), and the
// functions _arg(g, v) and _input(g, v) for everything this loop does not take inline.
struct ArgTypes {
  PyObject* pending = nullptr;
  PyObject* arrays = nullptr;
  PyObject* arg = nullptr;
  PyObject* input = nullptr;
  PyObject *s_value, *s_graph, *s_node, *s_out, *s_meta, *s_inputs, *s_input_pos, *k_n, *k_i, *k_l;
};
ArgTypes g_arg;

PyObject* py_fuse_arg_types(PyObject*, PyObject* args) {
  PyObject *pending, *arrays, *arg, *input;
  if (!PyArg_ParseTuple(args, "OO!OO", &pending, &PySet_Type, &arrays, &arg, &input)) return nullptr;
  for (PyObject* o : {pending, arrays, arg, input}) Py_INCREF(o);
  g_arg.pending = pending;
  g_arg.arrays = arrays;
  g_arg.arg = arg;
  g_arg.input = input;
  g_arg.s_value = PyUnicode_InternFromString("value");
  g_arg.s_graph = PyUnicode_InternFromString("graph");
  g_arg.s_node = PyUnicode_InternFromString("node");
  g_arg.s_out = PyUnicode_InternFromString("out");
  g_arg.s_meta = PyUnicode_InternFromString("meta");
  g_arg.s_inputs = PyUnicode_InternFromString("inputs");
  g_arg.s_input_pos = PyUnicode_InternFromString("input_pos");
  g_arg.k_n = PyUnicode_InternFromString("n");
  g_arg.k_i = PyUnicode_InternFromString("i");
  g_arg.k_l = PyUnicode_InternFromString("l");
  Py_RETURN_NONE;
}

// One element: new references to its spec and signature in *spec and *sig; false with a Python error set.
bool arg_element(PyObject* g, PyObject* inputs, PyObject* input_pos, PyObject* v, PyObject** spec, PyObject** sig);

// (("l", specs), sigs) of a list or tuple, as _deferred._arg_list (with `top`: (specs, sigs), a recorded call's
// own arguments); nullptr with a Python error set.
PyObject* arg_list(PyObject* g, PyObject* inputs, PyObject* input_pos, PyObject* seq, bool top = false) {
  PyObject* fast = PySequence_Fast(seq, "_fuse_arg_list: expected a list or tuple");
  if (fast == nullptr) return nullptr;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
  PyObject* specs = PyTuple_New(n);
  PyObject* sigs = PyTuple_New(n);
  if (specs == nullptr || sigs == nullptr) {
    Py_XDECREF(specs);
    Py_XDECREF(sigs);
    Py_DECREF(fast);
    return nullptr;
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject *sp, *sg;
    if (!arg_element(g, inputs, input_pos, PySequence_Fast_GET_ITEM(fast, i), &sp, &sg)) {
      Py_DECREF(specs);
      Py_DECREF(sigs);
      Py_DECREF(fast);
      return nullptr;
    }
    PyTuple_SET_ITEM(specs, i, sp);
    PyTuple_SET_ITEM(sigs, i, sg);
  }
  Py_DECREF(fast);
  if (top) {
    PyObject* out = PyTuple_Pack(2, specs, sigs);
    Py_DECREF(specs);
    Py_DECREF(sigs);
    return out;
  }
  PyObject* spec = PyTuple_Pack(2, g_arg.k_l, specs);
  Py_DECREF(specs);
  if (spec == nullptr) {
    Py_DECREF(sigs);
    return nullptr;
  }
  PyObject* out = PyTuple_Pack(2, spec, sigs);
  Py_DECREF(spec);
  Py_DECREF(sigs);
  return out;
}

// Splits a (spec, sig) pair returned by Python into two new references (false with an error set).
bool split_pair(PyObject* pair, PyObject** spec, PyObject** sig) {
  if (pair == nullptr) return false;
  if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
    Py_DECREF(pair);
    PyErr_SetString(PyExc_TypeError, "torch_tpu: internal error: a recorded argument's (spec, signature)");
    return false;
  }
  *spec = PyTuple_GET_ITEM(pair, 0);
  *sig = PyTuple_GET_ITEM(pair, 1);
  Py_INCREF(*spec);
  Py_INCREF(*sig);
  Py_DECREF(pair);
  return true;
}

bool arg_element(PyObject* g, PyObject* inputs, PyObject* input_pos, PyObject* v, PyObject** spec, PyObject** sig) {
  PyTypeObject* t = Py_TYPE(v);
  if (reinterpret_cast<PyObject*>(t) == g_arg.pending) {  // an earlier result of this graph: ("n", node, out), meta
    PyObject* value = PyObject_GetAttr(v, g_arg.s_value);
    if (value == nullptr) return false;
    bool pending = value == Py_None;
    Py_DECREF(value);
    if (pending) {
      PyObject* graph = PyObject_GetAttr(v, g_arg.s_graph);
      if (graph == nullptr) return false;
      bool mine = graph == g;
      Py_DECREF(graph);
      if (mine) {
        PyObject* node = PyObject_GetAttr(v, g_arg.s_node);
        PyObject* out = node ? PyObject_GetAttr(v, g_arg.s_out) : nullptr;
        PyObject* meta = out ? PyObject_GetAttr(v, g_arg.s_meta) : nullptr;
        PyObject* sp = meta ? PyTuple_Pack(3, g_arg.k_n, node, out) : nullptr;
        Py_XDECREF(node);
        Py_XDECREF(out);
        if (sp == nullptr) {
          Py_XDECREF(meta);
          return false;
        }
        *spec = sp;
        *sig = meta;
        return true;
      }
    }
  } else if (v == Py_None) {
    Py_INCREF(Py_None);
    Py_INCREF(Py_None);
    *spec = Py_None;
    *sig = Py_None;
    return true;
  } else if (t == &PyBool_Type || t == &PyLong_Type || t == &PyFloat_Type || t == &PyComplex_Type) {
    // a Python number: a new input at the end, its type the signature (_deferred._SCALARS)
    PyObject* pos = PyLong_FromSsize_t(PyList_GET_SIZE(inputs));
    if (pos == nullptr) return false;
    PyObject* sp = PyTuple_Pack(2, g_arg.k_i, pos);
    Py_DECREF(pos);
    if (sp == nullptr || PyList_Append(inputs, v) < 0) {
      Py_XDECREF(sp);
      return false;
    }
    Py_INCREF(reinterpret_cast<PyObject*>(t));
    *spec = sp;
    *sig = reinterpret_cast<PyObject*>(t);
    return true;
  } else if (t == &PyList_Type || t == &PyTuple_Type) {
    return split_pair(arg_list(g, inputs, input_pos, v), spec, sig);
  } else {
    int known = PySet_Contains(g_arg.arrays, reinterpret_cast<PyObject*>(t));
    if (known < 0) return false;
    if (known) {  // a device array: its input position, if the graph has it already (else _input adds it)
      PyObject* key = PyLong_FromVoidPtr(v);
      if (key == nullptr) return false;
      PyObject* found = PyDict_GetItemWithError(input_pos, key);  // borrowed
      Py_DECREF(key);
      if (found != nullptr) {
        Py_INCREF(found);
        return split_pair(found, spec, sig);
      }
      if (PyErr_Occurred()) return false;
      return split_pair(PyObject_CallFunctionObjArgs(g_arg.input, g, v, nullptr), spec, sig);
    }
  }
  return split_pair(PyObject_CallFunctionObjArgs(g_arg.arg, g, v, nullptr), spec, sig);
}

// _fuse_arg_list(graph, list[, top]) -> (("l", specs), sigs): _deferred._arg_list's loop (placeholders of the graph,
// its inputs, numbers and None inline; anything else through _arg). With `top` true: (specs, sigs) of a recorded
// call's own arguments (_deferred._record).
PyObject* py_fuse_arg_list(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs < 2 || nargs > 3 || g_arg.pending == nullptr) {
    PyErr_SetString(PyExc_TypeError,
                    "torch_tpu: internal error: _fuse_arg_list(graph, list[, top]) before _fuse_arg_types");
    return nullptr;
  }
  bool top = nargs == 3 && args[2] == Py_True;
  PyObject* g = args[0];
  PyObject* inputs = PyObject_GetAttr(g, g_arg.s_inputs);
  if (inputs == nullptr) return nullptr;
  PyObject* input_pos = PyObject_GetAttr(g, g_arg.s_input_pos);
  if (input_pos == nullptr || !PyList_Check(inputs) || !PyDict_Check(input_pos)) {
    Py_DECREF(inputs);
    Py_XDECREF(input_pos);
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "torch_tpu: internal error: a graph's inputs");
    return nullptr;
  }
  PyObject* out = arg_list(g, inputs, input_pos, args[1], top);
  Py_DECREF(inputs);
  Py_DECREF(input_pos);
  return out;
}

// ---- recording the op a graph's trace predicts (torch_tpu/_deferred.py `record`, its common case in C++) ----
// A step whose structure repeats records each op where the previous graph of its slot recorded the same one: the
// trace entry already holds the node's info. This does _deferred._record's work for that case only (the graph
// exists and has nodes, the entry at this position has the same key, argument specs and signature) and returns
// None for anything else, before changing anything the Python path would not redo (the inputs the arguments added
// are truncated): the Python path then records the op as before.
struct RecState {
  PyObject *lock = nullptr, *graphs = nullptr, *truncate = nullptr, *transfer = nullptr, *recorded = nullptr,
           *task_started = nullptr;
  PyObject *s_acquire, *s_release, *s_nodes, *s_keys, *s_entries, *s_pendings, *s_trace, *s_limit, *s_unflatten;
};
RecState g_rec;

PyObject* py_fuse_record_state(PyObject*, PyObject* args) {
  PyObject *lock, *graphs, *truncate, *transfer, *recorded, *task_started;
  if (!PyArg_ParseTuple(args, "OO!OOOO", &lock, &PyDict_Type, &graphs, &truncate, &transfer, &recorded,
                        &task_started))
    return nullptr;
  for (PyObject* o : {lock, graphs, truncate, transfer, recorded, task_started}) Py_INCREF(o);
  g_rec.recorded = recorded;
  g_rec.task_started = task_started;
  g_rec.lock = lock;
  g_rec.graphs = graphs;
  g_rec.truncate = truncate;
  g_rec.transfer = transfer;
  g_rec.s_acquire = PyUnicode_InternFromString("acquire");
  g_rec.s_release = PyUnicode_InternFromString("release");
  g_rec.s_nodes = PyUnicode_InternFromString("nodes");
  g_rec.s_keys = PyUnicode_InternFromString("keys");
  g_rec.s_entries = PyUnicode_InternFromString("entries");
  g_rec.s_pendings = PyUnicode_InternFromString("pendings");
  g_rec.s_trace = PyUnicode_InternFromString("trace");
  g_rec.s_limit = PyUnicode_InternFromString("limit");
  g_rec.s_unflatten = PyUnicode_InternFromString("unflatten");
  Py_RETURN_NONE;
}

// A new reference to attribute `name` of `o` (nullptr with an error set).
inline PyObject* attr(PyObject* o, PyObject* name) { return PyObject_GetAttr(o, name); }

// The trace entry predicted at the graph's next position when it is for `fkey` (a new reference to the trace's
// entries list in *entries, the position in *node), else false (*entries null; a Python error may be set). The
// checks that need no argument: an op the trace does not predict leaves before its arguments are looked at.
bool predicted_entry(PyObject* g, PyObject* fkey, PyObject** nodes, PyObject** entries, Py_ssize_t* node) {
  *entries = nullptr;
  *nodes = attr(g, g_rec.s_nodes);
  if (*nodes == nullptr) return false;
  *node = PyList_GET_SIZE(*nodes);
  if (*node == 0) return false;  // (the first op of a graph: the Python path, which also ends direct segments)
  PyObject* trace = attr(g, g_rec.s_trace);
  if (trace == nullptr) return false;
  if (trace != Py_None) *entries = attr(trace, g_rec.s_entries);
  Py_DECREF(trace);
  if (*entries == nullptr) return false;
  if (PyList_Check(*entries) && *node < PyList_GET_SIZE(*entries)) {
    PyObject* e = PyList_GET_ITEM(*entries, *node);
    if (PyTuple_Check(e) && PyTuple_GET_SIZE(e) == 4) {
      PyObject* theirs = PyTuple_GET_ITEM(e, 0);
      int same = theirs == fkey ? 1 : PyObject_RichCompareBool(theirs, fkey, Py_EQ);
      if (same == 1) return true;
    }
  }
  Py_CLEAR(*entries);
  return false;
}

PyObject* record_predicted(PyObject* g, PyObject* fkey, PyObject* fn, PyObject* args) {
  PyObject *nodes = nullptr, *entries = nullptr;
  Py_ssize_t node = 0;
  if (!predicted_entry(g, fkey, &nodes, &entries, &node)) {
    Py_XDECREF(nodes);
    if (PyErr_Occurred()) return nullptr;
    Py_RETURN_NONE;
  }
  PyObject* inputs = attr(g, g_arg.s_inputs);
  PyObject* input_pos = inputs ? attr(g, g_arg.s_input_pos) : nullptr;
  if (input_pos == nullptr) {
    Py_XDECREF(inputs);
    Py_DECREF(nodes);
    Py_DECREF(entries);
    return nullptr;
  }
  Py_ssize_t n_inputs = PyList_GET_SIZE(inputs);
  PyObject* pair = arg_list(g, inputs, input_pos, args, true);
  Py_DECREF(input_pos);
  PyObject* result = nullptr;
  bool fallback = false;
  bool appended = false;  // the node is in the graph: its inputs stay (an error after this is as in Python's)
  auto truncate = [&]() {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyObject* n = PyLong_FromSsize_t(n_inputs);
    PyObject* r = n ? PyObject_CallFunctionObjArgs(g_rec.truncate, g, n, nullptr) : nullptr;
    Py_XDECREF(n);
    Py_XDECREF(r);
    PyErr_Clear();
    PyErr_Restore(type, value, tb);
  };
  do {
    if (pair == nullptr) {
      if (PyErr_ExceptionMatches(g_rec.transfer)) {  // another graph's value: the Python path transfers it
        PyErr_Clear();
        fallback = true;
      }
      break;
    }
    PyObject* specs = PyTuple_GET_ITEM(pair, 0);
    PyObject* sig = PyTuple_GET_ITEM(pair, 1);
    PyObject* e = PyList_GET_ITEM(entries, node);  // (fkey, specs, sig, info): its fkey matched
    int same = 1;
    for (int k = 1; same == 1 && k < 3; ++k) {
      PyObject* mine = k == 1 ? specs : sig;
      PyObject* theirs = PyTuple_GET_ITEM(e, k);
      same = mine == theirs ? 1 : PyObject_RichCompareBool(theirs, mine, Py_EQ);
    }
    if (same < 0) break;
    if (!same) {
      fallback = true;
      break;
    }
    PyObject* info = PyTuple_GET_ITEM(e, 3);  // (node id, metas, treedef, text)
    PyObject* node_id = PyTuple_GET_ITEM(info, 0);
    PyObject* metas = PyTuple_GET_ITEM(info, 1);
    PyObject* treedef = PyTuple_GET_ITEM(info, 2);
    PyObject* keys = attr(g, g_rec.s_keys);
    PyObject* g_entries = keys ? attr(g, g_rec.s_entries) : nullptr;
    PyObject* pendings = g_entries ? attr(g, g_rec.s_pendings) : nullptr;
    PyObject* nd = pendings ? PyTuple_Pack(3, fn, specs, treedef) : nullptr;
    bool ok = nd != nullptr && PyList_Append(nodes, nd) == 0 && PyList_Append(keys, node_id) == 0 &&
              PyList_Append(g_entries, e) == 0;
    Py_XDECREF(nd);
    Py_XDECREF(keys);
    Py_XDECREF(g_entries);
    if (!ok) {
      Py_XDECREF(pendings);
      break;
    }
    appended = true;
    PyObject* node_obj = PyLong_FromSsize_t(node);
    Py_ssize_t n_out = treedef == Py_None ? 1 : PySequence_Size(metas);
    PyObject* outs = node_obj && n_out >= 0 ? PyList_New(n_out) : nullptr;
    for (Py_ssize_t j = 0; outs != nullptr && j < n_out; ++j) {
      PyObject* meta = PySequence_GetItem(metas, j);
      PyObject* jo = meta ? PyLong_FromSsize_t(j) : nullptr;
      PyObject* p = jo ? PyObject_CallFunctionObjArgs(g_arg.pending, g, node_obj, jo, meta, nullptr) : nullptr;
      Py_XDECREF(meta);
      Py_XDECREF(jo);
      PyObject* ref = p ? PyWeakref_NewRef(p, nullptr) : nullptr;
      if (ref == nullptr || PyList_Append(pendings, ref) < 0) {
        Py_XDECREF(ref);
        Py_XDECREF(p);
        Py_CLEAR(outs);
        break;
      }
      Py_DECREF(ref);
      PyList_SET_ITEM(outs, j, p);
    }
    Py_XDECREF(node_obj);
    Py_DECREF(pendings);
    if (outs == nullptr) break;  // (the node is appended: an error here is as one in Python's _record after it)
    PyObject* value;
    if (treedef == Py_None) {
      value = PyList_GET_ITEM(outs, 0);
      Py_INCREF(value);
    } else {
      value = PyObject_CallMethodOneArg(treedef, g_rec.s_unflatten, outs);
    }
    Py_DECREF(outs);
    if (value == nullptr) break;
    PyObject* limit = attr(g, g_rec.s_limit);
    long long lim = limit ? PyLong_AsLongLong(limit) : -1;
    Py_XDECREF(limit);
    if (lim == -1 && PyErr_Occurred()) {
      Py_DECREF(value);
      break;
    }
    result = Py_BuildValue("(NO)", value, node + 1 >= lim ? g : Py_None);
  } while (false);
  if (result == nullptr && !appended && (fallback || PyErr_Occurred())) truncate();
  Py_XDECREF(pair);
  Py_DECREF(nodes);
  Py_DECREF(entries);
  Py_DECREF(inputs);
  if (result == nullptr && fallback) Py_RETURN_NONE;
  return result;
}

// _fuse_record(index, fkey, fn, args) -> (result, graph to flush or None), or None: _deferred._record for the op the
// graph's trace predicts, under _deferred._lock (taken without blocking: None when another thread holds it).
PyObject* py_fuse_record(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 4 || g_rec.lock == nullptr || g_arg.pending == nullptr) {
    PyErr_SetString(PyExc_TypeError, "torch_tpu: internal error: _fuse_record(index, fkey, fn, args)");
    return nullptr;
  }
  const Caller* c = inherited();
  if (c == nullptr) publish();
  int64_t owner = c ? c->id : t_self->id;
  PyObject* got = PyObject_CallMethodOneArg(g_rec.lock, g_rec.s_acquire, Py_False);
  if (got == nullptr) return nullptr;
  bool locked = got == Py_True;
  Py_DECREF(got);
  if (!locked) Py_RETURN_NONE;
  PyObject* key = Py_BuildValue("(LO)", static_cast<long long>(owner), args[0]);
  PyObject* g = key ? PyDict_GetItemWithError(g_rec.graphs, key) : nullptr;  // borrowed
  Py_XDECREF(key);
  PyObject* out;
  if (g == nullptr) {
    out = PyErr_Occurred() ? nullptr : Py_NewRef(Py_None);
  } else {
    Py_INCREF(g);
    out = record_predicted(g, args[1], args[2], args[3]);
    Py_DECREF(g);
  }
  PyObject *type, *value, *tb;
  PyErr_Fetch(&type, &value, &tb);
  PyObject* r = PyObject_CallMethodNoArgs(g_rec.lock, g_rec.s_release);
  if (r == nullptr) {
    Py_XDECREF(out);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    return nullptr;
  }
  Py_DECREF(r);
  PyErr_Restore(type, value, tb);
  return out;
}

thread_local int t_task_seen = -1;  // the autograd graph task fuse_record_hit last told _task_started of

}  // namespace

PyObject* fuse_record_hit(PyObject* const* args) {
  if (g_rec.task_started == nullptr) return nullptr;
  // As _deferred.record: the first op a backward pass records starts it (_task_started runs the forward pass's
  // graphs); this thread's last task is remembered, _task_started checks its own set.
  int task = torch::autograd::get_current_graph_task_id();
  if (task >= 0 && task != t_task_seen) {
    PyObject* t = PyLong_FromLong(task);
    PyObject* r = t ? PyObject_CallOneArg(g_rec.task_started, t) : nullptr;
    Py_XDECREF(t);
    if (r == nullptr) return nullptr;
    Py_DECREF(r);
    t_task_seen = task;
  }
  PyObject* pair = py_fuse_record(nullptr, args, 4);
  if (pair == nullptr) return nullptr;
  if (pair == Py_None) {
    Py_DECREF(pair);
    return nullptr;
  }
  PyObject* value = PyTuple_GET_ITEM(pair, 0);
  PyObject* full = PyTuple_GET_ITEM(pair, 1);
  if (full != Py_None) {  // (a graph at its size limit runs)
    PyObject* r = PyObject_CallOneArg(g_rec.recorded, full);
    if (r == nullptr) {
      Py_DECREF(pair);
      return nullptr;
    }
    Py_DECREF(r);
  }
  Py_INCREF(value);
  Py_DECREF(pair);
  return value;
}

namespace {

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
    {"_fuse_flushed", py_fuse_flushed, METH_VARARGS,
     "a graph of this thread's flushed (n_ops, one-op flushes in a row before going direct)"},
    {"_fuse_recorded", py_fuse_recorded, METH_NOARGS, "this thread recorded a graph's first op (ends direct)"},
    {"_fuse_segment_end", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_fuse_segment_end)),
     METH_FASTCALL, "a synchronization point (value read or None, reason): ends a direct op's segment"},
    {"_fuse_direct_ends", py_fuse_direct_ends, METH_O, "{reason: segments of a direct op}, cleared with reset"},
    {"_fuse_direct", py_fuse_direct, METH_NOARGS, "True while this thread dispatches one-op segments directly"},
    {"_fuse_arg_types", py_fuse_arg_types, METH_VARARGS,
     "(Pending, array type set, _arg, _input): the recorder's types for _fuse_arg_list"},
    {"_fuse_record_state", py_fuse_record_state, METH_VARARGS,
     "(lock, graphs, truncate, Transfer): the recorder's state for _fuse_record"},
    {"_fuse_record", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_fuse_record)), METH_FASTCALL,
     "(index, fkey, fn, args) -> (result, graph to flush or None), or None: the predicted op recorded"},
    {"_fuse_arg_list", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_fuse_arg_list)), METH_FASTCALL,
     "(graph, list[, top]) -> ((\"l\", specs), sigs); with top (specs, sigs): recorded arguments"},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

bool recording() { return t_suspended == 0 && effective_mode() == kFuse; }

PyMethodDef* mode_methods() { return kModeMethods; }

int current_mode() { return effective_mode(); }

bool direct_dispatch() {
  if (!t_direct || t_suspended != 0 || effective_mode() != kFuse || inherited() != nullptr) return false;
  if (t_seg > 0) {  // a second op in the segment: it and the rest are recorded
    leave_direct();
    return false;
  }
  return true;
}

void direct_ran(const void* result) {
  t_seg = 1;
  t_last = result;
}

void segment_end(PyObject* value, PyObject* reason) {
  if (t_seg == 0 || (value != Py_None && value != t_last)) return;
  t_seg = 0;
  t_last = nullptr;
  for (auto& [r, n] : g_direct_ends) {
    if (r == reason) {
      ++n;
      return;
    }
  }
  Py_INCREF(reason);
  g_direct_ends.emplace_back(reason, 1);
}

}  // namespace torch_tpu
