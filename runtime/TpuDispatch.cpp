// The eager (DEFER_NEVER) dispatch path of cache hits, in C++.
//
// Each lowering's functional and in-place forms (kernels/registry.py, OpKernel) are registered for PrivateUse1
// as one boxed C++ kernel (EagerKernel). On a call whose arguments take the fast path (every given argument a tpu
// tensor viewing its whole array on one device, or a Python bool/int/float; trailing defaulted arguments omitted)
// in DEFER_NEVER, it builds the same key as OpKernel's Python fast path (arguments given, their kind mask, the
// in-place target's dtype), finds the jitted callable the Python slow path installed (OpKernel._install_fast ->
// _C._eager_put), calls it on the arrays and wraps the result as a new tpu tensor (or swaps the in-place target's
// array) without entering Python code. Everything else (a miss, another mode, CPU or view arguments, a result
// that does not fit the in-place target) calls the Python kernel with the arguments torch.library would pass it,
// so every check and error of the Python path is kept.
#include "TpuRuntime.h"

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/TensorImpl.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/csrc/utils/tensor_memoryformats.h>
#include <torch/library.h>

#include <deque>
#include <memory>
#include <string>
#include <vector>

namespace torch_tpu {
namespace {

constexpr int kMaxArgs = 30;  // as _C._fast_args: 2 mask bits per argument

struct Entry {
  int n;
  int64_t mask;
  int dtype;     // in-place target's ScalarType, -1 for the functional form
  PyObject* fn;  // owned
  // The last result aval decoded (see result_meta): owned, so identity means this same immutable object.
  PyObject* aval = nullptr;
  int aval_st = -1;
  std::vector<int64_t> aval_shape;
};

// The op whose cache hit is running on this thread (read by torch_tpu._metrics when a hit compiles new shapes).
struct Running {
  const std::string* name;
  PyObject* const* argv;
  int n;
};
thread_local const Running* t_running = nullptr;

// A recorded entry (DEFER_AND_FUSE): the node key and unjitted callable OpKernel._recorded_entry made for calls of
// this shape; a hit records fn(*arrays) through the executor's `record` (g_recorder) instead of running it.
struct RecEntry {
  int n;
  int64_t mask;
  int dtype;
  PyObject* key;  // owned
  PyObject* fn;   // owned
};
PyObject* g_recorder = nullptr;  // torch_tpu._executor.record(index, key, fn, args) -> placeholder (owned)

PyObject* number_of(const c10::IValue& v, int64_t* code) {
  if (v.isDouble()) {
    *code = 3;
    return PyFloat_FromDouble(v.toDouble());
  }
  if (v.isBool()) {  // (before isInt: a bool IValue is not an int, but keep the order explicit)
    *code = 1;
    return PyBool_FromLong(v.toBool());
  }
  if (v.isInt()) {
    *code = 2;
    return PyLong_FromLongLong(v.toInt());
  }
  return nullptr;
}

// A wrapped number (`x + 1`: the Python number becomes a 0-d CPU tensor marked wrapped) as the Python number
// torch.library hands the Python kernel.
PyObject* wrapped_number(c10::TensorImpl* impl, int64_t* code) {
  switch (impl->dtype().toScalarType()) {
    case c10::ScalarType::Double:
      *code = 3;
      return PyFloat_FromDouble(*static_cast<const double*>(impl->data()));
    case c10::ScalarType::Long:
      *code = 2;
      return PyLong_FromLongLong(*static_cast<const int64_t*>(impl->data()));
    case c10::ScalarType::Bool:
      *code = 1;
      return PyBool_FromLong(*static_cast<const bool*>(impl->data()));
    default:
      return nullptr;
  }
}

// A tpu tensor's array when it views all of it exactly as produced (as _C._fast_args), else nullptr (borrowed).
PyObject* whole_array(c10::TensorImpl* impl, int* device) {
  if (impl->device_type() != kTpu || impl->storage_offset() != 0) return nullptr;
  int idx = impl->device().index();
  if (*device >= 0 && idx != *device) return nullptr;
  TpuBuffer* buf = buffer_of(impl->unsafe_storage());
  dispatch_resolve_pending(buf);
  if (!views_whole_array(impl, buf)) return nullptr;
  *device = idx;
  return buf->array;
}

PyObject* interned(const char* name) {
  PyObject* s = PyUnicode_InternFromString(name);
  if (s == nullptr) throw python_error();
  return s;  // kept for the process
}

bool shape_of(PyObject* array, std::vector<int64_t>* shape) {
  static PyObject* const kShape = interned("shape");
  PyObject* shp = PyObject_GetAttr(array, kShape);
  if (shp == nullptr) return false;
  if (!PyTuple_Check(shp)) {
    Py_DECREF(shp);
    PyErr_SetString(PyExc_TypeError, "torch_tpu: internal error: an XLA result's shape is not a tuple");
    return false;
  }
  Py_ssize_t n = PyTuple_GET_SIZE(shp);
  shape->resize(n);
  for (Py_ssize_t i = 0; i < n; ++i) (*shape)[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(shp, i));
  Py_DECREF(shp);
  return !PyErr_Occurred();
}

// The torch dtype of an array (through the map torch_tpu._runtime set), or -1 with no Python error when it has
// none (the caller falls back to the Python kernel, which reports it).
int scalar_type_of_array(PyObject* array) {
  PyObject* map = dispatch_dtype_map();
  if (map == nullptr) return -1;
  static PyObject* const kDtype = interned("dtype");
  // The last lookup, by the dtype object's identity (numpy dtypes are interned singletons; a new object is
  // looked up again, so this is only a shortcut). Read and written with the GIL held.
  static PyObject* last_npdt = nullptr;
  static int last_st = -1;
  PyObject* npdt = PyObject_GetAttr(array, kDtype);
  if (npdt == nullptr) {
    PyErr_Clear();
    return -1;
  }
  if (npdt == last_npdt) {
    Py_DECREF(npdt);
    return last_st;
  }
  PyObject* tdt = PyDict_GetItem(map, npdt);  // borrowed
  if (tdt == nullptr || !THPDtype_Check(tdt)) {
    Py_DECREF(npdt);
    return -1;
  }
  Py_XDECREF(last_npdt);
  last_npdt = npdt;  // the reference kept
  last_st = static_cast<int>(reinterpret_cast<THPDtype*>(tdt)->scalar_type);
  return last_st;
}

// The torch dtype and shape of a cache hit's result. A jax Array's `dtype` and `shape` are Python properties
// reading its aval (about 900 instructions each, measured with callgrind: a fifth of the C++ path); the aval
// is a C++ attribute of the Array, and jit hands out the same aval object on each call of a compiled
// executable, so each entry keeps the last aval it decoded with its decoding. false with no Python error: no
// such result (the caller takes the Python kernel, which reports it).
bool result_meta(PyObject* out, Entry& e, int* st, std::vector<int64_t>* shape) {
  static PyObject* const kAval = interned("aval");
  PyObject* aval = PyObject_GetAttr(out, kAval);
  if (aval == nullptr) {
    PyErr_Clear();
    *st = scalar_type_of_array(out);
    return *st >= 0 && shape_of(out, shape);
  }
  if (aval == e.aval) {
    Py_DECREF(aval);
    *st = e.aval_st;
    *shape = e.aval_shape;
    return true;
  }
  *st = scalar_type_of_array(aval);  // (a ShapedArray keeps dtype and shape in slots)
  if (*st < 0 || !shape_of(aval, shape)) {
    Py_DECREF(aval);
    return false;
  }
  Py_XDECREF(e.aval);
  e.aval = aval;  // the reference kept
  e.aval_st = *st;
  e.aval_shape = *shape;
  return true;
}

// A new tpu tensor owning device array `out` (a new reference, consumed) of dtype `stype` and shape `shape`.
at::Tensor tensor_of(PyObject* out, c10::ScalarType stype, std::vector<int64_t> shape, int device) {
  int64_t numel = 1;
  for (int64_t s : shape) numel *= s;
  size_t nbytes = static_cast<size_t>(numel) * c10::elementSize(stype);
  c10::Storage storage;
  try {  // (out of memory: the allocator's limit)
    storage = make_storage(out, stype, shape, nbytes, static_cast<c10::DeviceIndex>(device));
  } catch (...) {
    Py_DECREF(out);
    throw;
  }
  Py_DECREF(out);
  auto t = at::detail::make_tensor<c10::TensorImpl>(std::move(storage),
                                                    c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                                    c10::scalarTypeToTypeMeta(stype));
  t.unsafeGetTensorImpl()->set_sizes_contiguous(shape);
  return t;
}

class EagerKernel final : public c10::OperatorKernel {
 public:
  EagerKernel(std::string name, PyObject* py_kernel, bool inplace)
      : name_(std::move(name)), py_kernel_(py_kernel), inplace_(inplace) {
    Py_INCREF(py_kernel_);
  }

  // Never destroyed before interpreter shutdown (the registration lives as long as the process): no decref.

  void put(int n, int64_t mask, int dtype, PyObject* fn) {
    for (Entry& e : entries_) {
      if (e.n == n && e.mask == mask && e.dtype == dtype) return;  // kept: its compiled executables stay
    }
    Py_INCREF(fn);
    entries_.push_back(Entry{n, mask, dtype, fn});  // (a deque: entries stay put while a hit uses one)
  }

  void put_rec(int n, int64_t mask, int dtype, PyObject* key, PyObject* fn) {
    for (RecEntry& e : rec_entries_) {
      if (e.n == n && e.mask == mask && e.dtype == dtype) return;  // (as put: the first entry stays)
    }
    Py_INCREF(key);
    Py_INCREF(fn);
    rec_entries_.push_back(RecEntry{n, mask, dtype, key, fn});
  }

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet /*ks*/, torch::jit::Stack* stack) {
    const auto& schema = op.schema();
    const size_t nargs = schema.arguments().size();
    py::gil_scoped_acquire gil;
    if (try_hit(schema, stack, nargs)) return;
    call_python(op, stack, nargs);
  }

 private:
  // The cache hit; false (nothing popped, no Python error) when the call must take the Python kernel. Under
  // DEFER_AND_FUSE (`rec`) the hit is recorded: the recorded entry's callable and key go to the executor's
  // `record`, as OpKernel.functional / inplace's fast path does, without the Python kernel's frame, its argument
  // parsing and the wrap.
  bool try_hit(const c10::FunctionSchema& schema, torch::jit::Stack* stack, size_t nargs) {
    if ((entries_.empty() && rec_entries_.empty()) || g_in_bad_fork) return false;
    // DEFER_NEVER; or DEFER_AND_FUSE's one-op segment, which runs as its eager op would (TpuMode.cpp)
    bool direct = current_mode() != 0;
    bool rec = false;
    if (direct && !direct_dispatch()) {
      if (rec_entries_.empty() || g_recorder == nullptr || !recording()) return false;
      rec = true;  // recorded into this thread's graph (placeholders taken as arguments)
      direct = false;
    }
    if (!rec && entries_.empty()) return false;
    const auto& args = schema.arguments();
    c10::IValue* iv = stack->data() + (stack->size() - nargs);
    // The arguments the Python kernel would get positionally (see call_python and OpKernel._positional): up to
    // the last non-defaulted one, with non-defaulted kwarg-only arguments only when they directly follow.
    size_t kw_start = nargs;
    while (kw_start > 0 && args[kw_start - 1].kwarg_only()) --kw_start;
    size_t pos = kw_start;
    while (pos > 0 && is_default(args[pos - 1], iv[pos - 1])) --pos;
    size_t n = pos;
    for (size_t i = kw_start; i < nargs; ++i) {
      if (is_default(args[i], iv[i])) continue;
      if (i != n) return false;  // a keyword the Python kernel keeps as a keyword: its slow path
      ++n;
    }
    if (n == 0 || n > static_cast<size_t>(kMaxArgs)) return false;
    PyObject* argv[kMaxArgs];
    size_t made = 0;
    int device = -1;
    int64_t mask = 0;
    bool ok = true;
    for (size_t i = 0; i < n && ok; ++i) {
      const c10::IValue& v = iv[i];
      int64_t code = 0;
      PyObject* obj = nullptr;
      if (v.isTensor()) {
        c10::TensorImpl* impl = v.unsafeToTensorImpl();
        if (impl->is_wrapped_number()) {
          obj = wrapped_number(impl, &code);
        } else if ((obj = whole_array(impl, &device)) != nullptr) {
          if (direct && !dispatch_is_array(obj)) obj = nullptr;  // a placeholder still pending: it is recorded
          else Py_INCREF(obj);
        }
      } else {
        obj = number_of(v, &code);
      }
      if (obj == nullptr) {
        if (PyErr_Occurred()) {  // (resolving a pending value failed)
          for (size_t j = 0; j < made; ++j) Py_DECREF(argv[j]);
          throw python_error();
        }
        ok = false;
        break;
      }
      argv[made++] = obj;
      mask |= code << (2 * i);
    }
    auto release = [&]() {
      for (size_t j = 0; j < made; ++j) Py_DECREF(argv[j]);
    };
    int target_dtype = -1;
    if (ok && inplace_) {
      if (!iv[0].isTensor()) ok = false;
      else target_dtype = static_cast<int>(iv[0].unsafeToTensorImpl()->dtype().toScalarType());
    }
    if (rec) return record_hit(stack, iv, nargs, n, argv, made, ok ? device : -1, mask, target_dtype);
    Entry* entry = nullptr;
    if (ok && device >= 0) {
      for (Entry& e : entries_) {
        if (e.n == static_cast<int>(n) && e.mask == mask && e.dtype == target_dtype) {
          entry = &e;
          break;
        }
      }
    }
    PyObject* fn = entry != nullptr ? entry->fn : nullptr;
    if (fn == nullptr) {
      release();
      return false;
    }
    Py_INCREF(fn);  // another thread may add entries while the call runs without the GIL
    Running running{&name_, argv, static_cast<int>(n)};
    const Running* saved = t_running;
    t_running = &running;
    PyObject* out = PyObject_Vectorcall(fn, argv, n, nullptr);
    t_running = saved;
    Py_DECREF(fn);
    release();
    if (out == nullptr) {
      translate_oom_error(device, "aten::" + name_);
      throw python_error();
    }
    if (direct) direct_ran(out);
    if (!dispatch_collect_if_due()) {
      Py_DECREF(out);
      throw python_error();
    }
    int st = -1;
    std::vector<int64_t> shape;
    if (!result_meta(out, *entry, &st, &shape)) {
      Py_DECREF(out);
      if (PyErr_Occurred()) throw python_error();
      return false;
    }
    return finish(stack, iv, nargs, out, static_cast<c10::ScalarType>(st), std::move(shape), device);
  }

  // try_hit's recorded form: `argv` (`made` new references, consumed here) are the call's arrays, placeholders and
  // numbers; device < 0: the call is not a fast-path one.
  bool record_hit(torch::jit::Stack* stack, c10::IValue* iv, size_t nargs, size_t n, PyObject** argv, size_t made,
                  int device, int64_t mask, int target_dtype) {
    RecEntry* entry = nullptr;
    if (device >= 0 && made == n) {
      for (RecEntry& e : rec_entries_) {
        if (e.n == static_cast<int>(n) && e.mask == mask && e.dtype == target_dtype) {
          entry = &e;
          break;
        }
      }
    }
    if (entry == nullptr) {
      for (size_t j = 0; j < made; ++j) Py_DECREF(argv[j]);
      return false;
    }
    PyObject* tuple = PyTuple_New(static_cast<Py_ssize_t>(n));
    if (tuple == nullptr) {
      for (size_t j = 0; j < made; ++j) Py_DECREF(argv[j]);
      throw python_error();
    }
    for (size_t j = 0; j < n; ++j) PyTuple_SET_ITEM(tuple, j, argv[j]);  // (references stolen)
    PyObject* index = PyLong_FromLong(device);
    if (index == nullptr) {
      Py_DECREF(tuple);
      throw python_error();
    }
    // (entry's key and fn: held by the entry, which stays put while the recorder runs, even without the GIL)
    PyObject* call[4] = {index, entry->key, entry->fn, tuple};
    PyObject* out = fuse_record_hit(call);  // the predicted op, all in C++ (TpuMode.cpp)
    if (out == nullptr && !PyErr_Occurred()) out = PyObject_Vectorcall(g_recorder, call, 4, nullptr);
    Py_DECREF(index);
    Py_DECREF(tuple);
    if (out == nullptr || !dispatch_collect_if_due()) {
      Py_XDECREF(out);
      throw python_error();
    }
    int st = scalar_type_of_array(out);
    std::vector<int64_t> shape;
    if (st < 0 || !shape_of(out, &shape)) {
      Py_DECREF(out);
      if (PyErr_Occurred()) throw python_error();
      return false;
    }
    return finish(stack, iv, nargs, out, static_cast<c10::ScalarType>(st), std::move(shape), device);
  }

  // Stores a hit's result `out` (a new reference, consumed): the in-place target's new array (false when it does
  // not fit the target exactly: the Python kernel decides), or a new tpu tensor, in place of the arguments.
  bool finish(torch::jit::Stack* stack, c10::IValue* iv, size_t nargs, PyObject* out, c10::ScalarType stype,
              std::vector<int64_t> shape, int device) {
    if (inplace_) {
      // As _C._set_whole: the result must be exactly the target's shape and dtype and the target must view its
      // whole storage; else the Python kernel recomputes with its checks (broadcast and cast errors).
      const at::Tensor& target = iv[0].toTensor();
      c10::TensorImpl* impl = target.unsafeGetTensorImpl();
      TpuBuffer* buf = buffer_of(impl->unsafe_storage());
      if (stype != impl->dtype().toScalarType() || !impl->sizes().equals(shape) || has_math_bits(impl) ||
          static_cast<size_t>(impl->numel()) * c10::elementSize(stype) != buf->nbytes) {
        Py_DECREF(out);
        return false;
      }
      set_buffer_array(buf, out, stype, std::move(shape));
      Py_DECREF(out);
      at::Tensor result = target;
      torch::jit::drop(*stack, nargs);
      torch::jit::push(*stack, std::move(result));
      return true;
    }
    at::Tensor t = tensor_of(out, stype, std::move(shape), device);
    torch::jit::drop(*stack, nargs);
    torch::jit::push(*stack, std::move(t));
    return true;
  }

  static bool is_default(const c10::Argument& arg, const c10::IValue& v) {
    const auto& d = arg.default_value();
    return d.has_value() && !(*d != v);
  }

  // The Python kernel, called as torch.library calls a Python kernel (torch's parseIValuesToPyArgsKwargs and
  // pushPyOutToStack): trailing defaulted positional arguments and defaulted keyword-only ones omitted.
  void call_python(const c10::OperatorHandle& op, torch::jit::Stack* stack, size_t nargs) {
    const auto& schema = op.schema();
    const auto& args = schema.arguments();
    auto arguments = torch::jit::pop(*stack, nargs);
    size_t kw_start = nargs;
    while (kw_start > 0 && args[kw_start - 1].kwarg_only()) --kw_start;
    size_t pos = kw_start;
    while (pos > 0 && is_default(args[pos - 1], arguments[pos - 1])) --pos;
    py::tuple py_args(pos);
    for (size_t i = 0; i < pos; ++i) py_args[i] = to_python(args[i], arguments[i]);
    py::dict kwargs;
    for (size_t i = kw_start; i < nargs; ++i) {
      if (is_default(args[i], arguments[i])) continue;
      kwargs[py::str(args[i].name())] = to_python(args[i], arguments[i]);
    }
    PyObject* out = PyObject_Call(py_kernel_, py_args.ptr(), kwargs.ptr());
    if (out == nullptr) throw python_error();
    auto obj = py::reinterpret_steal<py::object>(out);
    const auto& returns = schema.returns();
    if (returns.empty()) {
      TORCH_CHECK(obj.is_none(), "torch_tpu: aten::", name_, " returned a value where its schema has none");
    } else if (returns.size() == 1) {
      torch::jit::push(*stack, torch::jit::toIValue(obj, returns[0].real_type()));
    } else {
      auto outs = py::cast<py::sequence>(obj);
      TORCH_CHECK(outs.size() == returns.size(), "torch_tpu: aten::", name_, " returned ", outs.size(),
                  " values where its schema has ", returns.size());
      for (size_t i = 0; i < returns.size(); ++i)
        torch::jit::push(*stack, torch::jit::toIValue(outs[i], returns[i].real_type()));
    }
  }

  static py::object to_python(const c10::Argument& arg, const c10::IValue& v) {
    if (v.isNone()) return py::none();
    auto match = [&](c10::TypeKind kind) {
      const auto& t = arg.real_type();
      if (t->kind() == kind) return true;
      if (auto opt = t->cast<c10::OptionalType>()) return opt->getElementType()->kind() == kind;
      return false;
    };
    if (match(c10::ScalarTypeType::Kind)) {
      return py::reinterpret_borrow<py::object>(
          reinterpret_cast<PyObject*>(torch::getTHPDtype(static_cast<c10::ScalarType>(v.toInt()))));
    }
    if (match(c10::LayoutType::Kind)) {
      return py::reinterpret_borrow<py::object>(
          reinterpret_cast<PyObject*>(torch::getTHPLayout(static_cast<c10::Layout>(v.toInt()))));
    }
    if (match(c10::MemoryFormatType::Kind)) {
      return py::reinterpret_borrow<py::object>(
          torch::utils::getTHPMemoryFormat(static_cast<c10::MemoryFormat>(v.toInt())));
    }
    return torch::jit::toPyObject(v);
  }

  std::string name_;
  PyObject* py_kernel_;
  bool inplace_;
  std::deque<Entry> entries_;  // read and written with the GIL held
  std::deque<RecEntry> rec_entries_;  // the same for DEFER_AND_FUSE's recorded entries
};

std::vector<EagerKernel*>& kernels() {
  static std::vector<EagerKernel*> k;
  return k;
}

torch::Library& library() {
  static auto* lib = new torch::Library(torch::Library::IMPL, "aten", c10::DispatchKey::PrivateUse1, __FILE__,
                                        __LINE__);
  return *lib;
}

// _eager_install(name, python_kernel, inplace) -> handle: registers aten::<name>'s PrivateUse1 kernel.
PyObject* py_eager_install(PyObject*, PyObject* args) {
  HANDLE_TH_ERRORS
  const char* name;
  PyObject* fn;
  int inplace;
  if (!PyArg_ParseTuple(args, "sOp", &name, &fn, &inplace)) return nullptr;
  auto kernel = std::make_unique<EagerKernel>(name, fn, inplace != 0);
  EagerKernel* raw = kernel.get();
  library().impl(name, torch::CppFunction::makeFromBoxedFunctor(std::move(kernel)));
  kernels().push_back(raw);
  return PyLong_FromSsize_t(static_cast<Py_ssize_t>(kernels().size() - 1));
  END_HANDLE_TH_ERRORS
}

// The kernel of an _eager_install handle, and an entry's in-place target dtype (None: -1, the functional form):
// what _eager_put and _eager_put_rec both take.
EagerKernel* kernel_at(Py_ssize_t handle) {
  TORCH_CHECK(handle >= 0 && handle < static_cast<Py_ssize_t>(kernels().size()),
              "torch_tpu: internal error: eager kernel handle ", handle);
  return kernels()[handle];
}

int target_dtype(PyObject* dtype, const char* who) {
  if (dtype == Py_None) return -1;
  TORCH_CHECK(THPDtype_Check(dtype), "torch_tpu: internal error: ", who, " expects a torch.dtype or None");
  return static_cast<int>(reinterpret_cast<THPDtype*>(dtype)->scalar_type);
}

// _eager_put(handle, n, mask, dtype or None, fn): calls with n arguments of kinds `mask` (and, in-place, a target
// of `dtype`) run fn(*arrays) in C++ from now on.
PyObject* py_eager_put(PyObject*, PyObject* args) {
  HANDLE_TH_ERRORS
  Py_ssize_t handle;
  int n;
  long long mask;
  PyObject *dtype, *fn;
  if (!PyArg_ParseTuple(args, "niLOO", &handle, &n, &mask, &dtype, &fn)) return nullptr;
  kernel_at(handle)->put(n, static_cast<int64_t>(mask), target_dtype(dtype, "_eager_put"), fn);
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

// _eager_put_rec(handle, n, mask, dtype or None, key, fn): under DEFER_AND_FUSE, calls with n arguments of kinds
// `mask` (and, in-place, a target of `dtype`) are recorded as record(device, key, fn, arrays) from now on, in C++.
PyObject* py_eager_put_rec(PyObject*, PyObject* args) {
  HANDLE_TH_ERRORS
  Py_ssize_t handle;
  int n;
  long long mask;
  PyObject *dtype, *key, *fn;
  if (!PyArg_ParseTuple(args, "niLOOO", &handle, &n, &mask, &dtype, &key, &fn)) return nullptr;
  kernel_at(handle)->put_rec(n, static_cast<int64_t>(mask), target_dtype(dtype, "_eager_put_rec"), key, fn);
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

// _eager_set_recorder(record or None): the executor's record(index, key, fn, args) the recorded entries call (None:
// recorded calls take the Python kernel, as before the entries existed). Returns the previous one.
PyObject* py_eager_set_recorder(PyObject*, PyObject* fn) {
  PyObject* old = g_recorder != nullptr ? g_recorder : Py_NewRef(Py_None);
  g_recorder = fn != Py_None ? Py_NewRef(fn) : nullptr;
  return old;
}

// _eager_running() -> (op name, argument arrays) of the cache hit running on this thread, or None.
PyObject* py_eager_running(PyObject*, PyObject*) {
  if (t_running == nullptr) Py_RETURN_NONE;
  PyObject* argv = PyTuple_New(t_running->n);
  if (argv == nullptr) return nullptr;
  for (int i = 0; i < t_running->n; ++i) {
    Py_INCREF(t_running->argv[i]);
    PyTuple_SET_ITEM(argv, i, t_running->argv[i]);
  }
  return Py_BuildValue("(sN)", t_running->name->c_str(), argv);
}

PyMethodDef kDispatchMethods[] = {
    {"_eager_install", py_eager_install, METH_VARARGS, "register a lowering's PrivateUse1 kernel (C++ cache hits)"},
    {"_eager_put", py_eager_put, METH_VARARGS, "add a cache-hit entry to an eager kernel"},
    {"_eager_put_rec", py_eager_put_rec, METH_VARARGS, "add a recorded (DEFER_AND_FUSE) entry to an eager kernel"},
    {"_eager_set_recorder", py_eager_set_recorder, METH_O, "the executor's record function for recorded entries"},
    {"_eager_running", py_eager_running, METH_NOARGS, "(op, arrays) of the C++ cache hit running on this thread"},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

PyMethodDef* dispatch_methods() { return kDispatchMethods; }

at::Tensor dispatch_call_unary(PyObject* fn, const at::Tensor& self, c10::ScalarType want, const std::string& what) {
  c10::TensorImpl* impl = self.unsafeGetTensorImpl();
  int device = -1;
  PyObject* arr = whole_array(impl, &device);  // (borrowed)
  if (arr == nullptr) {
    if (PyErr_Occurred()) throw python_error();  // (resolving a pending value failed)
    return at::Tensor();
  }
  if (!dispatch_is_array(arr)) return at::Tensor();  // a placeholder still pending (DEFER_AND_FUSE's)
  Py_INCREF(arr);  // (the storage may swap its array, and another thread its callable, while the call runs
  Py_INCREF(fn);   // without the GIL)
  PyObject* out = PyObject_CallOneArg(fn, arr);
  Py_DECREF(fn);
  Py_DECREF(arr);
  if (out == nullptr) {
    translate_oom_error(device, what);
    throw python_error();
  }
  if (!dispatch_collect_if_due()) {
    Py_DECREF(out);
    throw python_error();
  }
  int st = scalar_type_of_array(out);
  std::vector<int64_t> shape;
  if (st != static_cast<int>(want) || !shape_of(out, &shape) || !impl->sizes().equals(shape)) {
    Py_DECREF(out);  // (not what the cast must give: the caller's Python path decides, with its checks)
    PyErr_Clear();
    return at::Tensor();
  }
  return tensor_of(out, want, std::move(shape), device);
}

}  // namespace torch_tpu
