// The extension module torch_tpu._C: the fast accessors kernels use to read a tensor's device array,
// wrap a new array as a tpu tensor and swap a storage's array, plus device, generator and fallback
// controls for the Python front.
#include "TpuGenerator.h"
#include "TpuRuntime.h"

#include <ATen/core/Tensor.h>
#include <c10/core/TensorImpl.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/Generator.h>
#include <torch/csrc/Storage.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <atomic>

namespace torch_tpu {

Callbacks& callbacks() {
  static Callbacks cb;
  return cb;
}

namespace {

std::vector<int64_t> shape_of(PyObject* array) {
  PyObject* shp = PyObject_GetAttrString(array, "shape");
  if (shp == nullptr) throw py::error_already_set();
  Py_ssize_t n = PyTuple_Size(shp);
  std::vector<int64_t> shape(n);
  for (Py_ssize_t i = 0; i < n; ++i) shape[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(shp, i));
  Py_DECREF(shp);
  return shape;
}

c10::ScalarType scalar_type_of(PyObject* dtype) {
  if (!THPDtype_Check(dtype)) throw py::type_error("torch_tpu._C: expected a torch.dtype");
  return reinterpret_cast<THPDtype*>(dtype)->scalar_type;
}

// What a storage holds: a concrete device array, or a placeholder. The runtime knows one concrete array type
// (jax's ArrayImpl, registered by torch_tpu/_runtime.py when it starts: `_set_array_type`); any other object
// held is a placeholder for a value an executor has not computed yet (DEFER_AND_FUSE's, torch_tpu/_deferred.py).
// This layer never looks inside a placeholder. The contract, for whichever executor makes placeholders:
//   - a placeholder has the shape and dtype of the value it stands for (`array_shape`, `array_dtype` below are
//     recorded when it is stored, as for an array);
//   - every accessor below that reads a storage first calls the one resolver registered with `_set_resolver`
//     (in torch_tpu/__init__.py), `resolver(placeholder)`, which returns the concrete array to hold from now
//     on, or None to keep holding the placeholder (the calling thread records work with it and needs no value
//     yet). The resolver may compute the value, release the GIL and let other threads run; it may raise. An
//     eager kernel thus never sees a placeholder, and a resolved one is swapped out on first read, so later
//     reads take the fast path.
// The check on the fast path is one type-pointer comparison, as cheap as the type check it replaces.
PyObject* g_array_type = nullptr;  // the concrete device array type
PyObject* g_resolver = nullptr;    // placeholder -> concrete array, or None to keep it

inline void resolve_placeholder(TpuBuffer* buf) {
  PyObject* a = buf->array;
  if (a == nullptr || reinterpret_cast<PyObject*>(Py_TYPE(a)) == g_array_type || g_resolver == nullptr) return;
  Py_INCREF(a);  // the resolver may release the GIL: another thread may swap the storage's array meanwhile
  PyObject* v = PyObject_CallOneArg(g_resolver, a);
  if (v == nullptr) {
    Py_DECREF(a);
    throw python_error();
  }
  bool same = buf->array == a;
  Py_DECREF(a);
  if (!same) {
    Py_DECREF(v);
    return resolve_placeholder(buf);
  }
  if (v != Py_None) set_buffer_array(buf, v, buf->array_dtype, buf->array_shape);
  Py_DECREF(v);
}

// Compiled-program collection (torch_tpu/_programs.py): the compile listener only marks a collection due (it
// runs inside JAX's compile path); the accessors that store an op's result run the collector first, after the
// JAX call that made the result has returned. Returns false with a Python error set if the collector raised.
std::atomic<bool> g_collect_due{false};
PyObject* g_collector = nullptr;

inline bool collect_if_due() {
  if (!g_collect_due.load(std::memory_order_relaxed) || g_collector == nullptr) return true;
  if (!g_collect_due.exchange(false)) return true;
  PyObject* r = PyObject_CallNoArgs(g_collector);
  if (r == nullptr) return false;
  Py_DECREF(r);
  return true;
}

const at::Tensor& tensor_arg(PyObject* obj) {
  if (!THPVariable_Check(obj)) throw py::type_error("torch_tpu._C: expected a tensor");
  return THPVariable_Unpack(obj);
}

// _array(t): the storage's array when `t` views all of it exactly as produced (same dtype and shape,
// contiguous, offset 0), else None. This is the fast path every kernel tries first.
PyObject* py_array(PyObject* /*self*/, PyObject* obj) {
  HANDLE_TH_ERRORS
  const at::Tensor& t = tensor_arg(obj);
  c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  if (impl->device_type() != kTpu || impl->storage_offset() != 0) Py_RETURN_NONE;
  TpuBuffer* buf = buffer_of(impl->unsafe_storage());
  resolve_placeholder(buf);
  if (!views_whole_array(impl, buf)) Py_RETURN_NONE;
  Py_INCREF(buf->array);
  return buf->array;
  END_HANDLE_TH_ERRORS
}

PyObject* g_dtype_map = nullptr;  // {numpy dtype: torch.dtype}, set by torch_tpu._runtime

// _wrap(array, dtype or None, device_index): a new contiguous tpu tensor whose new storage owns `array`.
// With dtype None, the torch dtype is looked up from array.dtype.
PyObject* py_wrap(PyObject* /*self*/, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject *array, *dtype;
  int device;
  if (!PyArg_ParseTuple(args, "OOi", &array, &dtype, &device)) return nullptr;
  if (!collect_if_due()) return nullptr;
  if (dtype == Py_None) {
    TORCH_CHECK(g_dtype_map != nullptr, "torch_tpu: internal error: dtype map not set");
    PyObject* npdt = PyObject_GetAttrString(array, "dtype");
    if (npdt == nullptr) return nullptr;
    dtype = PyDict_GetItem(g_dtype_map, npdt);  // borrowed
    Py_DECREF(npdt);
    TORCH_CHECK(dtype != nullptr, "torch_tpu: an XLA result has a dtype with no torch equivalent");
  }
  c10::ScalarType st = scalar_type_of(dtype);
  std::vector<int64_t> shape = shape_of(array);
  int64_t numel = 1;
  for (int64_t s : shape) numel *= s;
  size_t nbytes = static_cast<size_t>(numel) * c10::elementSize(st);
  c10::Storage storage = make_storage(array, st, shape, nbytes, static_cast<c10::DeviceIndex>(device));
  auto t = at::detail::make_tensor<c10::TensorImpl>(std::move(storage),
                                                    c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                                    c10::scalarTypeToTypeMeta(st));
  t.unsafeGetTensorImpl()->set_sizes_contiguous(shape);
  return THPVariable_Wrap(std::move(t));
  END_HANDLE_TH_ERRORS
}

c10::Storage storage_arg(PyObject* obj) {
  if (THPVariable_Check(obj)) return THPVariable_Unpack(obj).storage();
  if (THPStorage_Check(obj)) return THPStorage_Unpack(obj);
  throw py::type_error("torch_tpu._C: expected a tensor or an UntypedStorage");
}

// _set_array(tensor_or_storage, array, dtype): the storage now holds `array` (same byte size).
PyObject* py_set_array(PyObject* /*self*/, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject *obj, *array, *dtype;
  if (!PyArg_ParseTuple(args, "OOO", &obj, &array, &dtype)) return nullptr;
  if (!collect_if_due()) return nullptr;
  c10::Storage storage = storage_arg(obj);
  TpuBuffer* buf = buffer_of(storage);
  c10::ScalarType st = scalar_type_of(dtype);
  std::vector<int64_t> shape = shape_of(array);
  int64_t numel = 1;
  for (int64_t s : shape) numel *= s;
  size_t nbytes = static_cast<size_t>(numel) * c10::elementSize(st);
  TORCH_CHECK(nbytes == buf->nbytes, "torch_tpu: internal error: writing an array of ", nbytes,
              " bytes into a storage of ", buf->nbytes, " bytes");
  set_buffer_array(buf, array, st, std::move(shape));
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

// _is_tpu_buffer(tensor_or_storage) -> whether its storage is a torch_tpu buffer (_storage_array takes it)
PyObject* py_is_tpu_buffer(PyObject* /*self*/, PyObject* obj) {
  HANDLE_TH_ERRORS
  return PyBool_FromLong(is_buffer(storage_arg(obj)));
  END_HANDLE_TH_ERRORS
}

// _storage_array(tensor_or_storage) -> (array or None, nbytes, device_index)
PyObject* py_storage_array(PyObject* /*self*/, PyObject* obj) {
  HANDLE_TH_ERRORS
  c10::Storage storage = storage_arg(obj);
  TpuBuffer* buf = buffer_of(storage);
  resolve_placeholder(buf);
  PyObject* arr = buf->array ? buf->array : Py_None;
  return Py_BuildValue("(Oni)", arr, static_cast<Py_ssize_t>(buf->nbytes), static_cast<int>(buf->device));
  END_HANDLE_TH_ERRORS
}

// _fast_args(args_tuple) -> (device_index, mask, tuple of arrays/numbers) or None.
// The hot path of every kernel: succeeds when each argument is a tpu tensor viewing its whole array (all on
// one device) or a Python bool/int/float. mask packs 2 bits per argument: 0 tensor, 1 bool, 2 int, 3 float.
PyObject* py_fast_args(PyObject* /*self*/, PyObject* args) {
  HANDLE_TH_ERRORS
  if (!PyTuple_Check(args)) Py_RETURN_NONE;
  Py_ssize_t n = PyTuple_GET_SIZE(args);
  if (n > 30) Py_RETURN_NONE;
  int device = -1;
  long mask = 0;
  PyObject* dyn = PyTuple_New(n);
  if (dyn == nullptr) return nullptr;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* a = PyTuple_GET_ITEM(args, i);
    long code;
    PyObject* v = a;
    if (PyBool_Check(a)) {
      code = 1;
    } else if (PyLong_CheckExact(a)) {
      code = 2;
    } else if (PyFloat_CheckExact(a)) {
      code = 3;
    } else if (THPVariable_Check(a)) {
      code = 0;
      const at::Tensor& t = THPVariable_Unpack(a);
      c10::TensorImpl* impl = t.unsafeGetTensorImpl();
      if (impl->device_type() != kTpu || impl->storage_offset() != 0) {
        Py_DECREF(dyn);
        Py_RETURN_NONE;
      }
      int idx = impl->device().index();
      TpuBuffer* buf = buffer_of(impl->unsafe_storage());
      resolve_placeholder(buf);
      if ((device >= 0 && idx != device) || !views_whole_array(impl, buf)) {
        Py_DECREF(dyn);
        Py_RETURN_NONE;
      }
      device = idx;
      v = buf->array;
    } else {
      Py_DECREF(dyn);
      Py_RETURN_NONE;
    }
    Py_INCREF(v);
    PyTuple_SET_ITEM(dyn, i, v);
    mask |= code << (2 * i);
  }
  if (device < 0) {
    Py_DECREF(dyn);
    Py_RETURN_NONE;
  }
  return Py_BuildValue("(ilN)", device, mask, dyn);
  END_HANDLE_TH_ERRORS
}

PyObject* int_tuple(c10::IntArrayRef v) {
  PyObject* t = PyTuple_New(static_cast<Py_ssize_t>(v.size()));
  if (t == nullptr) return nullptr;
  for (size_t i = 0; i < v.size(); ++i) {
    PyObject* x = PyLong_FromLongLong(v[i]);
    if (x == nullptr) {
      Py_DECREF(t);
      return nullptr;
    }
    PyTuple_SET_ITEM(t, static_cast<Py_ssize_t>(i), x);
  }
  return t;
}

// One tpu tensor of a _fast_args_ex call: 1 with *array (borrowed: its storage's array) and *geometry (new:
// None when the tensor is that whole array, else (sizes, strides, storage offset)); 0 when the call declines (a
// tensor on another device than *device, one with no array, a lazy bit, or a dtype other than its array's); -1
// with a Python error set.
int fast_tensor(PyObject* a, int* device, PyObject** array, PyObject** geometry) {
  const at::Tensor& t = THPVariable_Unpack(a);
  c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  if (impl->device_type() != kTpu) return 0;
  int idx = impl->device().index();
  if (*device >= 0 && idx != *device) return 0;
  TpuBuffer* buf = buffer_of(impl->unsafe_storage());
  resolve_placeholder(buf);
  if (buf->array == nullptr || buf->array_dtype != impl->dtype().toScalarType() || has_math_bits(impl)) return 0;
  *device = idx;
  *array = buf->array;
  if (views_whole_array(impl, buf)) {
    Py_INCREF(Py_None);
    *geometry = Py_None;
    return 1;
  }
  PyObject* sizes = int_tuple(impl->sizes());
  PyObject* strides = sizes == nullptr ? nullptr : int_tuple(impl->strides());
  if (strides == nullptr) {
    Py_XDECREF(sizes);
    return -1;
  }
  *geometry = Py_BuildValue("(NNL)", sizes, strides, static_cast<long long>(impl->storage_offset()));
  return *geometry == nullptr ? -1 : 1;
}

// _fast_args_ex(args_tuple, static_mask) -> (device_index, mask, tuple of arrays/numbers/None, extra) or None.
// The fast path of calls _fast_args declines, for ops whose leading arguments include static ones (int lists,
// flags, dims: their positions set in static_mask) or tensor lists, and for tpu tensors that view their
// storage's array in any other geometry (a transposed weight, a reshaped activation, a slice, a broadcast). Each
// tpu tensor gives its storage's array, a tensor list the tuple of those (None for a None); a static argument
// or a None gives None (the kernel's function has its value). `extra` is a hashable tuple that, with `mask`,
// keys the call:
//   (i, value) or (i, value, code) for each static argument (numbers with their mask code: 1 == True but not
//   the same argument), (i, None) for a None at another position, (i, sizes, strides, offset) for a view: the
//   function reads it from its storage's array as the slow path's reader does (torch_tpu/_storage.py view_of),
//   (i, "list", elements) for a tensor list: per element None (a None), () (a whole array) or a view's
//   (sizes, strides, offset).
// A tensor with a lazy bit, a dtype other than its array's (a reinterpreting view) or no array declines.
PyObject* py_fast_args_ex(PyObject* /*self*/, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject* call;
  long long static_mask;
  if (!PyArg_ParseTuple(args, "OL", &call, &static_mask)) return nullptr;
  if (!PyTuple_Check(call)) Py_RETURN_NONE;
  Py_ssize_t n = PyTuple_GET_SIZE(call);
  if (n > 30) Py_RETURN_NONE;
  int device = -1;
  long mask = 0;
  PyObject* dyn = PyTuple_New(n);
  if (dyn == nullptr) return nullptr;
  PyObject* extra = PyList_New(0);
  if (extra == nullptr) {
    Py_DECREF(dyn);
    return nullptr;
  }
  auto decline = [&]() -> PyObject* {
    Py_DECREF(dyn);
    Py_DECREF(extra);
    Py_RETURN_NONE;
  };
  auto fail = [&]() -> PyObject* {
    Py_DECREF(dyn);
    Py_DECREF(extra);
    return nullptr;
  };
  auto add_extra = [&](PyObject* item) -> bool {  // steals item
    if (item == nullptr) return false;
    int rc = PyList_Append(extra, item);
    Py_DECREF(item);
    return rc == 0;
  };
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* a = PyTuple_GET_ITEM(call, i);
    PyObject* v = Py_None;  // borrowed, except a tensor list's tuple (owned: set below without an INCREF)
    bool owned = false;
    long code = 0;
    if ((static_mask >> i) & 1) {
      long ncode = PyBool_Check(a) ? 1 : PyLong_CheckExact(a) ? 2 : PyFloat_CheckExact(a) ? 3 : 0;
      PyObject* value;
      if (PyList_Check(a)) {
        value = PyList_AsTuple(a);
      } else if (THPVariable_Check(a)) {
        return decline();
      } else {
        Py_INCREF(a);
        value = a;
      }
      if (value == nullptr) return fail();
      if (PyObject_Hash(value) == -1) {  // not usable as a key: the slow path takes it
        Py_DECREF(value);
        PyErr_Clear();
        return decline();
      }
      PyObject* item = ncode ? Py_BuildValue("(nNl)", i, value, ncode) : Py_BuildValue("(nN)", i, value);
      if (!add_extra(item)) return fail();
    } else if (a == Py_None) {
      if (!add_extra(Py_BuildValue("(nO)", i, Py_None))) return fail();
    } else if (PyBool_Check(a)) {
      code = 1;
      v = a;
    } else if (PyLong_CheckExact(a)) {
      code = 2;
      v = a;
    } else if (PyFloat_CheckExact(a)) {
      code = 3;
      v = a;
    } else if (THPVariable_Check(a)) {
      PyObject* geometry = nullptr;
      int rc = fast_tensor(a, &device, &v, &geometry);
      if (rc <= 0) return rc < 0 ? fail() : decline();
      if (geometry != Py_None) {
        PyObject* item = Py_BuildValue("(nOOO)", i, PyTuple_GET_ITEM(geometry, 0), PyTuple_GET_ITEM(geometry, 1),
                                       PyTuple_GET_ITEM(geometry, 2));
        Py_DECREF(geometry);
        if (!add_extra(item)) return fail();
      } else {
        Py_DECREF(geometry);
      }
    } else if (PyList_Check(a) || PyTuple_Check(a)) {  // a tensor list (static lists are in static_mask)
      PyObject* seq = PySequence_Fast(a, "");
      if (seq == nullptr) return fail();
      Py_ssize_t m = PySequence_Fast_GET_SIZE(seq);
      PyObject* arrays = PyTuple_New(m);
      PyObject* elements = arrays == nullptr ? nullptr : PyTuple_New(m);
      if (elements == nullptr) {
        Py_XDECREF(arrays);
        Py_DECREF(seq);
        return fail();
      }
      int rc = 1;
      for (Py_ssize_t j = 0; j < m && rc == 1; ++j) {
        PyObject* e = PySequence_Fast_GET_ITEM(seq, j);
        PyObject* array = Py_None;
        PyObject* geometry;
        if (e == Py_None) {
          Py_INCREF(Py_None);
          geometry = Py_None;
        } else if (!THPVariable_Check(e)) {
          rc = 0;
          break;
        } else {
          rc = fast_tensor(e, &device, &array, &geometry);
          if (rc != 1) break;
          if (geometry == Py_None) {  // a whole array: () (None stands for a None element)
            Py_DECREF(geometry);
            geometry = PyTuple_New(0);
            if (geometry == nullptr) {
              rc = -1;
              break;
            }
          }
        }
        Py_INCREF(array);
        PyTuple_SET_ITEM(arrays, j, array);
        PyTuple_SET_ITEM(elements, j, geometry);
      }
      Py_DECREF(seq);
      if (rc != 1) {
        Py_DECREF(arrays);
        Py_DECREF(elements);
        return rc < 0 ? fail() : decline();
      }
      if (!add_extra(Py_BuildValue("(nsN)", i, "list", elements))) {
        Py_DECREF(arrays);
        return fail();
      }
      v = arrays;
      owned = true;
    } else {
      return decline();
    }
    if (!owned) Py_INCREF(v);
    PyTuple_SET_ITEM(dyn, i, v);
    mask |= code << (2 * i);
  }
  if (device < 0) return decline();
  PyObject* key = PyList_AsTuple(extra);
  Py_DECREF(extra);
  if (key == nullptr) {
    Py_DECREF(dyn);
    return nullptr;
  }
  return Py_BuildValue("(ilNN)", device, mask, dyn, key);
  END_HANDLE_TH_ERRORS
}

// _set_whole(t, array) -> bool: when `t` views its whole storage (offset 0, contiguous, all bytes) and
// `array` has exactly t's shape and dtype, the storage now holds `array` (True). Else nothing changes (False).
// The in-place fast path: a broadcast or dtype mismatch falls back to the checked slow path.
// The check and swap both take: 1 when `impl` views its whole storage and `array` has exactly its shape and dtype
// (the storage now holds `array`), 0 when not (nothing changes), -1 with a Python error set.
int swap_whole(c10::TensorImpl* impl, PyObject* array) {
  if (impl->device_type() != kTpu || impl->storage_offset() != 0 || !impl->is_contiguous() ||
      has_math_bits(impl))
    return 0;
  TpuBuffer* buf = buffer_of(impl->unsafe_storage());
  c10::ScalarType st = impl->dtype().toScalarType();
  if (static_cast<size_t>(impl->numel()) * c10::elementSize(st) != buf->nbytes) return 0;
  PyObject* npdt = PyObject_GetAttrString(array, "dtype");
  if (npdt == nullptr) return -1;
  PyObject* tdt = g_dtype_map ? PyDict_GetItem(g_dtype_map, npdt) : nullptr;
  Py_DECREF(npdt);
  if (tdt == nullptr || scalar_type_of(tdt) != st) return 0;
  std::vector<int64_t> shape = shape_of(array);
  if (!impl->sizes().equals(shape)) return 0;
  set_buffer_array(buf, array, st, std::move(shape));
  return 1;
}

PyObject* py_set_whole(PyObject* /*self*/, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject *obj, *array;
  if (!PyArg_ParseTuple(args, "OO", &obj, &array)) return nullptr;
  if (!collect_if_due()) return nullptr;
  int r = swap_whole(tensor_arg(obj).unsafeGetTensorImpl(), array);
  if (r < 0) return nullptr;
  return PyBool_FromLong(r);
  END_HANDLE_TH_ERRORS
}

// ---- torch.compile programs (torch_tpu/_compile.py): one call over all of a graph's inputs or outputs ----

// _whole_arrays(tensors, donate[, placeholders]) -> (arrays tuple, donatable bitmask) or None.
// The device arrays of a compiled graph's tpu inputs when every one views its whole array (else None: the caller
// reads them one by one). Bit j of the mask is set when the input at position donate[j] may be donated: its
// storage holds the only reference to the array (DESIGN.md's storage model), counted after this tuple took its own
// (so an array reaching the program twice, or shared by another storage, is never donated). With `placeholders`
// true (a recording thread: the foreach kernels under DEFER_AND_FUSE) a storage's placeholder is taken as its
// array (its recorded shape and dtype are checked the same way); the recording executor decides donation itself,
// so pass no `donate` positions then.
PyObject* py_whole_arrays(PyObject* /*self*/, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject *seq, *donate;
  int placeholders = 0;
  if (!PyArg_ParseTuple(args, "OO|p", &seq, &donate, &placeholders)) return nullptr;
  if (!PyList_Check(seq) || !PyTuple_Check(donate)) throw py::type_error("_whole_arrays(list, tuple)");
  Py_ssize_t n = PyList_GET_SIZE(seq);
  PyObject* out = PyTuple_New(n);
  if (out == nullptr) return nullptr;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* a = PyList_GET_ITEM(seq, i);
    if (!THPVariable_Check(a)) {
      Py_DECREF(out);
      Py_RETURN_NONE;
    }
    c10::TensorImpl* impl = THPVariable_Unpack(a).unsafeGetTensorImpl();
    if (impl->device_type() != kTpu || impl->storage_offset() != 0) {
      Py_DECREF(out);
      Py_RETURN_NONE;
    }
    TpuBuffer* buf = buffer_of(impl->unsafe_storage());
    resolve_placeholder(buf);
    PyObject* arr = buf->array;
    if (!views_whole_array(impl, buf) ||
        (!placeholders && reinterpret_cast<PyObject*>(Py_TYPE(arr)) != g_array_type)) {
      Py_DECREF(out);
      Py_RETURN_NONE;
    }
    Py_INCREF(arr);
    PyTuple_SET_ITEM(out, i, arr);
  }
  unsigned long long mask = 0;
  Py_ssize_t nd = PyTuple_GET_SIZE(donate);
  for (Py_ssize_t j = 0; j < nd && j < 64; ++j) {
    Py_ssize_t i = PyLong_AsSsize_t(PyTuple_GET_ITEM(donate, j));
    if (i < 0 || i >= n) continue;
    // References: the storage's and this tuple's. Anything more (another storage sharing the array, the same
    // array as a second input, a pending fused graph, a Python variable) keeps it.
    if (Py_REFCNT(PyTuple_GET_ITEM(out, i)) == 2) mask |= 1ULL << j;
  }
  return Py_BuildValue("(NK)", out, mask);
  END_HANDLE_TH_ERRORS
}

// _write_wholes(tensors, arrays) -> tuple of the positions not written. Each tensor viewing its whole storage
// with an array of exactly its shape and dtype gets that array swapped in (a compiled graph's mutated inputs);
// the others are left to the caller's general write (through a view, with a cast).
PyObject* py_write_wholes(PyObject* /*self*/, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject *seq, *arrays;
  if (!PyArg_ParseTuple(args, "OO", &seq, &arrays)) return nullptr;
  if (!collect_if_due()) return nullptr;
  PyObject* fs = PySequence_Fast(seq, "_write_wholes: expected a sequence of tensors");
  if (fs == nullptr) return nullptr;
  PyObject* fa = PySequence_Fast(arrays, "_write_wholes: expected a sequence of arrays");
  if (fa == nullptr) {
    Py_DECREF(fs);
    return nullptr;
  }
  Py_ssize_t n = std::min(PySequence_Fast_GET_SIZE(fs), PySequence_Fast_GET_SIZE(fa));
  PyObject* left = PyList_New(0);
  auto fail = [&]() {
    Py_DECREF(fs);
    Py_DECREF(fa);
    Py_XDECREF(left);
    return nullptr;
  };
  if (left == nullptr) return fail();
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* obj = PySequence_Fast_GET_ITEM(fs, i);
    PyObject* array = PySequence_Fast_GET_ITEM(fa, i);
    bool done = false;
    if (THPVariable_Check(obj)) {
      int r = swap_whole(THPVariable_Unpack(obj).unsafeGetTensorImpl(), array);
      if (r < 0) return fail();
      done = r == 1;
    }
    if (!done) {
      PyObject* idx = PyLong_FromSsize_t(i);
      if (idx == nullptr || PyList_Append(left, idx) < 0) {
        Py_XDECREF(idx);
        return fail();
      }
      Py_DECREF(idx);
    }
  }
  Py_DECREF(fs);
  Py_DECREF(fa);
  PyObject* r = PyList_AsTuple(left);
  Py_DECREF(left);
  return r;
  END_HANDLE_TH_ERRORS
}

// _wrap_all(arrays, device_index) -> tuple of new contiguous tpu tensors, one owning each array (dtypes looked up
// from the arrays' own, as _wrap with dtype None).
PyObject* py_wrap_all(PyObject* /*self*/, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject* arrays;
  int device;
  if (!PyArg_ParseTuple(args, "Oi", &arrays, &device)) return nullptr;
  if (!collect_if_due()) return nullptr;
  TORCH_CHECK(g_dtype_map != nullptr, "torch_tpu: internal error: dtype map not set");
  PyObject* fa = PySequence_Fast(arrays, "_wrap_all: expected a sequence of arrays");
  if (fa == nullptr) return nullptr;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(fa);
  PyObject* out = PyTuple_New(n);
  if (out == nullptr) {
    Py_DECREF(fa);
    return nullptr;
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* array = PySequence_Fast_GET_ITEM(fa, i);
    PyObject* npdt = PyObject_GetAttrString(array, "dtype");
    if (npdt == nullptr) {
      Py_DECREF(fa);
      Py_DECREF(out);
      return nullptr;
    }
    PyObject* dtype = PyDict_GetItem(g_dtype_map, npdt);  // borrowed
    Py_DECREF(npdt);
    if (dtype == nullptr) {
      Py_DECREF(fa);
      Py_DECREF(out);
      PyErr_SetString(PyExc_TypeError, "torch_tpu: an XLA result has a dtype with no torch equivalent");
      return nullptr;
    }
    c10::ScalarType st = scalar_type_of(dtype);
    std::vector<int64_t> shape = shape_of(array);
    int64_t numel = 1;
    for (int64_t s : shape) numel *= s;
    size_t nbytes = static_cast<size_t>(numel) * c10::elementSize(st);
    c10::Storage storage;
    try {  // (out of memory: the allocator's limit)
      storage = make_storage(array, st, shape, nbytes, static_cast<c10::DeviceIndex>(device));
    } catch (...) {
      Py_DECREF(fa);
      Py_DECREF(out);
      throw;
    }
    auto t = at::detail::make_tensor<c10::TensorImpl>(std::move(storage),
                                                      c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                                      c10::scalarTypeToTypeMeta(st));
    t.unsafeGetTensorImpl()->set_sizes_contiguous(shape);
    PyTuple_SET_ITEM(out, i, THPVariable_Wrap(std::move(t)));
  }
  Py_DECREF(fa);
  return out;
  END_HANDLE_TH_ERRORS
}

PyObject* py_set_array_type(PyObject* /*self*/, PyObject* type) {
  Py_INCREF(type);
  Py_XDECREF(g_array_type);
  g_array_type = type;
  Py_RETURN_NONE;
}

PyObject* py_set_resolver(PyObject* /*self*/, PyObject* fn) {
  Py_INCREF(fn);
  Py_XDECREF(g_resolver);
  g_resolver = fn;
  Py_RETURN_NONE;
}

PyObject* py_set_collector(PyObject* /*self*/, PyObject* fn) {
  Py_INCREF(fn);
  Py_XDECREF(g_collector);
  g_collector = fn;
  Py_RETURN_NONE;
}

PyObject* py_set_collect_due(PyObject* /*self*/, PyObject* /*unused*/) {
  g_collect_due.store(true);
  Py_RETURN_NONE;
}

PyObject* py_set_dtype_map(PyObject* /*self*/, PyObject* map) {
  Py_INCREF(map);
  Py_XDECREF(g_dtype_map);
  g_dtype_map = map;
  Py_RETURN_NONE;
}

// _unseen(arrays, seen) -> the elements of list `arrays` whose id() is not a key of dict `seen`. An event record
// (torch_tpu/_streams.py) asks this of every live array: the Python loop cost about 80 ns per array (0.16 ms per
// record with 2,000 live arrays, a model's parameters and optimizer state).
PyObject* py_unseen(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2 || !PyList_Check(args[0]) || !PyDict_Check(args[1])) {
    PyErr_SetString(PyExc_TypeError, "torch_tpu: internal error: _unseen(list, dict)");
    return nullptr;
  }
  PyObject* out = PyList_New(0);
  if (out == nullptr) return nullptr;
  const Py_ssize_t n = PyList_GET_SIZE(args[0]);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = PyList_GET_ITEM(args[0], i);
    PyObject* key = PyLong_FromVoidPtr(item);  // id(item)
    if (key == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    int seen = PyDict_Contains(args[1], key);
    Py_DECREF(key);
    if (seen < 0 || (seen == 0 && PyList_Append(out, item) < 0)) {
      Py_DECREF(out);
      return nullptr;
    }
  }
  return out;
}

PyMethodDef kFastMethods[] = {
    {"_fast_args", py_fast_args, METH_O, "(device, mask, arrays) when every argument takes the fast path"},
    {"_fast_args_ex", py_fast_args_ex, METH_VARARGS, "(device, mask, arrays, key) for static and relaid arguments"},
    {"_set_dtype_map", py_set_dtype_map, METH_O, "{numpy dtype: torch.dtype} used by _wrap"},
    {"_set_collector", py_set_collector, METH_O, "the compiled-program collector (torch_tpu._programs.collect)"},
    {"_set_collect_due", py_set_collect_due, METH_NOARGS, "run the collector at the next safe point"},
    {"_set_array_type", py_set_array_type, METH_O, "the concrete array type (others are placeholders)"},
    {"_set_resolver", py_set_resolver, METH_O, "placeholder -> array or None (see above)"},
    {"_set_whole", py_set_whole, METH_VARARGS, "swap in an array of exactly the tensor's shape and dtype"},
    {"_array", py_array, METH_O, "the storage's array if the tensor views it whole, else None"},
    {"_wrap", py_wrap, METH_VARARGS, "wrap a device array as a new tpu tensor"},
    {"_set_array", py_set_array, METH_VARARGS, "replace a storage's device array"},
    {"_storage_array", py_storage_array, METH_O, "(array or None, nbytes, device) of a storage"},
    {"_is_tpu_buffer", py_is_tpu_buffer, METH_O, "whether a storage is a torch_tpu buffer"},
    {"_whole_arrays", py_whole_arrays, METH_VARARGS, "a compiled graph's input arrays and which may be donated"},
    {"_write_wholes", py_write_wholes, METH_VARARGS, "swap in a compiled graph's mutated inputs' arrays"},
    {"_wrap_all", py_wrap_all, METH_VARARGS, "wrap a compiled graph's output arrays as new tpu tensors"},
    {"_unseen", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_unseen)), METH_FASTCALL,
     "the elements of a list whose id() is not a key of a dict"},
    {nullptr, nullptr, 0, nullptr}};

TpuGeneratorImpl* generator_arg(py::handle gen) {
  TORCH_CHECK(THPGenerator_Check(gen.ptr()), "torch_tpu: expected a torch.Generator");
  at::Generator& g = reinterpret_cast<THPGenerator*>(gen.ptr())->cdata;
  TORCH_CHECK(g.device().type() == kTpu, "torch_tpu: expected a tpu generator, got one for ", g.device());
  return g.get<TpuGeneratorImpl>();
}

}  // namespace

void dispatch_resolve_pending(TpuBuffer* buf) { resolve_placeholder(buf); }
bool dispatch_is_array(PyObject* obj) { return reinterpret_cast<PyObject*>(Py_TYPE(obj)) == g_array_type; }
bool dispatch_collect_if_due() { return collect_if_due(); }
PyObject* dispatch_dtype_map() { return g_dtype_map; }

}  // namespace torch_tpu

PYBIND11_MODULE(_C, m) {
  using namespace torch_tpu;
  m.doc() = "torch_tpu C++ runtime: allocator, device guard, hooks, generator, metadata kernels";
  for (PyMethodDef* table : {kFastMethods, mode_methods(), dispatch_methods()}) {
    for (PyMethodDef* d = table; d->ml_name != nullptr; ++d) {
      PyObject* f = PyCFunction_NewEx(d, nullptr, m.ptr());
      if (f == nullptr) throw py::error_already_set();
      m.add_object(d->ml_name, py::reinterpret_steal<py::object>(f));
    }
  }
  m.def("_set_callbacks", [](py::object start_runtime, py::object resize_array, py::object synchronize) {
    Callbacks& cb = callbacks();
    Py_XDECREF(cb.start_runtime);
    Py_XDECREF(cb.resize_array);
    Py_XDECREF(cb.synchronize);
    cb.start_runtime = start_runtime.release().ptr();
    cb.resize_array = resize_array.release().ptr();
    cb.synchronize = synchronize.release().ptr();
  });
  m.def("_device_count", []() { return static_cast<int>(device_count()); });
  m.def("_runtime_started", &runtime_started);
  m.def("_mark_bad_fork", [](std::string message) { mark_bad_fork(std::move(message)); });
  m.def("_in_bad_fork", []() { return g_in_bad_fork; });
  m.def("_current_device", []() { return static_cast<int>(current_device()); });
  m.def("_set_device", [](int index) { set_current_device(static_cast<c10::DeviceIndex>(index)); });
  m.def("_check_device", [](int index) { check_device_index(static_cast<c10::DeviceIndex>(index)); });
  m.def("_default_generator", [](int index) {
    const at::Generator& g = default_generator(static_cast<c10::DeviceIndex>(index));
    return py::reinterpret_steal<py::object>(THPGenerator_initDefaultGenerator(g));  // new reference; cached by torch_tpu
  });
  m.def("_philox_step", [](py::handle gen, uint64_t increment) {
    check_not_forked();  // random kernels build their key from it before touching a storage
    return generator_arg(gen)->philox_step(increment);
  });
  m.def("_live_buffers", &live_buffers);
  add_memory_methods(m);
  add_attention_methods(m);
  add_cast_methods(m);
  m.def("_set_fallback_mode", [](int mode) { set_fallback_mode(static_cast<FallbackMode>(mode)); });
  m.def("_fallback_mode", []() { return static_cast<int>(fallback_mode()); });
  m.def("_fallback_counts", &fallback_counts);
  m.def("_reset_fallback_counts", &reset_fallback_counts);
}
