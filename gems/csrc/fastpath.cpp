// Gems' C++ fast path: call plans replayed without entering Python.
//
// Why: a Python kernel behind the dispatcher costs ~1.3x ATen's host time per call even when all it
// does is look up a plan (GIL, IValue -> PyObject conversion of every argument, the Python frame,
// torch.empty_strided, Triton's C launcher parsing a Python tuple). Models call thousands of small
// ops per step, so that host time is the step time.
//
// What: one boxed C++ kernel per served overload, registered at the backend key on top of the Python
// kernel (which stays registered underneath and keeps every behaviour: support checks, fallbacks,
// errors, recording). Per call it
//   1. decides whether Gems serves the call on this thread (a mirror of dispatch.py's enable() /
//      use_gems() state, kept in sync from Python), else calls the Python kernel;
//   2. builds the call's signature from the stack: per tensor dtype, device, sizes, strides,
//      16-byte alignment; numbers by value (or, for arguments the op declared dynamic, by class,
//      NaN-ness and what Triton specializes ints on); lists, strings, devices by value; which tensor arguments
//      are the same tensor; the current device; torch's default dtype. It is at least as fine as dispatch.py's Python
//      signature, so a recipe recorded for a Python plan is valid for every call with this key;
//   3. on a hit replays the plan's recipe: overlap guards for written arguments, output
//      allocations, kernel launches (cuLaunchKernel on the recorded CUfunction; under the Triton
//      interpreter a call back into Python), results;
//   4. on a miss (or a guard that declines) calls the Python kernel, which records a plan the
//      usual way and publishes its recipe back here for this key (`Op.publish`).
// Python is entered only on misses, while Gems is off for the call, and under the interpreter.

#include <cmath>

#include <torch/extension.h>
#include <torch/library.h>
#include <ATen/EmptyTensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/fill_native.h>
#include <c10/core/DefaultDtype.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/tensor_memoryformats.h>

#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <iterator>
#include <optional>
#include <limits>
#include <cstring>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace py = pybind11;
using c10::IValue;
using torch::jit::Stack;

namespace {

// ------------------------------------------------------------------------------------------------
// the CUDA driver, looked up at run time (this file also builds against CPU-only torch)
// ------------------------------------------------------------------------------------------------
typedef int (*launch_fn)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                         void*, void**, void**);
typedef int (*error_fn)(int, const char**);
launch_fn g_cuLaunchKernel = nullptr;
error_fn g_cuGetErrorString = nullptr;
typedef int (*ctx_get_fn)(void**);
typedef int (*ctx_set_fn)(void*);
typedef int (*dev_get_fn)(int*, int);
typedef int (*ctx_retain_fn)(void**, int);
ctx_get_fn g_cuCtxGetCurrent = nullptr;
ctx_set_fn g_cuCtxSetCurrent = nullptr;
dev_get_fn g_cuDeviceGet = nullptr;
ctx_retain_fn g_cuDevicePrimaryCtxRetain = nullptr;
typedef int (*capturing_fn)(void*, int*);
capturing_fn g_cuStreamIsCapturing = nullptr;
typedef int (*memset32_fn)(uint64_t, unsigned, size_t, void*);
typedef int (*memset16_fn)(uint64_t, unsigned short, size_t, void*);
memset32_fn g_cuMemsetD32Async = nullptr;
memset16_fn g_cuMemsetD16Async = nullptr;
// CUtensorMap (cuda.h): 128 opaque bytes, 64-byte aligned, passed to a kernel by value
struct alignas(64) TensorMap {
  uint64_t opaque[16];
};
// cuTensorMapEncodeTiled(map, dtype, rank, address, dims, byte strides (rank - 1), box, element strides,
// interleave, swizzle, L2 promotion, out-of-bounds fill); cuTensorMapReplaceAddress(map, address)
typedef int (*tmap_encode_fn)(TensorMap*, int, unsigned, void*, const uint64_t*, const uint64_t*, const unsigned*,
                              const unsigned*, int, int, int, int);
typedef int (*tmap_address_fn)(TensorMap*, void*);
tmap_encode_fn g_cuTensorMapEncodeTiled = nullptr;
tmap_address_fn g_cuTensorMapReplaceAddress = nullptr;

// A thread that has made no CUDA runtime call yet has no current driver context (torch's autograd
// device threads skip cudaSetDevice for the device that is already "current"), and cuLaunchKernel
// would fail there: make the device's primary context current, as Triton's own launcher does.
void ensure_context(int dev) {
  void* ctx = nullptr;
  if (g_cuCtxGetCurrent(&ctx) == 0 && ctx != nullptr) return;
  int d = 0;
  TORCH_CHECK(g_cuDeviceGet(&d, dev) == 0 && g_cuDevicePrimaryCtxRetain(&ctx, d) == 0 && g_cuCtxSetCurrent(ctx) == 0,
              "gems: cannot make the CUDA context of device ", dev, " current");
}

// the current CUDA stream's cudaStream_t. c10::Stream::native_handle() where this torch implements it
// for CUDA; else c10::cuda::CUDAStream::stream() looked up in libc10_cuda (a CUDAStream is a c10::Stream
// and nothing else, so a c10::Stream is a valid `this`). `init_stream` picks the way that gives what
// torch's own Python binding gives, or none (then no CUDA recipe is taken).
typedef void* (*stream_fn)(const c10::Stream*);
stream_fn g_stream_ptr = nullptr;
int g_stream_mode = 0;   // 0: not initialized / none, 1: native_handle, 2: CUDAStream::stream

bool stream_capturing(void* stream);

// plan.philox_state in C++: (seed, offset) for a launch drawing `increment` Philox counters from the
// default CUDA generator of `dev`, its offset advanced under the generator's lock; the same bases as
// plan.py (PHILOX_SEED_BIT, PHILOX_OFFSET_BASE) so that both paths give the kernel the same values
void philox_state(int dev, uint64_t increment, uint64_t* seed, uint64_t* offset) {
  at::Generator gen = at::globalContext().defaultGenerator(c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(dev)));
  std::lock_guard<std::mutex> lock(gen.mutex());
  uint64_t off = gen.get_offset();
  gen.set_offset(off + increment);
  constexpr uint64_t kSeedBit = uint64_t(1) << 62;
  *seed = (gen.current_seed() & (kSeedBit - 1)) | kSeedBit;
  *offset = off + (uint64_t(1) << 32);
}

void* cuda_stream(int dev) {
  c10::Stream s = c10::impl::getDeviceGuardImpl(c10::kCUDA)->getStream(
      c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(dev)));
  return g_stream_mode == 1 ? s.native_handle() : g_stream_ptr(&s);
}

int init_stream(int dev, uint64_t expected) {
  g_stream_mode = 1;
  try {
    if (reinterpret_cast<uint64_t>(cuda_stream(dev)) == expected) return 1;
  } catch (...) {
  }
  g_stream_mode = 0;
  void* h = dlopen("libc10_cuda.so", RTLD_NOW | RTLD_NOLOAD);
  if (h) g_stream_ptr = (stream_fn)dlsym(h, "_ZNK3c104cuda10CUDAStream6streamEv");
  if (g_stream_ptr) {
    g_stream_mode = 2;
    if (reinterpret_cast<uint64_t>(cuda_stream(dev)) == expected) return 2;
  }
  g_stream_mode = 0;
  return 0;
}

bool load_driver() {
  if (g_cuLaunchKernel) return true;
  void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
  if (!h) return false;
  g_cuLaunchKernel = (launch_fn)dlsym(h, "cuLaunchKernel");
  g_cuGetErrorString = (error_fn)dlsym(h, "cuGetErrorString");
  g_cuCtxGetCurrent = (ctx_get_fn)dlsym(h, "cuCtxGetCurrent");
  g_cuCtxSetCurrent = (ctx_set_fn)dlsym(h, "cuCtxSetCurrent");
  g_cuDeviceGet = (dev_get_fn)dlsym(h, "cuDeviceGet");
  g_cuDevicePrimaryCtxRetain = (ctx_retain_fn)dlsym(h, "cuDevicePrimaryCtxRetain");
  g_cuStreamIsCapturing = (capturing_fn)dlsym(h, "cuStreamIsCapturing");
  g_cuMemsetD32Async = (memset32_fn)dlsym(h, "cuMemsetD32Async");
  g_cuMemsetD16Async = (memset16_fn)dlsym(h, "cuMemsetD16Async");
  g_cuTensorMapEncodeTiled = (tmap_encode_fn)dlsym(h, "cuTensorMapEncodeTiled");
  g_cuTensorMapReplaceAddress = (tmap_address_fn)dlsym(h, "cuTensorMapReplaceAddress");
  if (!g_cuCtxGetCurrent || !g_cuCtxSetCurrent || !g_cuDeviceGet || !g_cuDevicePrimaryCtxRetain) {
    g_cuLaunchKernel = nullptr;
  }
  return g_cuLaunchKernel != nullptr;
}

// torch's CUDA caching allocator where it is registered as the CUDA device's allocator (then an
// output costs no dispatcher round trip); else at::empty_strided
c10::Allocator* cuda_allocator() {
  static c10::Allocator* a = []() -> c10::Allocator* {
    try {
      return c10::GetAllocator(c10::kCUDA);
    } catch (...) {
      return nullptr;
    }
  }();
  return a;
}

// ------------------------------------------------------------------------------------------------
// enabled state (mirrors dispatch.py: enable() sets the global config, use_gems() a thread's own,
// autograd's device threads follow the innermost active scope while a backward pass runs)
// ------------------------------------------------------------------------------------------------
constexpr int kMaxConfigs = 1024;     // configs (distinct include/exclude selections) per process
constexpr int kUnscoped = -2;
std::atomic<int> g_cfg{-1};           // enable()'s config id, -1 when off
std::atomic<int> g_top_scope{-1};     // innermost active use_gems() scope's config, -1 when none
thread_local int t_cfg = kUnscoped;   // this thread's use_gems() config, or kUnscoped
thread_local int t_depth = 0;         // > 0 while this thread runs Python on behalf of a Gems op
std::atomic<bool> g_check{false};     // GEMS_PLAN_CHECK: the first call of a new recipe replays it

// ------------------------------------------------------------------------------------------------
// signatures
// ------------------------------------------------------------------------------------------------
struct Key {
  std::vector<int64_t> words;
  uint64_t hash = 0;
  void finish() {
    uint64_t h = 1469598103934665603ull;
    for (int64_t w : words) {
      h ^= static_cast<uint64_t>(w) + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    }
    hash = h;
  }
};

int64_t bits(double d) {
  int64_t b;
  std::memcpy(&b, &d, sizeof b);
  return b;
}

// the range class of a per-call number (runtime/plan.py: number_range, NUMBER_RANGES): the index of the
// narrowest of nested dtype ranges holding it (int8, uint8 with negative wrap, int16, float16, int32,
// int64, bfloat16, float32), 8 beyond, 9 for +-inf, so that an op's "does it fit the dtype" check
// decides alike for every call of a key
int64_t int_range(int64_t i) {
  static const int64_t lo[] = {-128, -255, -32768, -65504, INT32_MIN};
  static const int64_t hi[] = {127, 255, 32767, 65504, INT32_MAX};
  for (int k = 0; k < 5; k++) {
    if (i >= lo[k] && i <= hi[k]) return k;
  }
  return 5;
}

int64_t float_range(double d) {
  static const double hi[] = {127.0, 255.0, 32767.0, 65504.0, 2147483647.0};
  static const double lo[] = {-128.0, -255.0, -32768.0, -65504.0, -2147483648.0};
  for (int k = 0; k < 5; k++) {
    if (d >= lo[k] && d <= hi[k]) return k;
  }
  if (d >= -9223372036854775808.0 && d < 9223372036854775808.0) return 5;   // int64 (Python: exact)
  double a = std::fabs(d);
  if (a <= 3.3895313892515355e38) return 6;
  if (a <= 3.4028234663852886e38) return 7;
  return std::isinf(a) ? 9 : 8;
}

// a number's part of the key; `dynamic`: by class, sign, range class and NaN-ness (ints: also what
// Triton specializes), else by value -- the facts plan.py's _dyn_sig keys
void key_number(std::vector<int64_t>& w, const IValue& v, bool dynamic) {
  if (v.isDouble()) {
    double d = v.toDouble();
    w.push_back(10);
    // per-call floats key NaN-ness, sign and range (an op's check may send such numbers to ATen)
    // (signbit: -0.0 keys apart from +0.0, like plan.py's _dyn_sig)
    w.push_back(!dynamic ? bits(d) : std::isnan(d) ? -1 : int64_t(std::signbit(d)) | float_range(d) << 1);
  } else if (v.isBool()) {
    w.push_back(11);
    w.push_back(v.toBool());   // passed as 0/1: 1 is specialized
  } else {
    int64_t i = v.toInt();
    w.push_back(12);
    if (dynamic) {
      w.push_back((i == 1) | ((i & 15) == 0) << 1 | int_range(i) << 2 | int64_t((i > 0) ? 1 : (i < 0) ? 2 : 0) << 5);
    } else {
      w.push_back(i);
    }
  }
}

// the Python number a wrapped-number tensor stands for (`x * 2.0` hands the kernel 2.0)
IValue wrapped_value(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kDouble: return IValue(*static_cast<const double*>(t.const_data_ptr()));
    case at::kLong: return IValue(*static_cast<const int64_t*>(t.const_data_ptr()));
    case at::kBool: return IValue(*static_cast<const bool*>(t.const_data_ptr()));
    default: return IValue();   // complex: no key (the full path decides)
  }
}

// ------------------------------------------------------------------------------------------------
// recipes (built by runtime/plan.py from a recorded call; see Op.publish for the format)
// ------------------------------------------------------------------------------------------------
enum ParamKind : int { P_TENSOR = 0, P_CONST = 1, P_DYN = 2, P_PHILOX = 3, P_TMA = 4 };
enum Conv : int { C_RAW = 0, C_FLOAT = 1, C_INT = 2, C_ITEM = 3 };
// kernel parameter types (Triton signature strings mapped by plan.py)
enum PType : int { T_I8 = 0, T_I16 = 1, T_I32 = 2, T_I64 = 3, T_F32 = 4, T_F64 = 5, T_F16 = 6, T_BF16 = 7, T_PTR = 8 };

struct View {     // an as_strided view of a source tensor (interpreter arguments, results)
  bool on = false;
  std::vector<int64_t> sizes, strides;
  int64_t offset = 0;   // elements, added to the source's storage offset
};

struct Param {
  int kind = P_CONST;
  int src = 0, idx = 0;     // P_TENSOR: source (0 argument, 1 allocation) and its index;
                            // P_DYN: argument index
  int64_t byte_off = 0;     // P_TENSOR on CUDA
  View view;                // P_TENSOR under the interpreter
  int type = T_I64;         // CUDA parameter type
  uint64_t payload = 0;     // P_CONST on CUDA: the packed value
  int conv = C_RAW;         // P_DYN; P_PHILOX: 0 the seed, 1 the offset (payload: counters drawn,
                            // idx: the CUDA device whose default generator gives them)
  py::object obj;           // P_CONST under the interpreter
  std::shared_ptr<TensorMap> tmap;   // P_TMA: the descriptor encoded at parse time; per call only the
                                     // address of (src, idx) + byte_off is put in
};

struct Launch {
  bool cuda = true;
  void* function = nullptr;
  unsigned grid[3] = {1, 1, 1};
  unsigned block = 128, shared = 0;
  int device = 0;
  py::object py_launch;     // interpreter: callable(*args)
  std::vector<Param> params;
};

struct Alloc {
  std::vector<int64_t> sizes, strides;
  at::ScalarType dtype;
  c10::Device device{c10::kCPU};
  int fill = 0;   // 0 none, 1 zeros (a workspace), 2 poison (GEMS_POISON test aid: NaN / -1 / true)
};

struct Guard {
  int written, other;
  int64_t written_bytes, other_bytes;
};

// kernel parameters one replayed launch may pass (plan.py's _CPP_MAX_PARAMS: larger launches get no recipe;
// cat_uniform_kernel's 64 input slots and its geometry fit)
constexpr size_t kMaxParams = 128;
// tensors (list elements included) a call's key may hold: a call with more runs the Python kernel
constexpr int kMaxKeyTensors = 128;
// a guard's `other` at or above this names a tensor-list element: kListRef + (arg << 20 | element)
constexpr int kListRef = 1 << 30;

struct Result {
  int src = 0, idx = 0;   // src 2: an undefined tensor; 4: the constant int `value`
  int64_t value = 0;
  View view;
};

struct Recipe {
  int aten = -1;   // >= 0: the signature's plan is ATen's kernel, counted under reason `aten`
  std::vector<Guard> guards;
  std::vector<Alloc> allocs;
  std::vector<Launch> launches;
  std::vector<Result> results;
  bool random = false;   // a launch takes per-call Philox state: declined while the stream is captured
};

template <typename T>
std::vector<T> vec(py::handle h) {
  std::vector<T> out;
  for (auto x : h) out.push_back(x.cast<T>());
  return out;
}

View parse_view(py::handle h) {
  View v;
  if (h.is_none()) return v;
  auto t = h.cast<py::tuple>();
  v.on = true;
  v.sizes = vec<int64_t>(t[0]);
  v.strides = vec<int64_t>(t[1]);
  v.offset = t[2].cast<int64_t>();
  return v;
}

// TMA descriptors one replayed launch may pass (a GEMM passes 3)
constexpr int kMaxTma = 8;

// A TMA descriptor as Triton's launcher encodes it (driver.c fillTMADescriptor), from plan.py's
// (address, data type, dims, byte strides (rank - 1), box, swizzle, out-of-bounds fill), dims, strides
// and box innermost first; no interleave, unit element strides, 128-byte L2 promotion. A replay
// copies it and puts in the call's address: the rest is a function of the call's signature.
std::shared_ptr<TensorMap> encode_tensor_map(py::handle h) {
  TORCH_CHECK(load_driver() && g_cuTensorMapEncodeTiled && g_cuTensorMapReplaceAddress,
              "gems: this CUDA driver cannot encode tensor maps");
  auto t = h.cast<py::tuple>();
  auto dims = vec<uint64_t>(t[2]);
  auto strides = vec<uint64_t>(t[3]);
  auto box = vec<unsigned>(t[4]);
  size_t rank = dims.size();
  TORCH_CHECK(rank >= 1 && rank <= 5 && box.size() == rank && strides.size() + 1 == rank,
              "gems: malformed tensor map in a recipe");
  unsigned element_strides[5] = {1, 1, 1, 1, 1};
  TensorMap m;   // encoded in aligned storage (the driver requires 64 bytes), kept by copy
  int err = g_cuTensorMapEncodeTiled(&m, t[1].cast<int>(), static_cast<unsigned>(rank),
                                     reinterpret_cast<void*>(t[0].cast<uint64_t>()), dims.data(), strides.data(),
                                     box.data(), element_strides, /*interleave none*/ 0, t[5].cast<int>(),
                                     /*L2 promotion 128B*/ 2, t[6].cast<int>());
  if (err != 0) {
    const char* msg = "unknown";
    if (g_cuGetErrorString) g_cuGetErrorString(err, &msg);
    TORCH_CHECK(false, "gems: cuTensorMapEncodeTiled failed for a recipe: ", msg);
  }
  return std::make_shared<TensorMap>(m);
}

std::shared_ptr<Recipe> parse_recipe(py::handle r) {
  auto rec = std::make_shared<Recipe>();
  auto t = r.cast<py::tuple>();
  for (auto g : t[0]) {
    auto gt = g.cast<py::tuple>();
    rec->guards.push_back({gt[0].cast<int>(), gt[1].cast<int>(), gt[2].cast<int64_t>(), gt[3].cast<int64_t>()});
  }
  for (auto a : t[1]) {
    auto at_ = a.cast<py::tuple>();
    Alloc al;
    al.sizes = vec<int64_t>(at_[0]);
    al.strides = vec<int64_t>(at_[1]);
    TORCH_CHECK(THPDtype_Check(at_[2].ptr()), "gems: recipe allocation without a dtype");
    al.dtype = reinterpret_cast<THPDtype*>(at_[2].ptr())->scalar_type;
    al.device = c10::Device(at_[3].cast<std::string>());
    al.fill = at_[4].cast<int>();
    rec->allocs.push_back(std::move(al));
  }
  for (auto l : t[2]) {
    auto lt = l.cast<py::tuple>();
    Launch L;
    L.cuda = lt[0].cast<int>() == 0;
    if (L.cuda) {
      L.function = reinterpret_cast<void*>(lt[1].cast<uint64_t>());
      auto g = lt[2].cast<py::tuple>();
      for (int i = 0; i < 3; i++) L.grid[i] = g[i].cast<unsigned>();
      L.block = lt[3].cast<unsigned>();
      L.shared = lt[4].cast<unsigned>();
      L.device = lt[5].cast<int>();
    } else {
      L.py_launch = py::reinterpret_borrow<py::object>(lt[1]);
    }
    int n_tma = 0;
    for (auto p : lt[6]) {
      auto pt = p.cast<py::tuple>();
      Param P;
      P.kind = pt[0].cast<int>();
      if (P.kind == P_TENSOR) {
        P.src = pt[1].cast<int>();
        P.idx = pt[2].cast<int>();
        P.byte_off = pt[3].cast<int64_t>();
        P.view = parse_view(pt[4]);
      } else if (P.kind == P_CONST) {
        if (L.cuda) {
          P.type = pt[1].cast<int>();
          P.payload = pt[2].cast<uint64_t>();
        } else {
          P.obj = py::reinterpret_borrow<py::object>(pt[2]);
        }
      } else if (P.kind == P_TMA) {
        P.src = pt[1].cast<int>();
        P.idx = pt[2].cast<int>();
        P.byte_off = pt[3].cast<int64_t>();
        P.tmap = encode_tensor_map(pt[4]);
        n_tma++;
      } else if (P.kind == P_PHILOX) {
        P.conv = pt[1].cast<int>();
        P.payload = pt[2].cast<uint64_t>();
        P.idx = pt[3].cast<int>();
        P.type = T_I64;
        rec->random = true;
      } else {
        P.idx = pt[1].cast<int>();
        P.conv = pt[2].cast<int>();
        P.type = pt[3].cast<int>();
      }
      L.params.push_back(std::move(P));
    }
    TORCH_CHECK(n_tma <= kMaxTma, "gems: a recipe launch with more than ", kMaxTma, " tensor maps");
    rec->launches.push_back(std::move(L));
  }
  for (auto res : t[3]) {
    auto rt = res.cast<py::tuple>();
    Result R;
    R.src = rt[0].cast<int>();
    if (R.src == 4) {
      R.value = rt[1].cast<int64_t>();
    } else {
      R.idx = rt[1].cast<int>();
      R.view = parse_view(rt[2]);
    }
    rec->results.push_back(std::move(R));
  }
  return rec;
}

// a per-call number (dynamic argument) as double or int64
struct Num {
  bool is_float;
  double d;
  int64_t i;
};

Num read_number(const IValue& v, int conv) {
  Num n{false, 0.0, 0};
  if (v.isTensor()) {   // a wrapped number or a CPU 0-dim tensor (`.item()`)
    const at::Tensor& t = v.toTensor();
    if (at::isFloatingType(t.scalar_type())) {
      n.is_float = true;
      n.d = t.item().toDouble();
    } else {
      n.i = t.item().toLong();
    }
  } else if (v.isDouble()) {
    n.is_float = true;
    n.d = v.toDouble();
  } else if (v.isBool()) {
    n.i = v.toBool();
  } else {
    n.i = v.toInt();
  }
  if (conv == C_FLOAT && !n.is_float) {
    n.is_float = true;
    n.d = static_cast<double>(n.i);
  } else if (conv == C_INT && n.is_float) {
    n.is_float = false;
    n.i = static_cast<int64_t>(n.d);
  }
  return n;
}

uint64_t pack(const Num& n, int type) {
  uint64_t out = 0;
  switch (type) {
    case T_F32: {
      float f = static_cast<float>(n.is_float ? n.d : static_cast<double>(n.i));
      std::memcpy(&out, &f, 4);
      break;
    }
    case T_F64: {
      double d = n.is_float ? n.d : static_cast<double>(n.i);
      std::memcpy(&out, &d, 8);
      break;
    }
    case T_F16: {
      c10::Half h(static_cast<float>(n.is_float ? n.d : static_cast<double>(n.i)));
      std::memcpy(&out, &h, 2);
      break;
    }
    case T_BF16: {
      c10::BFloat16 h(static_cast<float>(n.is_float ? n.d : static_cast<double>(n.i)));
      std::memcpy(&out, &h, 2);
      break;
    }
    default: {
      int64_t i = n.is_float ? static_cast<int64_t>(n.d) : n.i;
      std::memcpy(&out, &i, 8);   // little endian: the low bytes are the narrower types
    }
  }
  return out;
}

py::object num_to_py(const Num& n) {
  return n.is_float ? py::object(py::float_(n.d)) : py::object(py::int_(n.i));
}

// ------------------------------------------------------------------------------------------------
// one served overload
// ------------------------------------------------------------------------------------------------
// a _foreach_* overload served whole from here (see the foreach section below): where its tensor
// lists and its number are on the stack, and the binaries it launched (one per binary facts)
enum ForeachScalar : int { FS_NONE = 0, FS_SCALAR = 1, FS_LIST = 2, FS_TENSOR = 3 };
struct ForeachDtype {
  at::ScalarType dtype;
  int64_t range_limit;   // the widest number range class that fits (generator.number_misfit)
  double max_finite;     // a ScalarList's values must lie within +-this (foreach._number_list)
};
struct ForeachSpec {
  std::vector<int> lists;   // schema argument indices of the kernel's input lists, in order
  int scalar = -1, skind = FS_NONE, alpha = -1;
  bool inplace = true;
  bool poison = false;      // GEMS_POISON (a test aid): functional results start as NaN
  std::vector<ForeachDtype> dtypes;
};
// the kernel parameters of foreach_kernel, in its order (ops/foreach.py)
enum ForeachRole : int { R_BASE = 0, R_TAB, R_N, R_TOP, R_LOGN, R_B0, R_S, R_ALPHA, R_SPTR, R_S0, R_COUNT };
struct ForeachLaunch {
  bool cuda = true;
  void* function = nullptr;
  unsigned block = 128, shared = 0;
  int64_t chunk = 4096;                      // the binary's CHUNK (the table is cut by it)
  std::vector<std::pair<int, int>> params;   // (role, PType) of the non-constexpr parameters
  py::object py_launch;                      // interpreter: callable(programs, *the ten arguments)
};

struct Op;
struct Pending {           // the key a Python-kernel call may publish a recipe for
  Op* op = nullptr;
  const Key* key = nullptr;
  bool replay = false;     // GEMS_PLAN_CHECK: answer this call from the recipe just published
};
thread_local Pending t_pending;

struct Op : std::enable_shared_from_this<Op> {
  std::string name;
  py::object py_kernel;            // dispatch.py's Python kernel for this overload
  std::vector<uint8_t> dynamic;    // per schema argument: numbers keyed by class
  bool precision_key = false;      // GEMM: the key includes the fp32 matmul precision
  std::vector<uint8_t> member = std::vector<uint8_t>(kMaxConfigs, 0);  // config id -> served
  std::atomic<int64_t> hits{0};
  // ATen's kernel at this key as it was before Gems registered (replays of ATen decisions call it),
  // the reasons of those decisions and how many calls each sent there
  std::optional<c10::SafeKernelFunction> aten_kernel;
  static constexpr int kMaxReasons = 16;
  std::vector<std::string> aten_reasons;
  std::atomic<int64_t> aten_counts[kMaxReasons] = {};
  std::mutex mu;
  std::unordered_map<uint64_t, std::vector<std::pair<std::vector<int64_t>, std::shared_ptr<Recipe>>>> plans;
  std::shared_ptr<ForeachSpec> fe;   // a _foreach_* overload: served by foreach_serve
  std::vector<std::pair<std::vector<int64_t>, std::shared_ptr<ForeachLaunch>>> fe_launches;
  size_t count = 0;
  static constexpr size_t kMaxPlans = 512;

  std::shared_ptr<Recipe> find(const Key& k) {
    std::lock_guard<std::mutex> g(mu);
    auto it = plans.find(k.hash);
    if (it == plans.end()) return nullptr;
    for (auto& e : it->second) {
      if (e.first == k.words) return e.second;
    }
    return nullptr;
  }

  void put(const Key& k, std::shared_ptr<Recipe> r) {
    std::lock_guard<std::mutex> g(mu);
    if (count >= kMaxPlans) {   // an op seeing this many signatures: start over
      plans.clear();
      count = 0;
    }
    auto& bucket = plans[k.hash];
    for (auto& e : bucket) {
      if (e.first == k.words) {
        e.second = std::move(r);
        return;
      }
    }
    bucket.emplace_back(k.words, std::move(r));
    count++;
  }

  void clear() {
    std::lock_guard<std::mutex> g(mu);
    plans.clear();
    fe_launches.clear();
    count = 0;
  }

  std::shared_ptr<ForeachLaunch> find_launch(const std::vector<int64_t>& facts) {
    std::lock_guard<std::mutex> g(mu);
    for (auto& e : fe_launches) {
      if (e.first == facts) return e.second;
    }
    return nullptr;
  }

  size_t size() {
    std::lock_guard<std::mutex> g(mu);
    return count;
  }

  // which config serves this call, or -1 (Python decides: off, not served, or a case not mirrored)
  bool served() const {
    int cfg = t_cfg;
    if (cfg == kUnscoped) {
      cfg = g_cfg.load(std::memory_order_relaxed);
      if (cfg < 0) {
        int top = g_top_scope.load(std::memory_order_relaxed);
        if (top < 0 || torch::autograd::get_current_graph_task_id() == -1) return false;
        cfg = top;
      }
    }
    return cfg >= 0 && cfg < kMaxConfigs && member[cfg];
  }

  // a tensor's part of the key: dtype, device, sizes, strides, 16-byte alignment
  static bool key_tensor(std::vector<int64_t>& w, const at::Tensor& t, c10::TensorImpl** impls, int& n_impls) {
    c10::TensorImpl* ti = t.unsafeGetTensorImpl();
    if (t.layout() != c10::kStrided || t.is_conj() || t.is_neg() || ti->has_symbolic_sizes_strides()) return false;
    w.push_back(1);
    w.push_back(static_cast<int64_t>(t.scalar_type()));
    w.push_back(static_cast<int64_t>(t.device().type()) << 16 | (t.device().index() + 1));
    auto sizes = t.sizes();
    auto strides = t.strides();
    w.push_back(static_cast<int64_t>(sizes.size()));
    w.insert(w.end(), sizes.begin(), sizes.end());
    w.insert(w.end(), strides.begin(), strides.end());
    w.push_back(reinterpret_cast<uintptr_t>(t.const_data_ptr()) & 15);
    if (n_impls == kMaxKeyTensors) return false;
    impls[n_impls++] = ti;
    return true;
  }

  bool make_key(const Stack& stack, size_t n, Key& key) const {
    auto& w = key.words;
    w.clear();
    const IValue* args = stack.data() + stack.size() - n;
    c10::TensorImpl* impls[kMaxKeyTensors];
    int n_impls = 0;
    for (size_t i = 0; i < n; i++) {
      const IValue& v = args[i];
      bool dyn = dynamic[i];
      if (v.isTensor()) {
        const at::Tensor& t = v.toTensor();
        if (!t.defined()) {   // an optional tensor autograd passes as undefined: None to the kernel
          w.push_back(2);
          continue;
        }
        c10::TensorImpl* ti = t.unsafeGetTensorImpl();
        if (ti->is_wrapped_number()) {
          IValue num = wrapped_value(t);
          if (num.isNone()) return false;
          key_number(w, num, dyn);
          continue;
        }
        if (!key_tensor(w, t, impls, n_impls)) return false;
      } else if (v.isTensorList()) {
        // a tensor list (cat's `tensors`): its length, then each element as a tensor argument; the
        // elements join the aliasing pattern after the tensors before them (dispatch.py's order:
        // top-level tensors first, then list elements — the pattern only needs to be a function of
        // the call, and this one is finer than or equal to Python's)
        auto l = v.toListRef();
        w.push_back(7);
        w.push_back(static_cast<int64_t>(l.size()));
        for (const auto& e : l) {
          if (!e.isTensor() || !e.toTensor().defined()) return false;
          if (!key_tensor(w, e.toTensor(), impls, n_impls)) return false;
        }
      } else if (v.isNone()) {
        w.push_back(2);
      } else if (v.isDouble() || v.isInt() || v.isBool()) {
        key_number(w, v, dyn);
      } else if (v.isIntList()) {
        auto l = v.toIntList();
        w.push_back(3);
        w.push_back(static_cast<int64_t>(l.size()));
        for (int64_t x : l) w.push_back(x);
      } else if (v.isBoolList()) {
        auto l = v.toBoolList();
        w.push_back(4);
        w.push_back(static_cast<int64_t>(l.size()));
        for (bool x : l) w.push_back(x);
      } else if (v.isString()) {
        auto s = v.toStringRef();
        w.push_back(5);
        w.push_back(static_cast<int64_t>(s.size()));
        for (size_t j = 0; j < s.size(); j += 8) {
          int64_t chunk = 0;
          std::memcpy(&chunk, s.data() + j, std::min<size_t>(8, s.size() - j));
          w.push_back(chunk);
        }
      } else if (v.isDevice()) {
        auto d = v.toDevice();
        w.push_back(6);
        w.push_back(static_cast<int64_t>(d.type()) << 16 | (d.index() + 1));
      } else {
        return false;   // tensor lists, generators, ...
      }
    }
    // which tensor arguments are the same tensor (a plan maps kernel arguments to positions): up to 11
    // tensors one bit per pair; more (a cat or stack of many inputs), per tensor the index of its first
    // equal, as words (the key only needs to be a function of the call's aliasing)
    if (n_impls <= 11) {
      int64_t same = 0;
      int bit = 0;
      for (int a = 0; a < n_impls; a++) {
        for (int b = a + 1; b < n_impls; b++, bit++) {
          if (impls[a] == impls[b]) same |= int64_t(1) << bit;
        }
      }
      w.push_back(same);
    } else {
      for (int a = 1; a < n_impls; a++) {
        for (int b = 0; b < a; b++) {
          if (impls[a] == impls[b]) {
            w.push_back(int64_t(a) << 16 | b);
            break;
          }
        }
      }
      w.push_back(-1);
    }
    w.push_back(current_device());
    // int -> float promotions (true division, exp of ints, int tensor + 1.5) follow the default dtype
    w.push_back(static_cast<int64_t>(c10::typeMetaToScalarType(c10::get_default_dtype())));
    if (precision_key) {
      w.push_back(static_cast<int64_t>(at::globalContext().float32MatmulPrecision()));
    }
    key.finish();
    return true;
  }

  // a tensor-list element named in a recipe: (schema argument index << 20) | element index
  static const IValue& list_element(const IValue* args, int ref) {
    return args[ref >> 20].toListRef()[ref & 0xFFFFF];
  }

  static int64_t current_device() {
    static const bool has_cuda = c10::impl::hasDeviceGuardImpl(c10::kCUDA);
    if (!has_cuda) return -1;
    return c10::impl::getDeviceGuardImpl(c10::kCUDA)->getDevice().index();
  }

  // the recipe's answer for the call on top of the stack; false: it declines (the caller goes on
  // to the Python kernel with the stack untouched)
  bool run(const Recipe& r, Stack& stack, size_t n) {
    const IValue* args = stack.data() + stack.size() - n;
    if (r.random && !r.launches.empty() && stream_capturing(cuda_stream(r.launches[0].device))) return false;
    for (const auto& g : r.guards) {
      const auto& a = args[g.written];
      const IValue& b = g.other >= kListRef ? list_element(args, g.other - kListRef) : args[g.other];
      if (!a.isTensor() || !b.isTensor() || !a.toTensor().defined() || !b.toTensor().defined()) continue;
      auto pa = reinterpret_cast<uintptr_t>(a.toTensor().const_data_ptr());
      auto pb = reinterpret_cast<uintptr_t>(b.toTensor().const_data_ptr());
      if (pa < pb + g.other_bytes && pb < pa + g.written_bytes) return false;
    }
    c10::SmallVector<at::Tensor, 4> outs;
    for (const auto& a : r.allocs) {
      at::Tensor t;
      if (a.device.is_cuda() && a.device.index() == Op::current_device() && cuda_allocator()) {
        t = at::detail::empty_strided_generic(a.sizes, a.strides, cuda_allocator(),
                                              c10::DispatchKeySet(c10::DispatchKey::CUDA), a.dtype);
      } else {
        t = at::empty_strided(a.sizes, a.strides, at::TensorOptions().dtype(a.dtype).device(a.device));
      }
      if (a.fill == 1) {
        t.zero_();
      } else if (a.fill == 2) {
        // ATen's fill kernel itself, not a dispatcher call: Gems' own fill_ would serve that, and the
        // test aid would count as a launch of the op under test
        if (at::isFloatingType(a.dtype) || at::isComplexType(a.dtype)) {
          at::native::fill_(t, std::numeric_limits<double>::quiet_NaN());
        } else {
          at::native::fill_(t, a.dtype == at::kBool ? 1 : -1);
        }
      }
      outs.push_back(std::move(t));
    }
    auto source = [&](int src, int idx) -> const at::Tensor& {
      if (src == 3) return list_element(args, idx).toTensor();
      return src == 0 ? args[idx].toTensor() : outs[idx];
    };
    for (const auto& L : r.launches) {
      if (L.cuda) {
        uint64_t storage[kMaxParams];
        void* params[kMaxParams + 2];
        size_t np = L.params.size();
        TORCH_CHECK(np <= kMaxParams, "gems fast path: too many kernel parameters");   // plan.py keeps such plans in Python
        uint64_t philox_seed = 0, philox_offset = 0;
        TensorMap maps[kMaxTma];
        int n_maps = 0;
        for (size_t i = 0; i < np; i++) {
          const Param& P = L.params[i];
          if (P.kind == P_TMA) {
            // the signature's descriptor with this call's address; a 128-byte parameter by value
            TensorMap& m = maps[n_maps++];
            m = *P.tmap;
            auto addr = reinterpret_cast<uintptr_t>(source(P.src, P.idx).const_data_ptr()) + P.byte_off;
            int err = g_cuTensorMapReplaceAddress(&m, reinterpret_cast<void*>(addr));
            TORCH_CHECK(err == 0, "gems: cuTensorMapReplaceAddress failed for aten::", name, " (error ", err, ")");
            params[i] = &m;
            continue;
          }
          if (P.kind == P_TENSOR) {
            storage[i] = reinterpret_cast<uintptr_t>(source(P.src, P.idx).const_data_ptr()) + P.byte_off;
          } else if (P.kind == P_CONST) {
            storage[i] = P.payload;
          } else if (P.kind == P_PHILOX) {
            if (P.conv == 0) philox_state(P.idx, P.payload, &philox_seed, &philox_offset);
            storage[i] = P.conv == 0 ? philox_seed : philox_offset;
          } else {
            storage[i] = pack(read_number(args[P.idx], P.conv), P.type);
          }
          params[i] = &storage[i];
        }
        uint64_t scratch[2] = {0, 0};   // Triton's global and profile scratch pointers (unused)
        params[np] = &scratch[0];
        params[np + 1] = &scratch[1];
        if (L.grid[0] * L.grid[1] * L.grid[2] == 0) continue;
        void* stream = cuda_stream(L.device);
        ensure_context(L.device);
        int err = g_cuLaunchKernel(L.function, L.grid[0], L.grid[1], L.grid[2], L.block, 1, 1, L.shared, stream,
                                   params, nullptr);
        if (err != 0) {
          const char* msg = "unknown";
          if (g_cuGetErrorString) g_cuGetErrorString(err, &msg);
          TORCH_CHECK(false, "gems: cuLaunchKernel failed for aten::", name, ": ", msg);
        }
      } else {
        // the interpreter: Triton's Python launch, with tensors and Python numbers
        py::gil_scoped_acquire gil;
        py::tuple pargs(L.params.size());
        for (size_t i = 0; i < L.params.size(); i++) {
          const Param& P = L.params[i];
          py::object o;
          if (P.kind == P_TENSOR) {
            const at::Tensor& base = source(P.src, P.idx);
            at::Tensor t = P.view.on ? base.as_strided(P.view.sizes, P.view.strides,
                                                       base.storage_offset() + P.view.offset)
                                     : base;
            o = py::reinterpret_steal<py::object>(THPVariable_Wrap(t));
          } else if (P.kind == P_CONST) {
            o = P.obj;
          } else {
            o = num_to_py(read_number(args[P.idx], P.conv));
          }
          pargs[i] = o;
        }
        t_depth++;
        PyObject* res = PyObject_CallObject(L.py_launch.ptr(), pargs.ptr());
        t_depth--;
        if (!res) throw python_error();
        Py_DECREF(res);
      }
    }
    c10::SmallVector<IValue, 4> results;
    for (const auto& R : r.results) {
      if (R.src == 2) {   // a result not asked for (a backward's output mask): undefined, as ATen's
        results.emplace_back(at::Tensor());
        continue;
      }
      if (R.src == 4) {   // an int result that only the keyed shapes decide (attention's max_q)
        results.emplace_back(R.value);
        continue;
      }
      const at::Tensor& base = source(R.src, R.idx);
      results.emplace_back(R.view.on ? base.as_strided(R.view.sizes, R.view.strides,
                                                       base.storage_offset() + R.view.offset)
                                     : base);
    }
    torch::jit::drop(stack, n);
    for (auto& v : results) stack.push_back(std::move(v));
    return true;
  }

  void call_python(const c10::OperatorHandle& op, Stack* stack, const Key* key) {
    const auto& schema = op.schema();
    size_t n = schema.arguments().size();
    std::vector<IValue> saved;
    if (key != nullptr && g_check.load(std::memory_order_relaxed)) {
      saved.assign(stack->end() - n, stack->end());
    }
    Pending prev = t_pending;
    t_pending = Pending{key ? this : nullptr, key, false};
    t_depth++;
    try {
      py::gil_scoped_acquire gil;
      auto arguments = torch::jit::pop(*stack, n);
      call_py(op, schema, arguments, stack);
    } catch (...) {
      t_depth--;
      t_pending = prev;
      throw;
    }
    t_depth--;
    bool replay = t_pending.replay;
    t_pending = prev;
    if (replay && !saved.empty()) {
      // GEMS_PLAN_CHECK: the Python side restored what the call wrote; answer from the new recipe
      auto r = find(*key);
      torch::jit::drop(*stack, schema.returns().size());
      for (auto& v : saved) stack->push_back(v);
      if (r && run(*r, *stack, n)) return;
      auto arguments = torch::jit::pop(*stack, n);
      t_depth++;
      try {
        py::gil_scoped_acquire gil;
        call_py(op, schema, arguments, stack);
      } catch (...) {
        t_depth--;
        throw;
      }
      t_depth--;
    }
  }

  // the Python kernel, called as torch.library calls a Python kernel (same args/kwargs split)
  void call_py(const c10::OperatorHandle& op, const c10::FunctionSchema& schema, std::vector<IValue>& arguments,
               Stack* stack) {
    const auto& sargs = schema.arguments();
    size_t n = arguments.size();
    size_t kw_start = n;
    while (kw_start > 0 && sargs[kw_start - 1].kwarg_only()) kw_start--;
    auto is_default = [&](size_t i) {
      const auto& d = sargs[i].default_value();
      return d.has_value() && !(*d != arguments[i]);
    };
    size_t npos = kw_start;
    while (npos > 0 && is_default(npos - 1)) npos--;
    auto to_py = [&](size_t i) -> py::object {
      const IValue& v = arguments[i];
      if (v.isNone()) return py::none();
      auto kind = sargs[i].real_type()->kind();
      if (auto opt = sargs[i].real_type()->cast<c10::OptionalType>()) kind = opt->getElementType()->kind();
      if (kind == c10::ScalarTypeType::Kind) {
        return py::reinterpret_borrow<py::object>(
            reinterpret_cast<PyObject*>(torch::getTHPDtype(static_cast<at::ScalarType>(v.toInt()))));
      }
      if (kind == c10::LayoutType::Kind) {
        return py::reinterpret_borrow<py::object>(
            reinterpret_cast<PyObject*>(torch::getTHPLayout(static_cast<at::Layout>(v.toInt()))));
      }
      if (kind == c10::MemoryFormatType::Kind) {
        return py::reinterpret_borrow<py::object>(
            torch::utils::getTHPMemoryFormat(static_cast<at::MemoryFormat>(v.toInt())));
      }
      return torch::jit::toPyObject(v);
    };
    py::tuple args(npos);
    for (size_t i = 0; i < npos; i++) args[i] = to_py(i);
    py::dict kwargs;
    for (size_t i = kw_start; i < n; i++) {
      if (!is_default(i)) kwargs[py::str(sargs[i].name())] = to_py(i);
    }
    PyObject* res = PyObject_Call(py_kernel.ptr(), args.ptr(), kwargs.ptr());
    if (!res) throw python_error();
    py::object out = py::reinterpret_steal<py::object>(res);
    const auto& rets = schema.returns();
    if (rets.empty()) {
      TORCH_CHECK(out.is_none(), "gems: aten::", name, " returned a value where its schema has none");
    } else if (rets.size() == 1) {
      stack->push_back(torch::jit::toIValue(out, rets[0].real_type()));
    } else {
      auto seq = py::cast<py::sequence>(out);
      for (size_t i = 0; i < rets.size(); i++) stack->push_back(torch::jit::toIValue(seq[i], rets[i].real_type()));
    }
  }
};

thread_local Key t_key;

// a _foreach_* call (see the foreach section)
struct ForeachPending {    // the binary facts a Python-kernel call may publish a launch for
  Op* op = nullptr;
  std::vector<int64_t> facts;
};
thread_local ForeachPending t_fpending;
bool foreach_serve(Op& o, Stack& stack, size_t n, std::vector<int64_t>& miss);

// the boxed kernel the dispatcher calls
struct Kernel final : c10::OperatorKernel {
  std::shared_ptr<Op> op;
  explicit Kernel(std::shared_ptr<Op> o) : op(std::move(o)) {}

  void operator()(const c10::OperatorHandle& h, c10::DispatchKeySet ks, Stack* stack) {
    Op& o = *op;
    if (t_depth > 0 || !o.served()) {
      o.call_python(h, stack, nullptr);
      return;
    }
    size_t n = h.schema().arguments().size();
    if (o.fe) {
      std::vector<int64_t> miss;
      if (foreach_serve(o, *stack, n, miss)) {
        o.hits.fetch_add(1, std::memory_order_relaxed);
        return;
      }
      if (miss.empty()) {
        o.call_python(h, stack, nullptr);
        return;
      }
      // served but not yet compiled: the Python kernel launches it and publishes the binary
      ForeachPending prev = std::move(t_fpending);
      t_fpending = ForeachPending{&o, std::move(miss)};
      try {
        o.call_python(h, stack, nullptr);
      } catch (...) {
        t_fpending = std::move(prev);
        throw;
      }
      t_fpending = std::move(prev);
      return;
    }
    Key& key = t_key;
    if (!o.make_key(*stack, n, key)) {
      o.call_python(h, stack, nullptr);
      return;
    }
    if (auto r = o.find(key)) {
      if (r->aten >= 0) {   // a recorded decision for ATen's kernel (Unsupported(signature=True))
        o.aten_counts[r->aten].fetch_add(1, std::memory_order_relaxed);
        o.aten_kernel->callBoxed(h, ks, stack);
        return;
      }
      if (o.run(*r, *stack, n)) {
        o.hits.fetch_add(1, std::memory_order_relaxed);
        return;
      }
      o.call_python(h, stack, nullptr);   // declined (overlapping out=/in-place): the full path
      return;
    }
    Key mine = key;   // the thread-local one is reused by nested calls
    o.call_python(h, stack, &mine);
  }
};

// registrations: one torch::Library fragment per register() call; destroying it restores what was
// registered underneath (the Python kernels)
std::vector<std::unique_ptr<torch::Library>> g_libs;


// ------------------------------------------------------------------------------------------------
// _foreach_* ops (ops/foreach.py): the per-call work over a call's tensor lists in C++, which Python
// would do at about 1 us per tensor and list: `foreach_lists` checks that one launch serves the
// lists (list 0's dtype and device throughout, contiguous tensors, list 0's shapes; the reasons and
// their order are foreach.uniform_lists'); `foreach_table` checks in-place operands for overlaps
// (foreach._overlap) and writes the launch's table (foreach.table) as bytes.
// ------------------------------------------------------------------------------------------------
std::vector<std::vector<const at::Tensor*>> tensor_lists(const py::list& lists, const char* what) {
  std::vector<std::vector<const at::Tensor*>> ts(lists.size());
  for (size_t l = 0; l < lists.size(); l++) {
    py::handle lst = lists[l];
    if (!PyList_Check(lst.ptr()) && !PyTuple_Check(lst.ptr())) throw py::type_error(std::string(what) + ": lists of tensors");
    py::sequence seq = py::reinterpret_borrow<py::sequence>(lst);
    for (py::handle o : seq) {
      if (!THPVariable_Check(o.ptr())) throw py::type_error(std::string(what) + ": lists of tensors");
      ts[l].push_back(&THPVariable_Unpack(o.ptr()));
    }
  }
  return ts;
}

py::object foreach_lists(const py::list& lists) {
  auto ts = tensor_lists(lists, "foreach_lists");
  const auto& first = ts[0];
  size_t n = first.size();
  if (n == 0) return py::str("empty tensor list");
  auto dtype = first[0]->scalar_type();
  auto device = first[0]->device();
  for (size_t l = 0; l < ts.size(); l++) {
    const auto& v = ts[l];
    if (v.size() != n) return py::str("tensor lists of different lengths");
    for (auto* t : v) if (t->scalar_type() != dtype) return py::str("tensors of different dtypes");
    for (auto* t : v) if (t->device() != device) return py::str("tensors on different devices");
    for (auto* t : v) if (!t->is_contiguous()) return py::str("non-contiguous tensor");
    if (l > 0) {
      for (size_t i = 0; i < n; i++) if (v[i]->sizes() != first[i]->sizes()) return py::str("tensors of different shapes");
    }
  }
  return py::none();
}

// Whether in-place operands race (foreach._overlap, the same rules): list 0 is written; lists
// 1..n_in-1 and `own` (address_i, size) are read at position i only, so the same memory at the same
// position is safe; `shared` (address, bytes) is read by every program.
bool foreach_overlap(const std::vector<std::vector<int64_t>>& ptr, size_t n_in, const std::vector<int64_t>& nbytes,
                     const std::vector<int64_t>* own, int64_t own_size, int64_t shared_ptr, int64_t shared_bytes) {
  using Iv = std::pair<int64_t, int64_t>;
  size_t n = nbytes.size();
  std::vector<Iv> written, reads;
  for (size_t i = 0; i < n; i++) if (nbytes[i]) written.emplace_back(ptr[0][i], ptr[0][i] + nbytes[i]);
  std::sort(written.begin(), written.end());
  if (std::adjacent_find(written.begin(), written.end()) != written.end()) return true;   // a tensor written twice
  for (size_t l = 1; l < n_in; l++) {
    for (size_t i = 0; i < n; i++) {
      if (nbytes[i] && ptr[l][i] != ptr[0][i]) reads.emplace_back(ptr[l][i], ptr[l][i] + nbytes[i]);
    }
  }
  if (own != nullptr && own_size) {
    for (size_t i = 0; i < n; i++) {
      if ((*own)[i] != ptr[0][i] || own_size != nbytes[i]) reads.emplace_back((*own)[i], (*own)[i] + own_size);
    }
  }
  if (shared_bytes) reads.emplace_back(shared_ptr, shared_ptr + shared_bytes);
  std::sort(reads.begin(), reads.end());
  reads.erase(std::unique(reads.begin(), reads.end()), reads.end());
  std::vector<Iv> all;
  std::set_union(written.begin(), written.end(), reads.begin(), reads.end(), std::back_inserter(all));
  if (all.size() != written.size() + reads.size()) return true;   // memory read elsewhere than it is written
  for (size_t k = 1; k < all.size(); k++) if (all[k - 1].second > all[k].first) return true;
  return false;
}

// The launch's table (ops/foreach.py): [S_0 .. S_{N-1} | row_i = (n_i, address_i in each column of
// ptr, extra_i ..)] as int64 bytes. ptr: per column (the input lists, then the results' list of a
// functional variant) the N addresses; numel: list 0's element counts; extra: further columns of N
// int64 (a ScalarList's float64 bits, the addresses of per-tensor 0-dim tensors).
struct ForeachTable {
  std::string bytes;   // `head` words of the caller's (a cache key's header), then the table
  size_t head = 0;
  int64_t total = 0;   // programs
  int64_t base = -1;   // the first tensor with elements (the kernel's Base)
  size_t table_bytes() const { return bytes.size() - head * sizeof(int64_t); }
  const char* table() const { return bytes.data() + head * sizeof(int64_t); }
};

void build_table(const std::vector<std::vector<int64_t>>& ptr, const std::vector<int64_t>& numel,
                 const std::vector<const char*>& extra, int64_t chunk, ForeachTable& out,
                 const std::vector<int64_t>& head = {}) {
  size_t n = numel.size(), nl = ptr.size();
  size_t w = 1 + nl + extra.size();
  out.head = head.size();
  out.bytes.assign((out.head + n + n * w) * sizeof(int64_t), '\0');
  int64_t* t = reinterpret_cast<int64_t*>(&out.bytes[0]);
  for (size_t k = 0; k < out.head; k++) t[k] = head[k];
  t += out.head;
  out.total = 0;
  out.base = -1;
  for (size_t i = 0; i < n; i++) {
    t[i] = out.total;
    out.total += (numel[i] + chunk - 1) / chunk;
    if (out.base < 0 && numel[i]) out.base = static_cast<int64_t>(i);
    int64_t* row = t + n + i * w;
    row[0] = numel[i];
    for (size_t l = 0; l < nl; l++) row[1 + l] = ptr[l][i];
    for (size_t c = 0; c < extra.size(); c++) std::memcpy(row + 1 + nl + c, extra[c] + i * sizeof(int64_t), sizeof(int64_t));
  }
}

// TOP: the largest power of two below N (the binary search's first step), 0 for one tensor
int64_t table_top(size_t n) {
  int64_t top = 0;
  if (n > 1) {
    top = 1;
    while (top * 2 <= static_cast<int64_t>(n) - 1) top *= 2;
  }
  return top;
}

bool all_aligned(const std::vector<std::vector<int64_t>>& ptr) {
  int64_t bits = 0;
  for (const auto& col : ptr) for (int64_t p : col) bits |= p;
  return (bits & 15) == 0;
}

// For the Python path: the lists already checked by foreach_lists (list 0's shapes throughout); lists:
// the n_in input lists, then the results' list (functional variants); extra: bytes columns; own /
// shared: see foreach_overlap (in-place calls only). Returns ("overlap" | "empty" | None, table bytes,
// programs, TOP, the index of the Base tensor, whether every address is 16-byte aligned).
py::tuple foreach_table(const py::list& lists, bool inplace, size_t n_in, const py::list& extra,
                        py::object own, py::object shared, int64_t chunk) {
  auto ts = tensor_lists(lists, "foreach_table");
  size_t n = ts[0].size();
  size_t nl = ts.size();
  std::vector<std::vector<int64_t>> ptr(nl, std::vector<int64_t>(n));
  for (size_t l = 0; l < nl; l++) {
    for (size_t i = 0; i < n; i++) ptr[l][i] = reinterpret_cast<intptr_t>(ts[l][i]->const_data_ptr());
  }
  std::vector<int64_t> numel(n), nbytes(n);
  int64_t es = n ? static_cast<int64_t>(ts[0][0]->element_size()) : 1;
  for (size_t i = 0; i < n; i++) {
    numel[i] = ts[0][i]->numel();
    nbytes[i] = numel[i] * es;
  }
  std::vector<std::string> cols;
  std::vector<const char*> extra_cols;
  for (py::handle e : extra) {
    cols.push_back(e.cast<std::string>());
    TORCH_CHECK(cols.back().size() == n * sizeof(int64_t), "foreach_table: an extra column of the wrong length");
  }
  for (const auto& c : cols) extra_cols.push_back(c.data());
  py::object none = py::none();
  if (inplace) {
    std::vector<int64_t> own_ptr;
    int64_t own_size = 0, sh_ptr = 0, sh_bytes = 0;
    if (!own.is_none()) {
      auto o = own.cast<std::pair<std::string, int64_t>>();
      TORCH_CHECK(o.first.size() == n * sizeof(int64_t), "foreach_table: own addresses of the wrong length");
      own_ptr.resize(n);
      std::memcpy(own_ptr.data(), o.first.data(), o.first.size());
      own_size = o.second;
    }
    if (!shared.is_none()) {
      auto s = shared.cast<std::pair<int64_t, int64_t>>();
      sh_ptr = s.first;
      sh_bytes = s.second;
    }
    if (foreach_overlap(ptr, n_in, nbytes, own.is_none() ? nullptr : &own_ptr, own_size, sh_ptr, sh_bytes)) {
      return py::make_tuple(py::str("overlap"), none, 0, 0, 0, false);
    }
  }
  ForeachTable tb;
  build_table(ptr, numel, extra_cols, chunk, tb);
  if (tb.total == 0) return py::make_tuple(py::str("empty"), none, 0, 0, 0, false);
  return py::make_tuple(none, py::bytes(tb.bytes), tb.total, table_top(n), tb.base, all_aligned(ptr));
}

// ------------------------------------------------------------------------------------------------
// _foreach_* calls served whole from here (Op::fe): an optimizer's step makes about ten such calls
// over hundreds of tensors, and the Python path pays, per call, the lists' conversion to Python,
// the Python kernel, two C++ passes and Triton's launcher (about 50 us on an H100's host against ATen's
// 47 for a one-list call; docs/perf.md). Here, per call: the checks of foreach_lists on the stack's
// lists, the numbers' checks (foreach._number, _number_list), results, the overlap check, the table
// and its device copy (kept by content, as foreach._TABLES), one cuLaunchKernel. The binary is the
// one the Python path compiled for the same *binary facts* (dtype, device, scalar mode, table width,
// vector width, alignments, which ints need 64 bits: all that selects foreach_kernel's binary and its
// parameter list); a call whose facts have none yet runs the Python kernel, which publishes its
// launch (foreach_publish) only if its own facts are these: a disagreement between the two paths
// costs speed, never a wrong binary. Anything this code does not serve goes to the Python kernel,
// which decides as always (ATen fallbacks, their counts, errors).
// ------------------------------------------------------------------------------------------------
std::optional<c10::OperatorHandle> g_copy_op;         // aten::copy_
std::optional<c10::SafeKernelFunction> g_copy_kernel; // ATen's copy_ at the CUDA key, captured before
                                                      // Gems registers its own there (a table's upload
                                                      // must not come back into Gems)

struct TableCache {
  std::mutex mu;
  std::unordered_map<std::string, at::Tensor> map;
  std::vector<std::string> order;   // oldest first
} g_tables;
constexpr size_t kMaxTables = 64;   // foreach._MAX_TABLES

// A table's device copy on `dev` (a GPU) kept by the key `tb.bytes`: a header naming the device, the
// stream and what else the call's overlap verdict depends on, then the table's content (foreach._TABLES'
// rule: an optimizer passes the same tensors every step, and the caching allocator hands gradients
// the same addresses from step to step). Only tables that passed the overlap check are kept, so a hit
// also stands for that check. Undefined when there is none.
at::Tensor cached_table(const ForeachTable& tb) {
  std::lock_guard<std::mutex> g(g_tables.mu);
  auto it = g_tables.map.find(tb.bytes);
  return it == g_tables.map.end() ? at::Tensor() : it->second;
}

at::Tensor upload_cuda(const ForeachTable& tb, int64_t len) {
  at::Tensor host = at::empty({len}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  std::memcpy(host.data_ptr(), tb.table(), tb.table_bytes());
  at::Tensor t = at::detail::empty_generic({len}, cuda_allocator(), c10::DispatchKeySet(c10::DispatchKey::CUDA),
                                           at::kLong, std::nullopt);
  Stack st;
  st.emplace_back(t);
  st.emplace_back(host);
  st.emplace_back(true);   // non_blocking
  g_copy_kernel->callBoxed(*g_copy_op, c10::DispatchKeySet(c10::DispatchKey::CUDA), &st);
  return t;
}

// the table on `dev`: on the CPU (the interpreter) a copy; on a GPU one pinned host copy and an
// asynchronous upload (ATen's copy_ records the pinned block's use on the stream, so the host
// allocator keeps it until the upload has run), then kept (cached_table)
at::Tensor upload_table(const ForeachTable& tb, const c10::Device& dev) {
  int64_t len = static_cast<int64_t>(tb.table_bytes() / sizeof(int64_t));
  at::Tensor t;
  if (!dev.is_cuda()) {
    t = at::empty({len}, at::TensorOptions().dtype(at::kLong));
    std::memcpy(t.data_ptr(), tb.table(), tb.table_bytes());
  } else {
    t = upload_cuda(tb, len);
  }
  std::lock_guard<std::mutex> g(g_tables.mu);
  if (g_tables.map.size() >= kMaxTables && !g_tables.order.empty()) {
    g_tables.map.erase(g_tables.order.front());
    g_tables.order.erase(g_tables.order.begin());
  }
  if (g_tables.map.emplace(tb.bytes, t).second) g_tables.order.push_back(tb.bytes);
  return t;
}

bool stream_capturing(void* stream) {
  if (!g_cuStreamIsCapturing) return true;   // cannot tell: the Python path decides
  int status = 0;
  if (g_cuStreamIsCapturing(stream, &status) != 0) return true;
  return status != 0;
}

// a Scalar argument as the kernel's number, false where foreach._number would not take it
// (complex; a number generator.number_misfit sends to ATen: -0.0, out of the dtype's range)
bool fits_number(const IValue& v, int64_t range_limit, double& out) {
  if (v.isDouble()) {
    double d = v.toDouble();
    if (!std::isnan(d)) {
      if (d == 0 && std::signbit(d)) return false;
      int64_t r = float_range(d);
      if (r > range_limit && r != 9) return false;
    }
    out = d;
    return true;
  }
  if (v.isBool()) {
    out = v.toBool() ? 1.0 : 0.0;
    return true;
  }
  if (v.isInt()) {
    int64_t i = v.toInt();
    if (int_range(i) > range_limit) return false;
    out = static_cast<double>(i);
    return true;
  }
  return false;
}

bool fits32(int64_t v) { return v >= INT32_MIN && v <= INT32_MAX; }

// GEMS_POISON (a test aid): a fresh float result filled with NaN without a dispatcher call (which
// Gems' own fill_ would serve); false where that cannot be done here
bool poison_nan(at::Tensor& t, void* stream) {
  size_t n = static_cast<size_t>(t.numel());
  auto st = t.scalar_type();
  if (st != at::kFloat && st != at::kHalf && st != at::kBFloat16) return false;
  uint32_t bits32 = 0x7FC00000u;
  uint16_t bits16 = st == at::kHalf ? 0x7E00 : 0x7FC0;
  if (!t.is_cuda()) {
    if (st == at::kFloat) {
      std::fill_n(static_cast<uint32_t*>(t.data_ptr()), n, bits32);
    } else {
      std::fill_n(static_cast<uint16_t*>(t.data_ptr()), n, bits16);
    }
    return true;
  }
  if (n == 0) return true;
  auto ptr = reinterpret_cast<uintptr_t>(t.data_ptr());
  if (st == at::kFloat) return g_cuMemsetD32Async && g_cuMemsetD32Async(ptr, bits32, n, stream) == 0;
  return g_cuMemsetD16Async && g_cuMemsetD16Async(ptr, bits16, n, stream) == 0;
}

// the call on top of the stack served here (true: results pushed), or false with the stack untouched:
// then `miss` holds the call's binary facts when a binary was all that was missing
bool foreach_serve(Op& o, Stack& stack, size_t n, std::vector<int64_t>& miss) {
  const ForeachSpec& sp = *o.fe;
  const IValue* args = stack.data() + stack.size() - n;
  size_t nin = sp.lists.size();
  c10::SmallVector<c10::ArrayRef<IValue>, 4> L;
  for (int a : sp.lists) {
    if (!args[a].isList()) return false;
    L.push_back(args[a].toListRef());
  }
  size_t N = L[0].size();
  if (N == 0) return false;
  for (const auto& l : L) if (l.size() != N) return false;
  if (!L[0][0].isTensor() || !L[0][0].toTensor().defined()) return false;
  const at::Tensor& t0 = L[0][0].toTensor();
  at::ScalarType dtype = t0.scalar_type();
  const ForeachDtype* fd = nullptr;
  for (const auto& d : sp.dtypes) if (d.dtype == dtype) fd = &d;
  if (fd == nullptr) return false;
  c10::Device device = t0.device();
  bool cuda = device.is_cuda();
  void* stream = nullptr;
  if (cuda) {
    if (device.index() != Op::current_device() || g_stream_mode == 0 || !load_driver() || !cuda_allocator() ||
        !g_copy_kernel) {
      return false;
    }
    stream = cuda_stream(device.index());
    if (stream_capturing(stream)) return false;   // the table's upload would be captured (foreach._first_checks)
  } else if (!device.is_cpu()) {
    return false;
  }
  // foreach_lists' checks, reading the addresses on the way
  std::vector<std::vector<int64_t>> ptr(nin + (sp.inplace ? 0 : 1), std::vector<int64_t>(N));
  std::vector<int64_t> numel(N);
  for (size_t l = 0; l < nin; l++) {
    for (size_t i = 0; i < N; i++) {
      const IValue& e = L[l][i];
      if (!e.isTensor()) return false;
      const at::Tensor& t = e.toTensor();
      if (!t.defined()) return false;
      c10::TensorImpl* ti = t.unsafeGetTensorImpl();
      if (ti->has_symbolic_sizes_strides() || t.layout() != c10::kStrided || t.scalar_type() != dtype ||
          t.device() != device || t.is_neg() || t.is_conj() || !t.is_contiguous()) {
        return false;
      }
      if (l == 0) {
        numel[i] = t.numel();
      } else if (t.sizes() != L[0][i].toTensor().sizes()) {
        return false;
      }
      ptr[l][i] = reinterpret_cast<intptr_t>(t.const_data_ptr());
    }
  }
  // the number: a kernel argument (smode 0), per tensor in the table (1), a 0-dim tensor's value (2)
  double s = 0.0, alpha = 1.0;
  int64_t smode = 0;
  std::vector<int64_t> svals;
  const at::Tensor* S = nullptr;
  if (sp.skind == FS_SCALAR) {
    if (!fits_number(args[sp.scalar], fd->range_limit, s)) return false;
  } else if (sp.skind == FS_LIST) {
    const IValue& v = args[sp.scalar];
    if (!v.isList()) return false;
    auto vals = v.toListRef();
    if (vals.size() != N) return false;
    svals.resize(N);
    bool same = true;
    double v0 = 0.0;
    for (size_t i = 0; i < N; i++) {
      double d;
      if (vals[i].isDouble()) {
        d = vals[i].toDouble();
      } else if (vals[i].isInt()) {
        d = static_cast<double>(vals[i].toInt());
      } else {
        return false;
      }
      if (!(d >= -fd->max_finite && d <= fd->max_finite)) return false;
      if (i == 0) {
        v0 = d;
      } else if (d != v0) {
        same = false;
      }
      std::memcpy(&svals[i], &d, sizeof d);
    }
    if (same && v0 != 0) {   // one value for every tensor (Adam's step sizes): a kernel argument
      s = v0;
      svals.clear();
    } else {
      smode = 1;
    }
  } else if (sp.skind == FS_TENSOR) {
    const IValue& v = args[sp.scalar];
    if (!v.isTensor()) return false;
    const at::Tensor& st = v.toTensor();
    if (!st.defined() || st.dim() != 0 || st.is_complex() || st.layout() != c10::kStrided || st.is_neg() ||
        st.is_conj()) {
      return false;
    }
    if (st.device() != device) {
      if (!st.device().is_cpu()) return false;
      s = st.item().toDouble();   // a CPU scalar beside device lists
    } else {
      S = &st;
      smode = 2;
    }
  }
  if (sp.alpha >= 0) {
    const IValue& a = args[sp.alpha];
    if (a.isBool() || !fits_number(a, fd->range_limit, alpha)) return false;
  }
  int64_t es = static_cast<int64_t>(t0.element_size());
  int64_t base_i = -1;
  for (size_t i = 0; i < N; i++) {
    if (numel[i]) {
      base_i = static_cast<int64_t>(i);
      break;
    }
  }
  if (base_i < 0) return false;   // nothing to visit: Python's answer (no launch)
  // results (functional variants), as foreach_empty allocates them
  c10::List<at::Tensor> outs;
  if (!sp.inplace) {
    outs.reserve(N);
    for (size_t i = 0; i < N; i++) {
      const at::Tensor& t = L[0][i].toTensor();
      at::Tensor r = cuda ? at::detail::empty_generic(t.sizes(), cuda_allocator(),
                                                      c10::DispatchKeySet(c10::DispatchKey::CUDA), dtype, std::nullopt)
                          : at::empty(t.sizes(), t.options().memory_format(c10::MemoryFormat::Contiguous));
      if (sp.poison && !poison_nan(r, stream)) return false;
      ptr[nin][i] = reinterpret_cast<intptr_t>(r.const_data_ptr());
      outs.push_back(std::move(r));
    }
  }
  int64_t b0 = ptr[0][base_i];
  int64_t top = table_top(N);
  int64_t logn = 0;
  while ((int64_t(1) << logn) <= top) logn++;   // top.bit_length()
  int64_t W = 1 + static_cast<int64_t>(ptr.size()) + (svals.empty() ? 0 : 1);
  int64_t vec = all_aligned(ptr) ? 16 / es : 1;
  int64_t sptr = S ? reinterpret_cast<intptr_t>(S->const_data_ptr()) : 0;
  std::vector<int64_t> facts = {static_cast<int64_t>(dtype), device.index(), smode, W, vec, (b0 & 15) == 0,
                                S ? static_cast<int64_t>(S->scalar_type()) : -1, S ? (sptr & 15) == 0 : 0,
                                fits32(static_cast<int64_t>(N)), fits32(top), fits32(logn), fits32(b0), 1};
  auto fl = o.find_launch(facts);
  if (!fl) {
    miss = std::move(facts);
    return false;
  }
  // the table, headed by what its cache key needs besides (device, stream, the shared 0-dim tensor
  // the overlap check reads, the lists' count and kind); a cached upload of it passed the overlap check
  int64_t sh_ptr = 0, sh_bytes = 0;
  if (S != nullptr) {
    sh_ptr = sptr;
    sh_bytes = S->numel() * static_cast<int64_t>(S->element_size());
  }
  ForeachTable tb;
  std::vector<const char*> extra;
  if (!svals.empty()) extra.push_back(reinterpret_cast<const char*>(svals.data()));
  build_table(ptr, numel, extra, fl->chunk, tb,
              {device.index(), static_cast<int64_t>(reinterpret_cast<intptr_t>(stream)), static_cast<int64_t>(N),
               static_cast<int64_t>(nin), sp.inplace, sh_ptr, sh_bytes, W, es});
  if (fl->cuda && tb.total > INT32_MAX) return false;
  at::Tensor tab = cached_table(tb);
  if (!tab.defined()) {
    if (sp.inplace) {
      std::vector<int64_t> nbytes(N);
      for (size_t i = 0; i < N; i++) nbytes[i] = numel[i] * es;
      if (foreach_overlap(ptr, nin, nbytes, nullptr, 0, sh_ptr, sh_bytes)) return false;
    }
    tab = upload_table(tb, device);
  }
  if (reinterpret_cast<uintptr_t>(tab.const_data_ptr()) & 15) return false;   // the binary assumes it
  const at::Tensor& base = L[0][base_i].toTensor();
  if (fl->cuda) {
    uint64_t storage[R_COUNT];
    void* params[R_COUNT + 2];
    size_t np = fl->params.size();
    for (size_t i = 0; i < np; i++) {
      int role = fl->params[i].first, type = fl->params[i].second;
      uint64_t v = 0;
      switch (role) {
        case R_BASE: v = static_cast<uint64_t>(b0); break;
        case R_TAB: v = reinterpret_cast<uintptr_t>(tab.const_data_ptr()); break;
        case R_N: v = N; break;
        case R_TOP: v = static_cast<uint64_t>(top); break;
        case R_LOGN: v = static_cast<uint64_t>(logn); break;
        case R_B0: v = static_cast<uint64_t>(b0); break;
        case R_S: v = pack(Num{true, s, 0}, type); break;
        case R_ALPHA: v = pack(Num{true, alpha, 0}, type); break;
        case R_SPTR: v = static_cast<uint64_t>(sptr); break;
        default: v = 0;   // R_S0: per-tensor 0-dim tensors are the Python path's
      }
      storage[i] = v;
      params[i] = &storage[i];
    }
    uint64_t scratch[2] = {0, 0};   // Triton's global and profile scratch pointers (unused)
    params[np] = &scratch[0];
    params[np + 1] = &scratch[1];
    ensure_context(device.index());
    int err = g_cuLaunchKernel(fl->function, static_cast<unsigned>(tb.total), 1, 1, fl->block, 1, 1, fl->shared,
                               stream, params, nullptr);
    if (err != 0) {
      const char* msg = "unknown";
      if (g_cuGetErrorString) g_cuGetErrorString(err, &msg);
      TORCH_CHECK(false, "gems: cuLaunchKernel failed for aten::", o.name, ": ", msg);
    }
  } else {
    py::gil_scoped_acquire gil;
    auto wrap = [](const at::Tensor& t) { return py::reinterpret_steal<py::object>(THPVariable_Wrap(t)); };
    py::object sobj = S ? wrap(*S) : py::none();
    t_depth++;
    try {
      fl->py_launch(tb.total, wrap(base), wrap(tab), N, top, logn, b0, s, alpha, sobj, 0);
    } catch (...) {
      t_depth--;
      throw;
    }
    t_depth--;
  }
  torch::jit::drop(stack, n);
  if (!sp.inplace) stack.emplace_back(std::move(outs));
  return true;
}

// the functional _foreach_* ops' results: one new contiguous tensor per tensor of `like` (its shape,
// dtype and device, as ATen's foreach kernels allocate them)
py::list foreach_empty(const py::list& like) {
  size_t n = like.size();
  py::list outs(n);
  for (size_t i = 0; i < n; i++) {
    PyObject* o = like[i].ptr();
    if (!THPVariable_Check(o)) throw py::type_error("foreach_empty: a list of tensors");
    const at::Tensor& t = THPVariable_Unpack(o);
    at::Tensor r = at::empty(t.sizes(), t.options().memory_format(c10::MemoryFormat::Contiguous));
    outs[i] = py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(r)));
  }
  return outs;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Gems' C++ fast path (see fastpath.cpp)";
  py::class_<Op, std::shared_ptr<Op>>(m, "Op")
      .def(py::init([](std::string name, py::object kernel, std::vector<uint8_t> dynamic, bool precision_key) {
             auto o = std::make_shared<Op>();
             o->name = std::move(name);
             o->py_kernel = std::move(kernel);
             o->dynamic = std::move(dynamic);
             o->precision_key = precision_key;
             return o;
           }))
      .def("set_kernel", [](Op& o, py::object k) { o.py_kernel = std::move(k); })
      // a _foreach_* overload (ops/foreach.py's registrations): served whole by foreach_serve.
      // dtypes: (dtype, widest number range class, largest finite value) per served dtype
      .def("set_foreach", [](Op& o, std::vector<int> lists, int scalar, int skind, int alpha, bool inplace,
                             bool poison, py::list dtypes) {
        auto sp = std::make_shared<ForeachSpec>();
        sp->lists = std::move(lists);
        sp->scalar = scalar;
        sp->skind = skind;
        sp->alpha = alpha;
        sp->inplace = inplace;
        sp->poison = poison;
        for (auto d : dtypes) {
          auto t = d.cast<py::tuple>();
          TORCH_CHECK(THPDtype_Check(t[0].ptr()), "set_foreach: a dtype");
          sp->dtypes.push_back({reinterpret_cast<THPDtype*>(t[0].ptr())->scalar_type, t[1].cast<int64_t>(),
                                t[2].cast<double>()});
        }
        TORCH_CHECK(!sp->lists.empty(), "set_foreach: no tensor list");
        o.fe = std::move(sp);
      })
      .def("set_member", [](Op& o, int cfg, bool on) {
        TORCH_CHECK(cfg >= 0 && cfg < kMaxConfigs, "gems: config id out of range");
        o.member[cfg] = on;
      })
      // a recipe for the call this thread's Python kernel is serving for this op (if any); returns
      // whether it was taken. `replay`: GEMS_PLAN_CHECK wants the call answered from it.
      .def("publish", [](Op& o, py::handle recipe, bool replay) {
        Pending& p = t_pending;
        if (p.op != &o || p.key == nullptr) return false;
        auto r = parse_recipe(recipe);
        for (const auto& L : r->launches) {
          if (L.cuda && (g_stream_mode == 0 || !load_driver())) return false;
        }
        o.put(*p.key, std::move(r));
        p.replay = replay;
        p.key = nullptr;
        return true;
      })
      // the call this thread's Python kernel is serving goes to ATen for its whole signature
      // (Unsupported(signature=True)): later calls with this key call ATen's kernel from here
      .def("publish_aten", [](Op& o, const std::string& reason) {
        Pending& p = t_pending;
        if (p.op != &o || p.key == nullptr || !o.aten_kernel) return false;
        int id = -1;
        {
          std::lock_guard<std::mutex> g(o.mu);
          for (size_t i = 0; i < o.aten_reasons.size(); i++) {
            if (o.aten_reasons[i] == reason) id = static_cast<int>(i);
          }
          if (id < 0) {
            if (o.aten_reasons.size() >= Op::kMaxReasons) return false;
            o.aten_reasons.push_back(reason);
            id = static_cast<int>(o.aten_reasons.size()) - 1;
          }
        }
        auto r = std::make_shared<Recipe>();
        r->aten = id;
        o.put(*p.key, std::move(r));
        p.key = nullptr;
        return true;
      })
      // capture ATen's kernel at `dispatch_key` (call before Gems registers its own there)
      .def("capture_aten", [](Op& o, const std::string& dispatch_key) {
        if (o.aten_kernel) return;
        auto dot = o.name.find('.');
        std::string base = "aten::" + o.name.substr(0, dot);
        std::string overload = dot == std::string::npos ? "" : o.name.substr(dot + 1);
        if (overload == "default") overload = "";
        auto h = c10::Dispatcher::singleton().findSchemaOrThrow(base.c_str(), overload.c_str());
        auto key = c10::parseDispatchKey(dispatch_key);
        if (h.hasComputedKernelForDispatchKey(key)) o.aten_kernel.emplace(h.getComputedKernelForDispatchKey(key));
      })
      .def("aten_counts", [](Op& o) {
        py::dict d;
        std::lock_guard<std::mutex> g(o.mu);
        for (size_t i = 0; i < o.aten_reasons.size(); i++) {
          int64_t c = o.aten_counts[i].load();
          if (c) d[py::str(o.aten_reasons[i])] = c;
        }
        return d;
      })
      .def("reset_aten_counts", [](Op& o) {
        for (auto& c : o.aten_counts) c = 0;
      })
      .def("pending", [](Op& o) { return t_pending.op == &o && t_pending.key != nullptr; })
      .def("clear", &Op::clear)
      .def("size", &Op::size)
      .def_property("hits", [](Op& o) { return o.hits.load(); }, [](Op& o, int64_t v) { o.hits = v; });
  m.def("register", [](const std::string& dispatch_key, std::vector<std::pair<std::string, std::shared_ptr<Op>>> ops) {
    auto key = c10::parseDispatchKey(dispatch_key);
    auto lib = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", key, __FILE__, __LINE__);
    for (auto& [schema_name, op] : ops) {
      lib->impl(schema_name.c_str(), torch::CppFunction::makeFromBoxedFunctor(std::make_unique<Kernel>(op)));
    }
    g_libs.push_back(std::move(lib));
  });
  m.def("unregister", []() { g_libs.clear(); });
  m.def("set_global", [](int cfg) { g_cfg = cfg; });
  m.def("set_top_scope", [](int cfg) { g_top_scope = cfg; });
  m.def("set_thread", [](int cfg) { t_cfg = cfg; });
  m.def("get_thread", []() { return t_cfg; });
  m.def("set_check", [](bool on) { g_check = on; });
  m.def("depth", []() { return t_depth; });
  m.def("has_driver", []() { return load_driver(); });
  m.def("init_stream", &init_stream);
  m.def("foreach_lists", &foreach_lists);
  m.def("foreach_table", &foreach_table);
  m.def("foreach_empty", &foreach_empty);
  // ATen's copy_ at `dispatch_key`, captured before Gems registers anything there
  m.def("capture_copy", [](const std::string& dispatch_key) {
    if (g_copy_kernel || dispatch_key != "CUDA") return;
    auto h = c10::Dispatcher::singleton().findSchemaOrThrow("aten::copy_", "");
    if (h.hasComputedKernelForDispatchKey(c10::DispatchKey::CUDA)) {
      g_copy_op.emplace(h);
      g_copy_kernel.emplace(h.getComputedKernelForDispatchKey(c10::DispatchKey::CUDA));
    }
  });
  // whether this thread's Python kernel serves a _foreach_* call whose binary C++ is waiting for
  m.def("foreach_tables", []() {   // how many table uploads are kept (a test aid)
    std::lock_guard<std::mutex> g(g_tables.mu);
    return g_tables.map.size();
  });
  m.def("foreach_pending", []() { return t_fpending.op != nullptr; });
  // the launch of that call: taken (true) only if the Python path's binary facts are the ones C++
  // computed for the call. facts: (dtype, device index, smode, W, VEC, Base aligned, S's dtype or None,
  // S aligned, then whether N, TOP, LOGN, B0, S0 fit 32 bits); launch: (0, CUfunction, threads, shared
  // bytes, chunk, ((role, type), ..)) or (1, interpreter callable, chunk)
  m.def("foreach_publish", [](py::tuple facts, py::tuple launch) {
    ForeachPending& p = t_fpending;
    if (p.op == nullptr || facts.size() != 13) return false;
    std::vector<int64_t> f;
    for (size_t i = 0; i < facts.size(); i++) {
      py::handle h = facts[i];
      if (THPDtype_Check(h.ptr())) {
        f.push_back(static_cast<int64_t>(reinterpret_cast<THPDtype*>(h.ptr())->scalar_type));
      } else if (h.is_none()) {
        f.push_back(-1);
      } else {
        f.push_back(h.cast<int64_t>());
      }
    }
    Op* op = p.op;
    p.op = nullptr;
    if (f != p.facts) return false;
    auto fl = std::make_shared<ForeachLaunch>();
    fl->cuda = launch[0].cast<int>() == 0;
    if (fl->cuda) {
      if (g_stream_mode == 0 || !load_driver()) return false;
      fl->function = reinterpret_cast<void*>(launch[1].cast<uint64_t>());
      fl->block = launch[2].cast<unsigned>();
      fl->shared = launch[3].cast<unsigned>();
      fl->chunk = launch[4].cast<int64_t>();
      for (auto e : launch[5]) {
        auto t = e.cast<std::pair<int, int>>();
        TORCH_CHECK(t.first >= 0 && t.first < R_COUNT, "foreach_publish: unknown parameter role");
        fl->params.push_back(t);
      }
    } else {
      fl->py_launch = py::reinterpret_borrow<py::object>(launch[1]);
      fl->chunk = launch[2].cast<int64_t>();
    }
    std::lock_guard<std::mutex> g(op->mu);
    if (op->fe_launches.size() >= 64) op->fe_launches.clear();
    op->fe_launches.emplace_back(std::move(f), std::move(fl));
    return true;
  });
  m.attr("UNSCOPED") = kUnscoped;
  m.attr("MAX_CONFIGS") = kMaxConfigs;
}
