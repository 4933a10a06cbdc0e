// The compiled half of writeback-pybind-runtime: Program and Method over the
// ExecuTorch runtime library that the executorch wheel ships (libexecutorch.so),
// and Python delegates registered as ExecuTorch backends.
//
// No libtorch: tensors cross the boundary through DLPack. Inputs are read from
// `__dlpack__()` capsules (kept alive until replaced); outputs and delegate
// arguments are handed to `torch.utils.dlpack.from_dlpack` as capsules that
// alias the runtime's memory and hold a reference to its owner.
//
// The Python layer (_runtime.py) owns policy that needs the program file: it
// reads from the .pte which output is which input and which inputs the method
// writes (_pte.py) and passes that in. It reads the program's own copy of the
// plan (NativeProgram's buffer), so the plan is read from the file once.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <executorch/extension/data_loader/buffer_data_loader.h>
#include <executorch/extension/memory_allocator/malloc_memory_allocator.h>
#include <executorch/runtime/backend/interface.h>
#include <executorch/runtime/core/hierarchical_allocator.h>
#include <executorch/runtime/executor/memory_manager.h>
#include <executorch/runtime/executor/method.h>
#include <executorch/runtime/executor/method_meta.h>
#include <executorch/runtime/executor/program.h>
#include <executorch/runtime/platform/platform.h>
#include <executorch/runtime/platform/runtime.h>

#include "_program_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace py = pybind11;
namespace etr = executorch::runtime;
using executorch::aten::ScalarType;
using executorch::aten::Tensor;
using executorch::aten::TensorImpl;
using executorch::extension::BufferDataLoader;
using executorch::extension::MallocMemoryAllocator;

// ---------------------------------------------------------------------------
// DLPack (v0.8 ABI, the legacy "dltensor" capsule every array library speaks).
extern "C" {
struct DLDevice {
  int32_t device_type;
  int32_t device_id;
};
struct DLDataType {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
};
struct DLTensor {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;
  uint64_t byte_offset;
};
struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor* self);
};
}

namespace {

constexpr int32_t kDLCPU = 1;
enum DLCode : uint8_t {
  kDLInt = 0,
  kDLUInt = 1,
  kDLFloat = 2,
  kDLBfloat = 4,
  kDLComplex = 5,
  kDLBool = 6,
};

struct DtypeRow {
  ScalarType type;
  DLDataType dl;
  const char* name;
};

// Dispatch table between ExecuTorch scalar types and DLPack codes.
const DtypeRow kDtypes[] = {
    {ScalarType::Byte, {kDLUInt, 8, 1}, "uint8"},
    {ScalarType::Char, {kDLInt, 8, 1}, "int8"},
    {ScalarType::Short, {kDLInt, 16, 1}, "int16"},
    {ScalarType::Int, {kDLInt, 32, 1}, "int32"},
    {ScalarType::Long, {kDLInt, 64, 1}, "int64"},
    {ScalarType::Half, {kDLFloat, 16, 1}, "float16"},
    {ScalarType::Float, {kDLFloat, 32, 1}, "float32"},
    {ScalarType::Double, {kDLFloat, 64, 1}, "float64"},
    {ScalarType::ComplexFloat, {kDLComplex, 64, 1}, "complex64"},
    {ScalarType::ComplexDouble, {kDLComplex, 128, 1}, "complex128"},
    {ScalarType::Bool, {kDLBool, 8, 1}, "bool"},
    {ScalarType::BFloat16, {kDLBfloat, 16, 1}, "bfloat16"},
    {ScalarType::UInt16, {kDLUInt, 16, 1}, "uint16"},
    {ScalarType::UInt32, {kDLUInt, 32, 1}, "uint32"},
    {ScalarType::UInt64, {kDLUInt, 64, 1}, "uint64"},
};

const DtypeRow* row_of(ScalarType t) {
  for (const auto& row : kDtypes) {
    if (row.type == t) {
      return &row;
    }
  }
  return nullptr;
}

const DtypeRow* row_of(DLDataType dl) {
  // torch exports bool as kDLBool; older producers use uint8 for it, which
  // maps to Byte here and is then rejected by the dtype check, as it should.
  for (const auto& row : kDtypes) {
    if (row.dl.code == dl.code && row.dl.bits == dl.bits && dl.lanes == 1) {
      return &row;
    }
  }
  return nullptr;
}

std::string dtype_name(ScalarType t) {
  const DtypeRow* row = row_of(t);
  return row ? row->name : "scalar type " + std::to_string(static_cast<int>(t));
}

size_t element_size(ScalarType t) {
  const DtypeRow* row = row_of(t);
  return row ? row->dl.bits / 8 : 0;
}

const char* error_name(etr::Error e) {
  switch (e) {
    case etr::Error::Ok: return "Ok";
    case etr::Error::Internal: return "Internal";
    case etr::Error::InvalidState: return "InvalidState";
    case etr::Error::EndOfMethod: return "EndOfMethod";
    case etr::Error::AlreadyLoaded: return "AlreadyLoaded";
    case etr::Error::NotSupported: return "NotSupported";
    case etr::Error::NotImplemented: return "NotImplemented";
    case etr::Error::InvalidArgument: return "InvalidArgument";
    case etr::Error::InvalidType: return "InvalidType";
    case etr::Error::OperatorMissing: return "OperatorMissing";
    case etr::Error::RegistrationExceedingMaxKernels: return "RegistrationExceedingMaxKernels";
    case etr::Error::RegistrationAlreadyRegistered: return "RegistrationAlreadyRegistered";
    case etr::Error::NotFound: return "NotFound";
    case etr::Error::MemoryAllocationFailed: return "MemoryAllocationFailed";
    case etr::Error::AccessFailed: return "AccessFailed";
    case etr::Error::InvalidProgram: return "InvalidProgram";
    case etr::Error::InvalidExternalData: return "InvalidExternalData";
    case etr::Error::OutOfResources: return "OutOfResources";
    case etr::Error::DelegateInvalidCompatibility: return "DelegateInvalidCompatibility";
    case etr::Error::DelegateMemoryAllocationFailed: return "DelegateMemoryAllocationFailed";
    case etr::Error::DelegateInvalidHandle: return "DelegateInvalidHandle";
    default: return "Unknown";
  }
}

std::string describe(etr::Error e) {
  std::ostringstream out;
  out << "ExecuTorch error " << error_name(e) << " (0x" << std::hex
      << static_cast<unsigned>(e) << ")";
  return out.str();
}

std::string tag_name(etr::Tag tag) {
  switch (tag) {
    case etr::Tag::None: return "None";
    case etr::Tag::Tensor: return "Tensor";
    case etr::Tag::String: return "String";
    case etr::Tag::Double: return "Double";
    case etr::Tag::Int: return "Int";
    case etr::Tag::Bool: return "Bool";
    default: return "list or other value";
  }
}

template <typename T>
std::string join(const T& values) {
  std::ostringstream out;
  out << "[";
  bool first = true;
  for (auto v : values) {
    out << (first ? "" : ", ") << static_cast<int64_t>(v);
    first = false;
  }
  out << "]";
  return out.str();
}

// Exceptions the Python layer re-exports (created in the module init).
PyObject* g_delegate_error = nullptr;
PyObject* g_program_error = nullptr;

[[noreturn]] void raise_value_error(const std::string& message) {
  throw py::value_error(message);
}

// ---------------------------------------------------------------------------
// Memory blocks. Everything the runtime writes into and that Python may view
// lives in a refcounted block, so a tensor handed out uncloned keeps it alive.

struct Block {
  void* data = nullptr;
  size_t nbytes = 0;
  size_t padded = 0;
  bool mapped = false;  // straight from the kernel (munmap), else aligned_alloc (free)
  // `copied`: the caller fills all n bytes at once (a cloned output, every
  // call): heap memory, reused call after call, not zeroed first.
  explicit Block(size_t n, bool copied = false)
      : nbytes(n), padded(((std::max<size_t>(n, 1) + 63) / 64) * 64) {
    // Otherwise zeroed, as the stock bindings' arenas are: a mutated buffer that
    // exir serialized without its initial value (only shape and dtype) starts at
    // zeros, which is what programs read before their first write. A large block
    // is anonymous memory, zero already: its pages are touched when first
    // written, not all of them at load.
    if (!copied && padded >= kMappedBlockBytes) {
      data = ::mmap(nullptr, padded, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (data == MAP_FAILED) {
        data = nullptr;
        throw std::bad_alloc();
      }
      mapped = true;
      return;
    }
    // 64-byte alignment: ExecuTorch kernels and delegates may vectorize.
    data = std::aligned_alloc(64, padded);
    if (data == nullptr) {
      throw std::bad_alloc();
    }
    if (!copied) {
      std::memset(data, 0, padded);
    }
  }
  ~Block() {
    if (mapped) {
      ::munmap(data, padded);
    } else {
      std::free(data);
    }
  }
  Block(const Block&) = delete;
  Block& operator=(const Block&) = delete;

 private:
  static constexpr size_t kMappedBlockBytes = size_t{1} << 20;
};

// Holds a Python object from C++ code that may drop it without the GIL.
struct PyRef {
  PyObject* object;
  explicit PyRef(py::handle h) : object(h.inc_ref().ptr()) {}
  ~PyRef() {
    if (Py_IsInitialized() && !_Py_IsFinalizing()) {
      PyGILState_STATE state = PyGILState_Ensure();
      Py_DECREF(object);
      PyGILState_Release(state);
    }
  }
};

// An exported tensor: the DLPack record plus whatever keeps its memory alive.
struct Exported {
  DLManagedTensor managed{};
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;
  std::shared_ptr<void> keep;
};

void delete_exported(DLManagedTensor* managed) {
  delete static_cast<Exported*>(managed->manager_ctx);
}

void capsule_destructor(PyObject* capsule) {
  // A consumer renames the capsule to "used_dltensor" and owns it from then on.
  if (PyCapsule_IsValid(capsule, "dltensor")) {
    auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, "dltensor"));
    managed->deleter(managed);
  }
}

// torch's DLPack entry points. The private C functions skip the Python-level
// wrappers (several microseconds per tensor, most of a small model's call);
// the public ones are the fallback if a torch release drops them. Leaked on
// purpose: destroying a py::object after interpreter teardown crashes.
struct TorchDlpack {
  py::object from_dlpack;
  py::object to_dlpack;  // None when unavailable: then `__dlpack__()` is used
  py::object tensor_type;
  py::object is_grad_enabled;
};

const TorchDlpack& torch_dlpack() {
  static TorchDlpack* fns = [] {
    py::module_ torch = py::module_::import("torch");
    py::object c = torch.attr("_C");
    auto* out = new TorchDlpack();
    if (py::hasattr(c, "_from_dlpack")) {
      out->from_dlpack = c.attr("_from_dlpack");
    } else {
      out->from_dlpack = py::module_::import("torch.utils.dlpack").attr("from_dlpack");
    }
    out->to_dlpack = py::none();
    if (py::hasattr(c, "_to_dlpack")) {
      out->to_dlpack = c.attr("_to_dlpack");
    }
    out->tensor_type = torch.attr("Tensor");
    out->is_grad_enabled = torch.attr("is_grad_enabled");
    return out;
  }();
  return *fns;
}

const py::object& from_dlpack() { return torch_dlpack().from_dlpack; }

// A torch tensor viewing `data` (contiguous, `sizes`), keeping `keep` alive.
template <typename Sizes>
py::object to_torch(void* data, ScalarType type, const Sizes& sizes, std::shared_ptr<void> keep) {
  const DtypeRow* row = row_of(type);
  if (row == nullptr) {
    throw py::type_error("cannot hand a tensor of " + dtype_name(type) + " to torch");
  }
  auto* exported = new Exported();
  exported->keep = std::move(keep);
  exported->shape.assign(sizes.begin(), sizes.end());
  exported->strides.resize(exported->shape.size());
  int64_t stride = 1;
  for (size_t d = exported->shape.size(); d-- > 0;) {
    exported->strides[d] = stride;
    stride *= std::max<int64_t>(exported->shape[d], 1);
  }
  DLTensor& t = exported->managed.dl_tensor;
  t.data = data;
  t.device = {kDLCPU, 0};
  t.ndim = static_cast<int32_t>(exported->shape.size());
  t.dtype = row->dl;
  t.shape = exported->shape.data();
  t.strides = exported->strides.data();
  t.byte_offset = 0;
  exported->managed.manager_ctx = exported;
  exported->managed.deleter = delete_exported;
  PyObject* capsule = PyCapsule_New(&exported->managed, "dltensor", capsule_destructor);
  if (capsule == nullptr) {
    delete exported;
    throw py::error_already_set();
  }
  return from_dlpack()(py::reinterpret_steal<py::object>(capsule));
}

py::object copy_to_torch(const void* data, size_t nbytes, ScalarType type, etr::ArrayRef<int32_t> sizes) {
  auto block = std::make_shared<Block>(nbytes, /*copied=*/true);
  std::memcpy(block->data, data, nbytes);
  void* ptr = block->data;
  return to_torch(ptr, type, sizes, std::move(block));
}

// ---------------------------------------------------------------------------
// Importing caller tensors.

struct Imported {
  py::object owner;    // what the caller passed (or its contiguous copy)
  py::object capsule;  // keeps the DLPack export (and so the tensor) alive
  void* data = nullptr;
  ScalarType type = ScalarType::Undefined;
  const DtypeRow* row = nullptr;
  std::vector<int32_t> sizes;
  std::vector<int64_t> strides;
  size_t nbytes = 0;
  bool contiguous = true;
  bool cpu = true;
  int32_t device_type = kDLCPU;
  // torch tensors only (other DLPack producers cannot free memory they export).
  bool torch_tensor = false;
  bool requires_grad = false;
  size_t storage_nbytes = 0;  // what the tensor's storage holds now
  size_t storage_needed = 0;  // its storage offset plus the bytes its shape spans
};

bool has_dlpack(py::handle obj) { return py::hasattr(obj, "__dlpack__"); }

// ExecuTorch's portable tensors hold sizes and strides as int32_t.
constexpr int64_t kMaxIndex = std::numeric_limits<int32_t>::max();

// The contiguous strides of `sizes` (int64, each capped at kMaxIndex + 1 so that
// no product overflows: every size is at most kMaxIndex once checked).
std::vector<int64_t> contiguous_strides(const int64_t* sizes, size_t ndim) {
  std::vector<int64_t> strides(ndim);
  int64_t stride = 1;
  for (size_t d = ndim; d-- > 0;) {
    strides[d] = stride;
    stride = std::min<int64_t>(stride * std::max<int64_t>(sizes[d], 1), kMaxIndex + 1);
  }
  return strides;
}

// Raises ValueError when the runtime cannot hold `t`'s shape: a size past
// int32_t (it would be narrowed into another shape), or, for a tensor with
// elements, a contiguous stride past int32_t (the kernels would address other
// memory). A tensor without elements addresses nothing, so its strides may be
// large: the runtime gets them capped (see set_inputs).
void check_index_width(const DLTensor& t, const std::string& what) {
  bool has_elements = true;
  for (int32_t d = 0; d < t.ndim; ++d) {
    if (t.shape[d] < 0 || t.shape[d] > kMaxIndex) {
      raise_value_error(what + ": dimension " + std::to_string(d) + " has size " +
                        std::to_string(t.shape[d]) + "; the ExecuTorch runtime holds sizes from 0 to " +
                        std::to_string(kMaxIndex) + " (32-bit); pass a smaller tensor or split it");
    }
    has_elements = has_elements && t.shape[d] != 0;
  }
  if (!has_elements) {
    return;
  }
  const std::vector<int64_t> strides = contiguous_strides(t.shape, static_cast<size_t>(t.ndim));
  for (int32_t d = 0; d < t.ndim; ++d) {
    if (strides[d] > kMaxIndex) {
      std::vector<int64_t> exact(t.shape, t.shape + t.ndim);
      int64_t stride = 1;  // the exact stride, for the message (fits: below 2**62 here)
      for (int32_t k = t.ndim; k-- > d + 1;) {
        stride = std::min<int64_t>(stride * exact[k], int64_t{1} << 62);
      }
      raise_value_error(what + ": a contiguous tensor of shape " + join(exact) + " has stride " +
                        std::to_string(stride) + " at dimension " + std::to_string(d) +
                        "; the ExecuTorch runtime indexes with 32-bit strides (up to " +
                        std::to_string(kMaxIndex) + "); pass a smaller tensor or split it");
    }
  }
}

// Reads `obj` through DLPack. `what` names it in errors ("input 2").
Imported import_tensor(py::handle obj, const std::string& what) {
  if (!has_dlpack(obj)) {
    throw py::type_error(what + " must be a tensor (anything with __dlpack__), got " +
                         std::string(py::str(py::type::handle_of(obj).attr("__name__"))));
  }
  Imported in;
  in.owner = py::reinterpret_borrow<py::object>(obj);
  py::object source = in.owner;
  const TorchDlpack& torch = torch_dlpack();
  in.torch_tensor = py::isinstance(source, torch.tensor_type);
  // torch refuses to export a tensor that requires grad; its detached alias
  // shares the same storage, so writes still land in the caller's tensor.
  if (py::hasattr(source, "requires_grad") && py::bool_(source.attr("requires_grad"))) {
    in.requires_grad = true;
    source = source.attr("detach")();
  }
  try {
    if (!torch.to_dlpack.is_none() && in.torch_tensor) {
      in.capsule = torch.to_dlpack(source);
    } else {
      in.capsule = source.attr("__dlpack__")();
    }
  } catch (py::error_already_set& e) {
    // torch cannot export every device (meta, for one); name the device
    // rather than surfacing the exporter's message.
    if (py::hasattr(source, "device")) {
      std::string device = py::str(source.attr("device"));
      if (device.rfind("cpu", 0) != 0) {
        raise_value_error(what + ": expected a CPU tensor, got a tensor on device " + device);
      }
    }
    throw;
  }
  auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(in.capsule.ptr(), "dltensor"));
  if (managed == nullptr) {
    throw py::error_already_set();
  }
  const DLTensor& t = managed->dl_tensor;
  in.device_type = t.device.device_type;
  in.cpu = t.device.device_type == kDLCPU;
  in.row = row_of(t.dtype);
  in.type = in.row ? in.row->type : ScalarType::Undefined;
  in.data = static_cast<char*>(t.data) + t.byte_offset;
  in.sizes.resize(t.ndim);
  in.strides.resize(t.ndim);
  check_index_width(t, what);
  size_t numel = 1;
  for (int32_t d = 0; d < t.ndim; ++d) {
    in.sizes[d] = static_cast<int32_t>(t.shape[d]);  // in range: check_index_width
    numel *= static_cast<size_t>(t.shape[d]);
  }
  int64_t expected = 1;
  for (int32_t d = t.ndim; d-- > 0;) {
    in.strides[d] = t.strides ? t.strides[d] : expected;
    // Strides of size-1 dims carry no layout information.
    if (t.shape[d] != 1 && in.strides[d] != expected) {
      in.contiguous = false;
    }
    expected *= t.shape[d];
  }
  const size_t itemsize = in.row ? in.row->dl.bits / 8 : 0;
  in.nbytes = numel * itemsize;
  if (in.torch_tensor) {
    // A tensor keeps its shape when its storage is freed or shrunk
    // (untyped_storage().resize_), so what the shape spans is checked against
    // what the storage holds; DLPack carries no storage size.
    in.storage_nbytes = source.attr("untyped_storage")().attr("nbytes")().cast<size_t>();
    if (numel > 0) {  // an empty tensor reads and writes nothing
      size_t last = source.attr("storage_offset")().cast<size_t>();
      for (int32_t d = 0; d < t.ndim; ++d) {
        last += static_cast<size_t>(t.shape[d] - 1) * static_cast<size_t>(in.strides[d]);
      }
      in.storage_needed = (last + 1) * itemsize;
    }
  }
  return in;
}

// Raises ValueError when `in`'s storage no longer holds what its shape spans:
// reading or writing it would touch freed memory. `remedy` says what to do.
void check_storage(const Imported& in, const std::string& what, const std::string& remedy) {
  if (!in.torch_tensor || in.storage_nbytes >= in.storage_needed) {
    return;
  }
  raise_value_error(what + ": the tensor (shape " + join(in.sizes) + ", " +
                    (in.row ? dtype_name(in.type) : std::string("?")) + ") needs " +
                    std::to_string(in.storage_needed) + " bytes of storage but its storage holds " +
                    std::to_string(in.storage_nbytes) +
                    " (freed or shrunk, e.g. by untyped_storage().resize_()); nothing was run or "
                    "written; " + remedy);
}

// Raises ValueError when the method would write a tensor that requires grad
// while grad mode is on: eager PyTorch refuses an in-place op on a leaf that
// requires grad and an out= argument that requires grad, and this runtime
// records no autograd history, so a write into a non-leaf would leave its
// gradient silently wrong. Under torch.no_grad() eager allows both, and so
// does this runtime.
void check_not_grad_write(const Imported& in, const std::string& what, const std::string& how) {
  if (!in.requires_grad || !py::bool_(torch_dlpack().is_grad_enabled())) {
    return;
  }
  bool leaf = py::bool_(in.owner.attr("is_leaf"));
  raise_value_error(what + " " + how + ", but the tensor " +
                    (leaf ? "is a leaf that requires grad (eager PyTorch refuses it: \"a leaf "
                            "Variable that requires grad is being used in an in-place operation\")"
                          : "requires grad, and this runtime records no autograd history, so its "
                            "gradient would be silently wrong") +
                    "; nothing was run or written; pass tensor.detach() (it shares the memory), or "
                    "call under torch.no_grad() as eager PyTorch requires");
}

bool overlaps(const void* a, size_t an, const void* b, size_t bn) {
  if (a == nullptr || b == nullptr || an == 0 || bn == 0) {
    return false;
  }
  auto a0 = reinterpret_cast<uintptr_t>(a), b0 = reinterpret_cast<uintptr_t>(b);
  return a0 < b0 + bn && b0 < a0 + an;
}

// ---------------------------------------------------------------------------
// Python delegates.

// Set by a delegate trampoline when Python raised; read by whoever called into
// the runtime on this thread. A raw reference: thread_local destructors would
// run without the GIL.
thread_local PyObject* t_pending_error = nullptr;
thread_local std::string* t_pending_backend = nullptr;

void set_pending(py::error_already_set& e, const std::string& backend) {
  Py_XDECREF(t_pending_error);
  t_pending_error = e.value().inc_ref().ptr();
  if (t_pending_backend == nullptr) {
    t_pending_backend = new std::string();
  }
  *t_pending_backend = backend;
}

void clear_pending() {
  Py_XDECREF(t_pending_error);
  t_pending_error = nullptr;
}

// Raises for a failed runtime call: the delegate's Python error if one is
// pending (chained as the cause), otherwise `fallback` with the message.
[[noreturn]] void raise_failure(PyObject* fallback, const std::string& message, etr::Error err) {
  std::string full = message + ": " + describe(err);
  if (t_pending_error != nullptr) {
    py::object cause = py::reinterpret_steal<py::object>(t_pending_error);
    t_pending_error = nullptr;
    std::string backend = t_pending_backend ? *t_pending_backend : "?";
    std::string kind = py::str(py::type::handle_of(cause).attr("__name__"));
    std::string text = py::str(cause);
    PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(cause.ptr())), cause.ptr());
    py::raise_from(g_delegate_error,
                   (message + ": Python delegate '" + backend + "' raised " + kind + ": " + text).c_str());
    throw py::error_already_set();
  }
  PyErr_SetString(fallback, full.c_str());
  throw py::error_already_set();
}

struct DelegateHandleBox {
  py::object delegate;
  py::object handle;
  std::string backend;
};

py::object evalue_to_py(const etr::EValue& value, bool views, const std::string& what);

struct ProgramState;

// The program whose method is loading on this thread (set by NativeMethod while
// load_method runs): a blob handed to a delegate as a view keeps it alive.
thread_local std::shared_ptr<ProgramState> t_loading_program;

// A delegate's processed blob handed to Python uncopied (`processed_as_memoryview`):
// the runtime's buffer, moved out of ExecuTorch's hands, freed when the last
// Python object viewing it goes (a numpy array over it included), and the program
// it came from (the file loader that frees a mapping, the bytes of a program loaded
// from bytes) kept alive until then.
struct DelegateBlob {
  etr::FreeableBuffer buffer;
  std::shared_ptr<ProgramState> program;
  DelegateBlob(etr::FreeableBuffer&& b, std::shared_ptr<ProgramState> p)
      : buffer(std::move(b)), program(std::move(p)) {}
  ~DelegateBlob() { buffer.Free(); }  // before `program` goes
  DelegateBlob(const DelegateBlob&) = delete;
  DelegateBlob& operator=(const DelegateBlob&) = delete;
};

class PyBackend final : public etr::BackendInterface {
 public:
  explicit PyBackend(std::string id) : id_(std::move(id)) {}

  const std::string& id() const { return id_; }
  void set_delegate(py::object delegate) { delegate_ = std::move(delegate); }
  const py::object& delegate() const { return delegate_; }

  bool is_available() const override { return true; }

  etr::Result<etr::DelegateHandle*> init(
      etr::BackendInitContext& /*context*/,
      etr::FreeableBuffer* processed,
      etr::ArrayRef<etr::CompileSpec> compile_specs) const override {
    PyGILState_STATE state = PyGILState_Ensure();
    DelegateHandleBox* box = nullptr;
    try {
      py::dict specs;
      for (const auto& spec : compile_specs) {
        specs[py::str(spec.key)] =
            py::bytes(static_cast<const char*>(spec.value.buffer), spec.value.nbytes);
      }
      py::object handle;
      if (py::bool_(py::getattr(delegate_, "processed_as_memoryview", py::none()))) {
        handle = init_from_view(processed, specs);
      } else {
        py::bytes blob(static_cast<const char*>(processed->data()), processed->size());
        processed->Free();
        handle = delegate_.attr("init")(blob, specs);
      }
      box = new DelegateHandleBox{delegate_, handle, id_};
    } catch (py::error_already_set& e) {
      set_pending(e, id_);
    }
    PyGILState_Release(state);
    if (box == nullptr) {
      return etr::Error::Internal;
    }
    return static_cast<etr::DelegateHandle*>(box);
  }

  // A delegate that sets `processed_as_memoryview` gets its blob as a read-only
  // memoryview of the runtime's buffer (the file's mapping while a method loads)
  // instead of a bytes copy: a large blob (an MLX program's weights) is then
  // copied once, into the delegate's own arrays. The buffer lives while anything
  // views it (DelegateBlob); one still viewed when the method load ends is a
  // mapping the file loader copies into memory of its own at the same address
  // (_program_file.h), so a view kept past init never reads the file again. The
  // memoryview given is released when init returns: a delegate that kept it gets
  // ValueError, not stale bytes.
  py::object init_from_view(etr::FreeableBuffer* processed, const py::dict& specs) const {
    py::object blob = py::cast(std::make_unique<DelegateBlob>(std::move(*processed), t_loading_program));
    py::memoryview view(blob);
    PyObject* handle = PyObject_CallMethod(delegate_.ptr(), "init", "OO", view.ptr(), specs.ptr());
    if (handle == nullptr) {
      // The traceback's frames may hold views of the blob: raised again without it.
      PyObject* type = nullptr;
      PyObject* value = nullptr;
      PyObject* trace = nullptr;
      PyErr_Fetch(&type, &value, &trace);
      PyErr_NormalizeException(&type, &value, &trace);
      Py_XDECREF(trace);
      if (value != nullptr) {
        PyException_SetTraceback(value, Py_None);
      }
      release_view(view);
      PyErr_Restore(type, value, nullptr);
      throw py::error_already_set();
    }
    release_view(view);
    return py::reinterpret_steal<py::object>(handle);
  }

  static void release_view(py::memoryview& view) {
    PyObject* released = PyObject_CallMethod(view.ptr(), "release", nullptr);
    if (released != nullptr) {
      Py_DECREF(released);
      return;
    }
    // BufferError: a view of the memoryview is still alive; the blob lives with it.
    PyErr_Clear();
  }

  etr::Error execute(
      etr::BackendExecutionContext& /*context*/,
      etr::DelegateHandle* handle,
      etr::Span<etr::EValue*> args) const override {
    auto* box = static_cast<DelegateHandleBox*>(handle);
    PyGILState_STATE state = PyGILState_Ensure();
    etr::Error result = etr::Error::Ok;
    try {
      py::list views(args.size());
      for (size_t i = 0; i < args.size(); ++i) {
        views[i] = evalue_to_py(*args[i], true, "argument " + std::to_string(i));
      }
      box->delegate.attr("execute")(box->handle, views);
    } catch (py::error_already_set& e) {
      set_pending(e, id_);
      result = etr::Error::Internal;
    } catch (std::exception& e) {
      py::error_already_set wrapped = [&] {
        PyErr_SetString(PyExc_RuntimeError, e.what());
        return py::error_already_set();
      }();
      set_pending(wrapped, id_);
      result = etr::Error::Internal;
    }
    PyGILState_Release(state);
    return result;
  }

  void destroy(etr::DelegateHandle* handle) const override {
    auto* box = static_cast<DelegateHandleBox*>(handle);
    if (box == nullptr || !Py_IsInitialized() || _Py_IsFinalizing()) {
      return;  // at interpreter exit Python objects can no longer be touched
    }
    PyGILState_STATE state = PyGILState_Ensure();
    try {
      box->delegate.attr("destroy")(box->handle);
    } catch (py::error_already_set& e) {
      e.discard_as_unraisable(("destroy of Python delegate '" + id_ + "'").c_str());
    }
    delete box;
    PyGILState_Release(state);
  }

 private:
  std::string id_;
  py::object delegate_;
};

// Backends are registered once per process and never unregistered (ExecuTorch
// has no way to); a later registration of the same id swaps the Python object.
std::map<std::string, PyBackend*>& backends() {
  static auto* map = new std::map<std::string, PyBackend*>();
  return *map;
}

void register_delegate(const std::string& backend_id, py::object delegate) {
  for (const char* name : {"init", "execute", "destroy"}) {
    if (!py::hasattr(delegate, name)) {
      throw py::type_error("runtime delegate for backend '" + backend_id + "' has no " + name +
                           "(); see writeback_core.types.RuntimeDelegate");
    }
  }
  auto& map = backends();
  auto found = map.find(backend_id);
  if (found != map.end()) {
    found->second->set_delegate(std::move(delegate));
    return;
  }
  if (etr::get_backend_class(backend_id.c_str()) != nullptr) {
    raise_value_error("backend id '" + backend_id +
                      "' is already registered by a compiled ExecuTorch backend; a Python "
                      "delegate cannot replace it (give the delegate another backend_id)");
  }
  auto* backend = new PyBackend(backend_id);
  backend->set_delegate(std::move(delegate));
  etr::Error err = etr::register_backend({backend->id().c_str(), backend});
  if (err != etr::Error::Ok) {
    delete backend;
    raise_value_error("registering Python delegate '" + backend_id + "' failed: " + describe(err));
  }
  map.emplace(backend_id, backend);
}

py::dict registered_delegates() {
  py::dict out;
  for (auto& [name, backend] : backends()) {
    out[py::str(name)] = backend->delegate();
  }
  return out;
}

py::object evalue_to_py(const etr::EValue& value, bool views, const std::string& what) {
  switch (value.tag) {
    case etr::Tag::None:
      return py::none();
    case etr::Tag::Int:
      return py::int_(value.toInt());
    case etr::Tag::Double:
      return py::float_(value.toDouble());
    case etr::Tag::Bool:
      return py::bool_(value.toBool());
    case etr::Tag::String: {
      auto s = value.toString();
      return py::str(s.data(), s.size());
    }
    case etr::Tag::Tensor: {
      const Tensor& t = value.toTensor();
      if (views) {
        return to_torch(t.mutable_data_ptr(), t.scalar_type(), t.sizes(), nullptr);
      }
      return copy_to_torch(t.const_data_ptr(), t.nbytes(), t.scalar_type(), t.sizes());
    }
    default:
      throw py::type_error(what + " is a " + tag_name(value.tag) +
                           ", which writeback_pybind_runtime does not convert");
  }
}

// ---------------------------------------------------------------------------
// Programs.

// A program loaded from bytes owns a copy of them; one loaded from a file reads
// and maps it through FileLoader (_program_file.h).

struct ProgramState {
  std::unique_ptr<ProgramBytes> buffer;  // bytes given to from_bytes
  std::unique_ptr<etr::DataLoader> loader;
  const FileLoader* file = nullptr;  // the loader, when loaded from a file
  std::unique_ptr<etr::Program> program;

  const ProgramBytes& bytes() const { return file != nullptr ? file->prefix() : *buffer; }
  // Why the file could not be read, as " (...)" to append to an error, or "".
  std::string file_failure() const {
    std::string why = file != nullptr ? file->take_failure() : "";
    return why.empty() ? why : " (" + why + ")";
  }
};

[[noreturn]] void raise_program_error(const std::string& message) {
  PyErr_SetString(g_program_error, message.c_str());
  throw py::error_already_set();
}

// Opens `path` read-only and reads its flatbuffer prefix (the whole file when it
// has no extended header), the GIL released.
std::unique_ptr<FileLoader> open_program_file(const std::string& path) {
  std::string failure;
  std::unique_ptr<FileLoader> loader;
  {
    py::gil_scoped_release release;
    // O_NONBLOCK: opening a FIFO waits for a writer, forever; a FIFO (or a device) is refused
    // below, after fstat. A regular file reads the same either way; the flag is cleared anyway.
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    struct stat info {};
    if (fd < 0 || ::fstat(fd, &info) != 0) {
      failure = std::strerror(errno);
    } else if (!S_ISREG(info.st_mode)) {
      failure = std::string("not a regular file (") +
                (S_ISFIFO(info.st_mode)  ? "a FIFO"
                 : S_ISDIR(info.st_mode) ? "a directory"
                 : S_ISCHR(info.st_mode) ? "a character device"
                 : S_ISBLK(info.st_mode) ? "a block device"
                 : S_ISSOCK(info.st_mode) ? "a socket"
                                          : "not a file") +
                "); pass the path of a .pte file, or its bytes";
    } else if (::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK) != 0) {
      failure = std::strerror(errno);
    } else {
      size_t size = static_cast<size_t>(info.st_size);
      size_t prefix = size;
      // ExecuTorch's extended header: "eh00" at byte 8, the flatbuffer's size
      // as a little-endian u64 at byte 16.
      unsigned char header[24] = {};
      if (size >= sizeof(header)) {
        failure = read_exactly(fd, 0, sizeof(header), header);
        if (failure.empty() && std::memcmp(header + 8, "eh00", 4) == 0) {
          uint64_t declared = 0;
          for (int i = 7; i >= 0; --i) {
            declared = (declared << 8) | header[16 + i];
          }
          if (declared < sizeof(header) || declared > size) {
            failure = "its header says the program is " + std::to_string(declared) +
                      " bytes, but the file has " + std::to_string(size) + " (a corrupted or cut file)";
          } else {
            prefix = static_cast<size_t>(declared);
          }
        }
      }
      std::unique_ptr<ProgramBytes> block;
      if (failure.empty()) {
        try {
          block = std::make_unique<ProgramBytes>(prefix);
        } catch (std::bad_alloc&) {
          failure = "cannot allocate " + std::to_string(prefix) + " bytes to read it into";
        }
      }
      if (block) {
        failure = read_exactly(fd, 0, prefix, block->data);
      }
      if (failure.empty()) {
        loader = std::make_unique<FileLoader>(fd, path, info, std::move(block));
        fd = -1;  // the loader closes it
      }
    }
    if (fd >= 0) {
      ::close(fd);
    }
  }
  if (!loader) {
    raise_program_error("cannot open program file '" + path + "': " + failure);
  }
  return loader;
}

class NativeProgram {
 public:
  static NativeProgram from_bytes(py::buffer data, int verification) {
    py::buffer_info info = data.request();
    size_t size = static_cast<size_t>(info.size * info.itemsize);
    auto state = std::make_shared<ProgramState>();
    try {
      state->buffer = std::make_unique<ProgramBytes>(size);
    } catch (std::bad_alloc&) {
      raise_program_error("cannot allocate " + std::to_string(size) + " bytes for the program");
    }
    {
      py::gil_scoped_release release;
      std::memcpy(state->buffer->data, info.ptr, size);
    }
    return NativeProgram(std::move(state), verification, "the program bytes");
  }

  static NativeProgram from_path(const std::string& path, int verification) {
    auto state = std::make_shared<ProgramState>();
    auto loader = open_program_file(path);
    state->file = loader.get();
    state->loader = std::move(loader);
    return NativeProgram(std::move(state), verification, "'" + path + "'");
  }

  // The program's bytes, read-only, for the Python layer's plan reader; a
  // memoryview of them keeps this program alive.
  py::buffer_info bytes() const {
    const ProgramBytes& bytes = state_->bytes();
    return py::buffer_info(bytes.data, 1, py::format_descriptor<uint8_t>::format(), 1,
                           {static_cast<py::ssize_t>(bytes.nbytes)}, {1},
                           /*readonly=*/true);
  }

  std::vector<std::string> method_names() const {
    std::vector<std::string> names;
    for (size_t i = 0; i < state_->program->num_methods(); ++i) {
      auto name = state_->program->get_method_name(i);
      if (name.ok()) {
        names.emplace_back(name.get());
      }
    }
    return names;
  }

  const std::shared_ptr<ProgramState>& state() const { return state_; }

  // For tests of a file changing under a method load (no program makes a delegate
  // read its data after a chosen moment): loads [offset, offset + size) of the
  // file as the runtime does for a delegate while a method loads, calls
  // `during()`, reads the bytes, ends the load, calls `after()` and reads them
  // again. Returns both reads; raises ProgramError as load_method does when the
  // file did not hold still.
  py::tuple read_as_delegate(size_t offset, size_t size, const py::object& during,
                             const py::object& after) const {
    const FileLoader* file = state_->file;
    if (file == nullptr) {
      throw py::value_error("the program was loaded from bytes, not from a file");
    }
    std::string while_loading;
    std::string once_loaded;
    bool held_still = true;
    {
      MethodLoad load(file);
      auto buffer = file->load(offset, size, etr::DataLoader::SegmentInfo(
                                                 etr::DataLoader::SegmentInfo::Type::Backend));
      if (!buffer.ok()) {
        raise_program_error("cannot read bytes " + std::to_string(offset) + ".." +
                            std::to_string(offset + size) + state_->file_failure());
      }
      during();
      while_loading.assign(static_cast<const char*>(buffer->data()), size);
      held_still = load.close();
      after();
      once_loaded.assign(static_cast<const char*>(buffer->data()), size);
    }
    if (!held_still) {
      raise_program_error("cannot load the bytes" + state_->file_failure());
    }
    return py::make_tuple(py::bytes(while_loading), py::bytes(once_loaded));
  }

 private:
  NativeProgram(std::shared_ptr<ProgramState> state, int verification, const std::string& what)
      : state_(std::move(state)) {
    if (!state_->loader) {
      state_->loader = std::make_unique<BufferDataLoader>(state_->buffer->data, state_->buffer->nbytes);
    }
    auto mode = verification == 0 ? etr::Program::Verification::Minimal
                                  : etr::Program::Verification::InternalConsistency;
    auto program = etr::Program::load(state_->loader.get(), mode);
    if (!program.ok()) {
      PyErr_SetString(g_program_error, ("cannot load " + what + " as an ExecuTorch program: " +
                                        describe(program.error()) + state_->file_failure())
                                           .c_str());
      throw py::error_already_set();
    }
    state_->program = std::make_unique<etr::Program>(std::move(program.get()));
  }

  std::shared_ptr<ProgramState> state_;
};

// ---------------------------------------------------------------------------
// Methods.

struct MethodMemory {
  MallocMemoryAllocator method_allocator;
  MallocMemoryAllocator temp_allocator;
  std::vector<std::unique_ptr<Block>> planned;
  std::vector<etr::Span<uint8_t>> spans;
  std::unique_ptr<etr::HierarchicalAllocator> hierarchy;
  std::unique_ptr<etr::MemoryManager> manager;
};

struct InputSlot {
  etr::Tag tag = etr::Tag::None;
  bool planned = false;
  ScalarType type = ScalarType::Undefined;
  std::vector<int32_t> sizes;
  size_t nbytes = 0;
  std::vector<int> as_outputs;  // outputs that are this input's value
  bool written = false;         // the method may write this input's memory
};

struct OutputSlot {
  etr::Tag tag = etr::Tag::None;
  bool planned = false;
  bool contiguous_order = true;
  ScalarType type = ScalarType::Undefined;
  std::vector<int32_t> max_sizes;
  size_t max_nbytes = 0;
  int input = -1;            // the input this output is, or -1
  std::vector<int> repeats;  // other outputs returning the same value
  // Runtime-owned storage of an unbound unplanned output. Tensors returned
  // uncloned hold their own reference, so replacing it never frees their memory.
  std::shared_ptr<Block> storage;
  // Binding, if any.
  py::object bound;
  py::object bound_capsule;
  void* bound_data = nullptr;
  size_t bound_nbytes = 0;
};

// What a successful set_inputs installed; replaced whole on the next success.
struct InstalledInput {
  py::object owner;
  py::object capsule;
  void* data = nullptr;
  size_t nbytes = 0;
  bool torch_tensor = false;
};

// Marks a method busy for the length of one call into it. ExecuTorch's Method
// is single-threaded, and execute() releases the GIL, so a second thread (or a
// Python delegate re-entering) would otherwise run it concurrently: outputs of
// one call handed to another, arenas overwritten mid-kernel, crashes.
class BusyGuard {
 public:
  BusyGuard(std::atomic<bool>& busy, const std::string& name) : busy_(busy) {
    bool idle = false;
    if (!busy_.compare_exchange_strong(idle, true, std::memory_order_acquire)) {
      throw std::runtime_error(
          "method '" + name + "' refused this call: it is in use by another call (another "
          "thread is running it, or a delegate called back into it); nothing was changed. One "
          "Method serves one call at a time: load one Method per thread (Program.load_method), "
          "which run concurrently, or serialize the calls with a lock");
    }
  }
  ~BusyGuard() { busy_.store(false, std::memory_order_release); }
  BusyGuard(const BusyGuard&) = delete;
  BusyGuard& operator=(const BusyGuard&) = delete;

 private:
  std::atomic<bool>& busy_;
};

class NativeMethod {
 public:
  NativeMethod(const NativeProgram& program, const std::string& name,
               const std::vector<int>& output_is_input,
               const std::vector<std::vector<int>>& output_repeats,
               const std::vector<bool>& input_written)
      : program_(program.state()), name_(name) {
    const etr::Program& prog = *program_->program;
    auto meta = prog.method_meta(name.c_str());
    if (!meta.ok()) {
      PyErr_SetString(g_program_error,
                      ("the program has no loadable method '" + name + "': " + describe(meta.error())).c_str());
      throw py::error_already_set();
    }
    memory_ = std::make_shared<MethodMemory>();
    for (size_t i = 0; i < meta->num_memory_planned_buffers(); ++i) {
      auto size = meta->memory_planned_buffer_size(i);
      if (!size.ok() || size.get() < 0) {
        PyErr_SetString(g_program_error, ("method '" + name + "' has an invalid memory plan").c_str());
        throw py::error_already_set();
      }
      try {
        memory_->planned.push_back(std::make_unique<Block>(static_cast<size_t>(size.get())));
      } catch (std::bad_alloc&) {
        PyErr_SetString(g_program_error,
                        ("method '" + name + "' plans a buffer of " + std::to_string(size.get()) +
                         " bytes, which cannot be allocated (a corrupted program?)").c_str());
        throw py::error_already_set();
      }
      memory_->spans.emplace_back(static_cast<uint8_t*>(memory_->planned.back()->data),
                                  static_cast<size_t>(size.get()));
    }
    memory_->hierarchy = std::make_unique<etr::HierarchicalAllocator>(
        etr::Span<etr::Span<uint8_t>>(memory_->spans.data(), memory_->spans.size()));
    memory_->manager = std::make_unique<etr::MemoryManager>(
        &memory_->method_allocator, memory_->hierarchy.get(), &memory_->temp_allocator);

    clear_pending();
    bool file_held_still = true;
    auto method = [&] {
      // Delegates given their blob as a view keep the program alive through it.
      struct Loading {
        explicit Loading(std::shared_ptr<ProgramState> p) { t_loading_program = std::move(p); }
        ~Loading() { t_loading_program.reset(); }
      } loading(program_);
      MethodLoad load(program_->file);
      auto loaded = prog.load_method(name.c_str(), memory_->manager.get());
      file_held_still = load.close();
      return loaded;
    }();
    if (!method.ok()) {
      raise_failure(g_program_error, "cannot load method '" + name + "'" + program_->file_failure(),
                    method.error());
    }
    if (!file_held_still) {
      // Loaded from bytes that may be zeros where the file was cut: dropped.
      std::string why = program_->file_failure();
      { auto dropped = std::move(method); }
      raise_program_error("cannot load method '" + name + "'" + why);
    }
    method_ = std::make_unique<etr::Method>(std::move(method.get()));

    const size_t n_in = method_->inputs_size();
    const size_t n_out = method_->outputs_size();
    if (output_is_input.size() != n_out || output_repeats.size() != n_out) {
      raise_value_error("the program lists " + std::to_string(output_is_input.size()) +
                        " outputs for method '" + name + "' but the runtime has " +
                        std::to_string(n_out));
    }
    if (input_written.size() != n_in) {
      raise_value_error("the program lists " + std::to_string(input_written.size()) +
                        " inputs for method '" + name + "' but the runtime has " +
                        std::to_string(n_in));
    }
    inputs_.resize(n_in);
    for (size_t j = 0; j < n_in; ++j) {
      InputSlot& slot = inputs_[j];
      slot.written = input_written[j];
      slot.tag = checked(meta->input_tag(j), "input", j);
      if (slot.tag == etr::Tag::Tensor) {
        auto info = checked(meta->input_tensor_meta(j), "input", j);
        slot.planned = info.is_memory_planned();
        slot.type = info.scalar_type();
        slot.sizes.assign(info.sizes().begin(), info.sizes().end());
        slot.nbytes = info.nbytes();
      }
    }
    outputs_.resize(n_out);
    for (size_t i = 0; i < n_out; ++i) {
      OutputSlot& slot = outputs_[i];
      slot.tag = checked(meta->output_tag(i), "output", i);
      slot.input = output_is_input[i];
      slot.repeats = output_repeats[i];
      if (slot.input >= static_cast<int>(n_in)) {
        raise_value_error("output " + std::to_string(i) + " names input " +
                          std::to_string(slot.input) + " of " + std::to_string(n_in));
      }
      if (slot.input >= 0) {
        inputs_[slot.input].as_outputs.push_back(static_cast<int>(i));
      }
      if (slot.tag != etr::Tag::Tensor) {
        continue;
      }
      auto info = checked(meta->output_tensor_meta(i), "output", i);
      slot.planned = info.is_memory_planned();
      slot.type = info.scalar_type();
      slot.max_sizes.assign(info.sizes().begin(), info.sizes().end());
      slot.max_nbytes = info.nbytes();
      auto order = info.dim_order();
      for (size_t d = 0; d < order.size(); ++d) {
        slot.contiguous_order = slot.contiguous_order && order[d] == d;
      }
    }
    // An unplanned output that no one binds gets storage from this runtime:
    // executing with a null data pointer crashes inside a kernel. An output
    // that is an input keeps the input's memory (redirecting it would make
    // the method ignore the caller's tensor).
    for (size_t i = 0; i < n_out; ++i) {
      OutputSlot& slot = outputs_[i];
      if (slot.tag != etr::Tag::Tensor || slot.planned || slot.input >= 0) {
        continue;
      }
      bool first = std::all_of(slot.repeats.begin(), slot.repeats.end(),
                               [&](int k) { return k > static_cast<int>(i); });
      if (first) {
        give_storage(i);
      }
    }
  }

  ~NativeMethod() {
    // The method's destructor runs delegate destroy() hooks, which need the
    // GIL; pybind11 destroys this object while holding it.
    method_.reset();
  }

  const std::string& name() const { return name_; }

  void set_inputs(py::sequence values) {
    BusyGuard busy(busy_, name_);
    install_inputs(values);
  }

  void execute() {
    BusyGuard busy(busy_, name_);
    run(/*inputs_checked=*/false);
  }

  py::list get_outputs(bool clone_outputs) {
    BusyGuard busy(busy_, name_);
    return collect_outputs(clone_outputs);
  }

  // set_inputs (when `values` is not None), execute and get_outputs as one
  // call, so no other call can slip in between them.
  py::list call(py::object values, bool clone_outputs) {
    BusyGuard busy(busy_, name_);
    bool fresh = !values.is_none();
    if (fresh) {
      if (!PySequence_Check(values.ptr())) {
        throw py::type_error("method '" + name_ + "' takes its inputs as a list or tuple, got " +
                             std::string(py::str(py::type::handle_of(values).attr("__name__"))));
      }
      install_inputs(py::reinterpret_borrow<py::sequence>(values));
    }
    run(/*inputs_checked=*/fresh);
    return collect_outputs(clone_outputs);
  }

  void set_output(py::object tensor, int64_t index) {
    BusyGuard busy(busy_, name_);
    bind_output(tensor, index);
  }

 private:
  void install_inputs(py::sequence values) {
    const size_t n_in = inputs_.size();
    if (static_cast<size_t>(py::len(values)) != n_in) {
      raise_value_error("method '" + name_ + "' takes " + std::to_string(n_in) + " inputs, got " +
                        std::to_string(py::len(values)));
    }
    // Until a full set is installed the method refuses to run: a failed call
    // may have replaced some inputs already.
    ready_ = false;
    std::vector<InstalledInput> installed(n_in);
    for (size_t j = 0; j < n_in; ++j) {
      install_input(j, values[j], installed[j]);
    }
    installed_.swap(installed);
    ready_ = true;
  }

  // `inputs_checked`: the inputs were installed (and checked) by this same
  // call, with no Python code run since.
  void run(bool inputs_checked) {
    executed_ = false;
    if (!inputs_.empty() && !ready_) {
      throw py::value_error("method '" + name_ + "': its inputs have not been set; call "
                            "set_inputs() (a failed set_inputs() leaves them unset)");
    }
    if (!inputs_checked) {
      check_inputs_for_call();
    }
    check_bindings_for_call();
    if (!spoiled_.empty()) {
      raise_program_error("method '" + name_ + "' refused this call: " + spoiled_);
    }
    // A program whose constants are mapped from its file (_program_file.h): the
    // file is checked before the call (changed: refused, nothing changed) and after
    // it, and the call runs under a SigbusGuard (a cut file reads as zeros).
    const FileLoader* mapped = program_->file != nullptr && program_->file->maps_constants()
                                   ? program_->file
                                   : nullptr;
    std::optional<SigbusGuard> guard;
    if (mapped != nullptr) {
      if (!mapped->file_unchanged()) {
        raise_program_error("method '" + name_ + "' refused this call, which changed nothing: its "
                            "program maps its constants from its file" + program_->file_failure());
      }
      guard.emplace();
    }
    clear_pending();
    etr::Error err;
    {
      py::gil_scoped_release release;
      err = method_->execute();
    }
    if (mapped != nullptr) {
      bool intact = mapped->constants_intact();
      guard.reset();
      if (!intact) {
        std::string why = program_->file_failure();
        spoiled_ = "its program's file changed while an earlier call ran" + why +
                   "; that call's outputs and the state it wrote are not to be used";
        raise_program_error("method '" + name_ + "' ran while its program's file changed" + why +
                            ": this call's outputs and the state it wrote are not to be used, and "
                            "the method refuses further calls; load the program again");
      }
    }
    if (err != etr::Error::Ok) {
      raise_failure(PyExc_RuntimeError, "method '" + name_ + "' failed", err);
    }
    copy_back_planned_inputs();
    executed_ = true;
  }

  py::list collect_outputs(bool clone_outputs) {
    if (!executed_) {
      throw py::value_error("method '" + name_ + "' has no outputs: the last execute() failed or "
                            "none has run yet");
    }
    py::list out(outputs_.size());
    for (size_t i = 0; i < outputs_.size(); ++i) {
      out[i] = output(i, clone_outputs);
    }
    return out;
  }

  void bind_output(py::object tensor, int64_t index) {
    if (index < 0 || index >= static_cast<int64_t>(outputs_.size())) {
      throw py::index_error("method '" + name_ + "' has " + std::to_string(outputs_.size()) +
                            " outputs; output " + std::to_string(index) + " does not exist");
    }
    size_t i = static_cast<size_t>(index);
    OutputSlot& slot = outputs_[i];
    if (tensor.is_none()) {
      unbind(i);
      return;
    }
    check_bindable(i);
    Imported in = import_tensor(tensor, "the tensor bound to output " + std::to_string(i));
    check_binding_tensor(i, in, "cannot bind " + output_label(i),
                         "bind a tensor whose storage holds its shape");
    point_output_at(i, in.data, in.nbytes);
    slot.storage.reset();
    slot.bound = in.owner;
    slot.bound_capsule = in.capsule;
    slot.bound_data = in.data;
    slot.bound_nbytes = in.nbytes;
  }

 public:
  py::dict metadata() const {
    auto meta = method_->method_meta();
    py::dict out;
    out["name"] = name_;
    py::list ins, outs, buffers, backends_used;
    for (size_t j = 0; j < inputs_.size(); ++j) {
      py::dict d;
      d["tag"] = tag_name(inputs_[j].tag);
      if (inputs_[j].tag == etr::Tag::Tensor) {
        d["dtype"] = dtype_name(inputs_[j].type);
        d["sizes"] = inputs_[j].sizes;
        d["memory_planned"] = inputs_[j].planned;
        d["nbytes"] = inputs_[j].nbytes;
      }
      ins.append(d);
    }
    for (size_t i = 0; i < outputs_.size(); ++i) {
      const OutputSlot& slot = outputs_[i];
      py::dict d;
      d["tag"] = tag_name(slot.tag);
      d["is_input"] = slot.input >= 0 ? py::object(py::int_(slot.input)) : py::object(py::none());
      d["repeats"] = slot.repeats;
      if (slot.tag == etr::Tag::Tensor) {
        d["dtype"] = dtype_name(slot.type);
        d["sizes"] = slot.max_sizes;
        d["memory_planned"] = slot.planned;
        d["nbytes"] = slot.max_nbytes;
        d["bound"] = slot.bound_data != nullptr;
      }
      outs.append(d);
    }
    for (size_t b = 0; b < meta.num_memory_planned_buffers(); ++b) {
      buffers.append(meta.memory_planned_buffer_size(b).get());
    }
    for (size_t b = 0; b < meta.num_backends(); ++b) {
      auto name = meta.get_backend_name(b);
      if (name.ok()) {
        backends_used.append(py::str(name.get()));
      }
    }
    out["inputs"] = ins;
    out["outputs"] = outs;
    out["memory_planned_buffers"] = buffers;
    out["backends"] = backends_used;
    return out;
  }

 private:
  // A Result's value, or ProgramError: a corrupted program can name values
  // that do not exist, and Result::get() on an error aborts the process.
  template <typename T>
  T checked(etr::Result<T> result, const char* what, size_t index) const {
    if (!result.ok()) {
      PyErr_SetString(g_program_error, ("method '" + name_ + "' has an unreadable " + what + " " +
                                        std::to_string(index) + ": " + describe(result.error()))
                                           .c_str());
      throw py::error_already_set();
    }
    return std::move(result.get());
  }

  bool in_arena(const void* data, size_t nbytes) const {
    for (const auto& block : memory_->planned) {
      if (overlaps(data, nbytes, block->data, block->nbytes)) {
        return true;
      }
    }
    return false;
  }

  void give_storage(size_t i) {
    OutputSlot& slot = outputs_[i];
    slot.storage = std::make_shared<Block>(slot.max_nbytes);
    point_output_at(i, slot.storage->data, slot.max_nbytes);
  }

  void point_output_at(size_t i, void* data, size_t nbytes) {
    etr::Error err = method_->set_output_data_ptr(data, nbytes, i);
    if (err != etr::Error::Ok) {
      raise_value_error("method '" + name_ + "' refused storage for output " + std::to_string(i) +
                        ": " + describe(err));
    }
  }

  std::string output_label(size_t i) const {
    const OutputSlot& slot = outputs_[i];
    return "output " + std::to_string(i) + " of method '" + name_ + "' (" + dtype_name(slot.type) +
           ", up to " + join(slot.max_sizes) + ")";
  }

  // The checks that cannot change after binding: they depend on the program only.
  void check_bindable(size_t i) const {
    const OutputSlot& slot = outputs_[i];
    std::string label = "output " + std::to_string(i) + " of method '" + name_ + "'";
    if (slot.tag != etr::Tag::Tensor) {
      raise_value_error("cannot bind " + label + ": it is a " + tag_name(slot.tag) + ", not a tensor");
    }
    if (slot.input >= 0) {
      raise_value_error("cannot bind " + label + ": it is input " + std::to_string(slot.input) +
                        " (an input the method mutates or returns); binding it would redirect "
                        "that input, so pass the tensor as input " + std::to_string(slot.input) +
                        " instead: its mutation is written into the caller's tensor");
    }
    if (slot.planned) {
      raise_value_error("cannot bind " + label + ": it is memory planned (the method writes it "
                        "into its own arena); export with MemoryPlanningPass(alloc_graph_output="
                        "False) to bind outputs");
    }
    if (!slot.repeats.empty()) {
      raise_value_error("cannot bind " + label + ": the same value is returned at outputs " +
                        join(slot.repeats) + " too; binding one would redirect the others");
    }
    if (!slot.contiguous_order) {
      raise_value_error("cannot bind " + label + ": its dim order is not contiguous");
    }
  }

  // The checks on what the caller can change: the tensor itself and what
  // else is bound or passed in. Leaves nothing changed when it raises.
  // `action` opens the storage and grad errors ("cannot bind output 1 ...").
  void check_binding_tensor(size_t i, const Imported& in, const std::string& action,
                            const std::string& remedy) const {
    const OutputSlot& slot = outputs_[i];
    std::string label = output_label(i);
    check_storage(in, action, remedy);
    check_not_grad_write(in, action + ":", "the method writes into the tensor");
    if (!in.cpu) {
      raise_value_error("cannot bind " + label + ": expected a CPU tensor, got a tensor on DLPack "
                        "device type " + std::to_string(in.device_type));
    }
    if (in.type != slot.type) {
      raise_value_error("cannot bind " + label + ": expected dtype " + dtype_name(slot.type) +
                        ", got " + (in.row ? dtype_name(in.type) : std::string("an unsupported dtype")));
    }
    if (!in.contiguous) {
      raise_value_error("cannot bind " + label + ": the tensor is not contiguous (strides " +
                        join(in.strides) + "); pass tensor.contiguous() and keep that tensor");
    }
    if (in.nbytes < slot.max_nbytes) {
      raise_value_error("cannot bind " + label + ": it needs " + std::to_string(slot.max_nbytes) +
                        " bytes, the tensor (shape " + join(in.sizes) + ") has " +
                        std::to_string(in.nbytes));
    }
    for (size_t k = 0; k < outputs_.size(); ++k) {
      const OutputSlot& other = outputs_[k];
      if (k != i && other.bound_data != nullptr &&
          overlaps(in.data, in.nbytes, other.bound_data, other.bound_nbytes)) {
        raise_value_error("cannot bind " + label + ": the tensor shares memory with the tensor "
                          "bound to output " + std::to_string(k) + "; two outputs would overwrite "
                          "each other");
      }
    }
    for (size_t j = 0; j < installed_.size(); ++j) {
      if (overlaps(in.data, in.nbytes, installed_[j].data, installed_[j].nbytes)) {
        raise_value_error("cannot bind " + label + ": the tensor shares memory with input " +
                          std::to_string(j) + "; the method would write over an input it reads");
      }
    }
  }

  void unbind(size_t i) {
    OutputSlot& slot = outputs_[i];
    if (slot.bound_data == nullptr) {
      return;
    }
    give_storage(i);
    slot.bound = py::object();
    slot.bound_capsule = py::object();
    slot.bound_data = nullptr;
    slot.bound_nbytes = 0;
  }

  // Per execute() after a separate set_inputs(): the caller may have freed or
  // moved an input's storage, or made it require grad, since.
  void check_inputs_for_call() {
    for (size_t j = 0; j < inputs_.size(); ++j) {
      const InstalledInput& installed = installed_[j];
      if (inputs_[j].tag != etr::Tag::Tensor || !installed.torch_tensor) {
        continue;
      }
      std::string label = "input " + std::to_string(j) + " of method '" + name_ + "'";
      Imported now = import_tensor(installed.owner, label);
      check_storage(now, label, "pass tensors whose storage holds them to set_inputs() again");
      if (installed.nbytes > 0 && now.data != installed.data) {
        raise_value_error(label + ": the tensor's memory moved since set_inputs() (its storage was "
                          "resized or replaced); nothing was run or written; call set_inputs() "
                          "again");
      }
      if (inputs_[j].written) {
        check_not_grad_write(now, label, "is written by the method (it mutates it in place)");
      }
    }
  }

  // Per call: a bound tensor may have been resized or swapped by the caller
  // (resize_, set_), and inputs change every call.
  void check_bindings_for_call() {
    for (size_t i = 0; i < outputs_.size(); ++i) {
      OutputSlot& slot = outputs_[i];
      if (slot.bound_data != nullptr) {
        Imported in = import_tensor(slot.bound, "the tensor bound to output " + std::to_string(i));
        std::string index = std::to_string(i);
        check_binding_tensor(i, in, "cannot write " + output_label(i) + " into its bound tensor",
                             "bind a tensor that holds it with set_output(tensor, " + index +
                                 "), or unbind it with set_output(None, " + index + ")");
        if (in.data != slot.bound_data || in.nbytes != slot.bound_nbytes) {
          point_output_at(i, in.data, in.nbytes);
          slot.bound_capsule = in.capsule;
          slot.bound_data = in.data;
          slot.bound_nbytes = in.nbytes;
        }
        continue;
      }
      // Runtime storage that an input now views (an uncloned output fed back
      // in): give the output fresh storage so the method does not write over
      // an input it is still reading. The old block lives on in the caller's
      // tensor.
      if (slot.storage) {
        for (const auto& input : installed_) {
          if (overlaps(slot.storage->data, slot.storage->nbytes, input.data, input.nbytes)) {
            give_storage(i);
            break;
          }
        }
      }
    }
  }

  void install_input(size_t j, py::handle value, InstalledInput& installed) {
    const InputSlot& slot = inputs_[j];
    std::string label = "input " + std::to_string(j) + " of method '" + name_ + "'";
    etr::Error err = etr::Error::Ok;
    switch (slot.tag) {
      case etr::Tag::Tensor: {
        Imported in = import_tensor(value, label);
        check_storage(in, label, "pass a tensor whose storage holds its shape");
        if (slot.written) {
          check_not_grad_write(in, label, "is written by the method (it mutates it in place)");
        }
        if (!in.cpu) {
          raise_value_error(label + ": expected a CPU tensor, got a tensor on DLPack device type " +
                            std::to_string(in.device_type));
        }
        if (in.type != slot.type) {
          raise_value_error(label + ": expected dtype " + dtype_name(slot.type) + ", got " +
                            (in.row ? dtype_name(in.type) : std::string("an unsupported dtype")));
        }
        if (in.sizes.size() != slot.sizes.size()) {
          raise_value_error(label + ": expected " + std::to_string(slot.sizes.size()) +
                            " dimensions " + join(slot.sizes) + ", got shape " + join(in.sizes));
        }
        if (!in.contiguous) {
          if (!slot.as_outputs.empty()) {
            raise_value_error(label + " is written by the method (it is output " +
                              std::to_string(slot.as_outputs[0]) + "), so it must be contiguous "
                              "for the write to land in it; got strides " + join(in.strides));
          }
          py::object copy = in.owner.attr("contiguous")();
          in = import_tensor(copy, label);
        }
        if (in_arena(in.data, in.nbytes)) {
          // An uncloned planned output of an earlier call fed back in: the
          // method reuses that memory for its own values while it runs.
          if (!slot.as_outputs.empty()) {
            raise_value_error(label + " views this method's planned memory (an output returned "
                              "with clone_outputs=False); the method writes that input, so pass "
                              "a clone of it");
          }
          py::object copy = in.owner.attr("clone")();
          in = import_tensor(copy, label);
        }
        std::vector<executorch::aten::DimOrderType> order(in.sizes.size());
        std::vector<executorch::aten::StridesType> strides(in.sizes.size());
        const std::vector<int64_t> sizes64(in.sizes.begin(), in.sizes.end());
        const std::vector<int64_t> wide = contiguous_strides(sizes64.data(), sizes64.size());
        for (size_t d = 0; d < in.sizes.size(); ++d) {
          order[d] = static_cast<executorch::aten::DimOrderType>(d);
          // Past kMaxIndex only without elements (import_tensor refuses the rest): capped.
          strides[d] = static_cast<executorch::aten::StridesType>(std::min(wide[d], kMaxIndex));
        }
        TensorImpl impl(in.type, static_cast<ssize_t>(in.sizes.size()), in.sizes.data(), in.data,
                        order.data(), strides.data(),
                        executorch::aten::TensorShapeDynamism::DYNAMIC_BOUND);
        err = method_->set_input(etr::EValue(Tensor(&impl)), j);
        if (err != etr::Error::Ok) {
          raise_value_error(label + ": the runtime rejected a tensor of shape " + join(in.sizes) +
                            " (" + dtype_name(in.type) + "); expected shape " + join(slot.sizes) +
                            " or within its dynamic bounds: " + describe(err));
        }
        installed.owner = in.owner;
        installed.capsule = in.capsule;
        installed.data = in.data;
        installed.nbytes = in.nbytes;
        installed.torch_tensor = in.torch_tensor;
        return;
      }
      case etr::Tag::Int:
        if (!py::isinstance<py::int_>(value) || py::isinstance<py::bool_>(value)) {
          throw py::type_error(label + " must be an int");
        }
        err = method_->set_input(etr::EValue(value.cast<int64_t>()), j);
        break;
      case etr::Tag::Double:
        if (!py::isinstance<py::float_>(value) && !py::isinstance<py::int_>(value)) {
          throw py::type_error(label + " must be a float");
        }
        err = method_->set_input(etr::EValue(value.cast<double>()), j);
        break;
      case etr::Tag::Bool:
        if (!py::isinstance<py::bool_>(value)) {
          throw py::type_error(label + " must be a bool");
        }
        err = method_->set_input(etr::EValue(value.cast<bool>()), j);
        break;
      case etr::Tag::None:
        err = method_->set_input(etr::EValue(), j);
        break;
      default:
        throw py::type_error(label + " is a " + tag_name(slot.tag) +
                             ", which writeback_pybind_runtime does not pass");
    }
    if (err != etr::Error::Ok) {
      raise_value_error(label + ": the runtime rejected " + std::string(py::repr(value)) + ": " +
                        describe(err));
    }
    installed.owner = py::reinterpret_borrow<py::object>(value);
  }

  // A planned input that the method mutates was copied into the arena; the
  // new value is copied back so it lands in the caller's tensor.
  void copy_back_planned_inputs() {
    for (size_t j = 0; j < inputs_.size(); ++j) {
      const InputSlot& slot = inputs_[j];
      if (slot.tag != etr::Tag::Tensor || !slot.planned || slot.as_outputs.empty()) {
        continue;
      }
      const etr::EValue& value = method_->get_output(slot.as_outputs[0]);
      if (!value.isTensor()) {
        continue;
      }
      const Tensor& t = value.toTensor();
      const InstalledInput& caller = installed_[j];
      if (t.const_data_ptr() != caller.data && t.nbytes() == caller.nbytes) {
        std::memcpy(caller.data, t.const_data_ptr(), caller.nbytes);
      }
    }
  }

  py::object output(size_t i, bool clone) {
    const etr::EValue& value = method_->get_output(i);
    const OutputSlot& slot = outputs_[i];
    if (value.tag != etr::Tag::Tensor) {
      return evalue_to_py(value, false, "output " + std::to_string(i));
    }
    const Tensor& t = value.toTensor();
    if (slot.bound_data != nullptr) {
      // Bound outputs come back as the caller's tensor, never cloned: binding
      // is the opt-in. A dynamic output smaller than it is a view of its front.
      py::tuple sizes(t.dim());
      size_t numel = 1;
      for (ssize_t d = 0; d < t.dim(); ++d) {
        sizes[d] = t.size(d);
        numel *= static_cast<size_t>(t.size(d));
      }
      py::object bound_sizes = slot.bound.attr("shape");
      if (py::tuple(bound_sizes).equal(sizes)) {
        return slot.bound;
      }
      return slot.bound.attr("reshape")(-1)[py::slice(0, static_cast<py::ssize_t>(numel), 1)]
          .attr("view")(sizes);
    }
    // An output that is a constant of a program mapping its constants from the
    // file is copied: Python reads it outside any SigbusGuard.
    if (clone || (program_->file != nullptr &&
                  program_->file->in_resident_mapping(t.const_data_ptr(), t.nbytes()))) {
      return copy_to_torch(t.const_data_ptr(), t.nbytes(), t.scalar_type(), t.sizes());
    }
    std::shared_ptr<void> keep;
    if (slot.input >= 0) {
      keep = std::make_shared<PyRef>(installed_[slot.input].capsule);
      // A planned input's value lives in the arena; after the copy-back the
      // caller's tensor holds it, and that is the tensor to alias.
      return to_torch(installed_[slot.input].data, t.scalar_type(), t.sizes(), std::move(keep));
    }
    if (slot.storage) {
      keep = slot.storage;
    } else {
      keep = memory_;
    }
    return to_torch(t.mutable_data_ptr(), t.scalar_type(), t.sizes(), std::move(keep));
  }

  std::shared_ptr<ProgramState> program_;
  std::string name_;
  std::shared_ptr<MethodMemory> memory_;
  std::unique_ptr<etr::Method> method_;  // after memory_: destroyed first
  std::vector<InputSlot> inputs_;
  std::vector<OutputSlot> outputs_;
  std::vector<InstalledInput> installed_;
  bool ready_ = false;
  bool executed_ = false;
  std::string spoiled_;  // why the method refuses every call, or ""
  std::atomic<bool> busy_{false};
};

// The runtime's log sink. ExecuTorch's default one prints every message, Info included,
// to stderr: the threadpool logs five lines about /sys CPU files the first time a kernel
// runs in parallel. Messages below the minimum level are dropped at the source; the rest
// (errors: a kernel refusing its arguments, a delegate failing) print as ExecuTorch prints
// them. The minimum starts at Error, or at WRITEBACK_RUNTIME_LOG (debug, info, error).
std::atomic<char> g_min_log_level{'E'};

int log_rank(char level) {
  switch (level) {
    case 'D': return 0;
    case 'I': return 1;
    case 'E': return 2;
    case 'F': return 3;
    default: return 2;  // unknown levels print, as errors do
  }
}

void emit_log_message(et_timestamp_t timestamp, et_pal_log_level_t level, const char* filename,
                      const char* function, size_t line, const char* message, size_t length) {
  (void)function;
  if (log_rank(static_cast<char>(level)) < log_rank(g_min_log_level.load())) {
    return;
  }
  const char* base = std::strrchr(filename, '/');
  const et_tick_ratio_t ratio = etr::pal_ticks_to_ns_multiplier();
  const unsigned long long us = static_cast<unsigned long long>(timestamp) * ratio.numerator /
                                (ratio.denominator == 0 ? 1 : ratio.denominator) / 1000ULL;
  std::fprintf(stderr, "%c %02llu:%02llu:%02llu.%06llu executorch:%s:%zu] %.*s\n", static_cast<char>(level),
               us / 3600000000ULL, us / 60000000ULL % 60, us / 1000000ULL % 60, us % 1000000ULL,
               base != nullptr ? base + 1 : filename, line, static_cast<int>(length), message);
  std::fflush(stderr);
}

char parse_log_level(const std::string& name) {
  if (name == "debug") return 'D';
  if (name == "info") return 'I';
  if (name == "error") return 'E';
  throw py::value_error("runtime log level must be 'debug', 'info' or 'error', got '" + name + "'");
}

}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "ExecuTorch runtime bindings of writeback-pybind-runtime (see _runtime.py for the API).";
  py::class_<DelegateBlob>(m, "_DelegateBlob", py::buffer_protocol())
      .def_buffer([](DelegateBlob& blob) {
        return py::buffer_info(const_cast<void*>(blob.buffer.data()), 1,
                               py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(blob.buffer.size())}, {1}, /*readonly=*/true);
      });
  if (const char* env = std::getenv("WRITEBACK_RUNTIME_LOG"); env != nullptr && *env != '\0') {
    try {
      g_min_log_level = parse_log_level(env);
    } catch (const py::value_error& error) {
      throw py::value_error(std::string("WRITEBACK_RUNTIME_LOG: ") + error.what());
    }
  }
  // The log sink goes into the runtime's PAL table directly, not through register_pal():
  // ExecuTorch's own bindings (its _C module, which executorch.runtime, portable_lib, the
  // LLM runner and the XNNPACK partitioner load) register their PAL when imported, and
  // register_pal() logs an error line ("register_pal() called multiple times") at every
  // registration after the first, in whichever order the two modules load. The table is the
  // runtime's own non-const object behind get_pal_impl(); only the sink changes, and the
  // bindings' later registration, if any, replaces it without a word, as it did before.
  const_cast<etr::PalImpl*>(etr::get_pal_impl())->emit_log_message = &emit_log_message;
  etr::runtime_init();
  m.def("set_log_level", [](const std::string& name) { g_min_log_level = parse_log_level(name); },
        py::arg("level"),
        "The lowest level of ExecuTorch runtime log message printed to stderr: 'debug', 'info' "
        "or 'error' (the default; WRITEBACK_RUNTIME_LOG sets it at import).");

  g_delegate_error = PyExc_RuntimeError;
  g_program_error = PyExc_ValueError;
  m.def("set_error_types", [](py::object delegate_error, py::object program_error) {
    // Kept for the life of the process: the Python classes are module globals.
    g_delegate_error = delegate_error.inc_ref().ptr();
    g_program_error = program_error.inc_ref().ptr();
  }, "Set the exception classes raised for delegate failures and unloadable programs.");

  py::class_<NativeProgram>(m, "NativeProgram", py::buffer_protocol())
      .def_buffer(&NativeProgram::bytes)
      .def_static("from_bytes", &NativeProgram::from_bytes, py::arg("data"), py::arg("verification"))
      .def_static("from_path", &NativeProgram::from_path, py::arg("path"), py::arg("verification"))
      .def_property_readonly("method_names", &NativeProgram::method_names)
      .def("_read_as_delegate", &NativeProgram::read_as_delegate, py::arg("offset"), py::arg("size"),
           py::arg("during"), py::arg("after"));

  py::class_<NativeMethod>(m, "NativeMethod")
      .def(py::init<const NativeProgram&, const std::string&, const std::vector<int>&,
                    const std::vector<std::vector<int>>&, const std::vector<bool>&>(),
           py::arg("program"), py::arg("name"), py::arg("output_is_input"), py::arg("output_repeats"),
           py::arg("input_written"))
      .def_property_readonly("name", &NativeMethod::name)
      .def("set_inputs", &NativeMethod::set_inputs, py::arg("inputs"))
      .def("execute", &NativeMethod::execute)
      .def("get_outputs", &NativeMethod::get_outputs, py::arg("clone_outputs") = true)
      .def("call", &NativeMethod::call, py::arg("inputs").none(true), py::arg("clone_outputs") = true)
      .def("set_output", &NativeMethod::set_output, py::arg("tensor"), py::arg("index"))
      .def("metadata", &NativeMethod::metadata);

  m.def("register_delegate", &register_delegate, py::arg("backend_id"), py::arg("delegate"),
        "Register a Python delegate as the ExecuTorch backend `backend_id` (process-wide; a "
        "second call with the same id replaces the Python object).");
  m.def("registered_delegates", &registered_delegates,
        "The Python delegates registered so far, keyed by backend id.");
  m.def("registered_backends", [] {
    std::vector<std::string> names;
    for (size_t i = 0; i < etr::get_num_registered_backends(); ++i) {
      auto name = etr::get_backend_name(i);
      if (name.ok()) {
        names.emplace_back(name.get());
      }
    }
    return names;
  }, "Every backend id the ExecuTorch runtime has registered (compiled and Python).");
}
