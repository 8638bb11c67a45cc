// The CUDA driver and device state the fast path needs, looked up at run time.
//
// The extension builds against CPU-only torch too (the CPU machine, the interpreter), so nothing
// here links against CUDA: the driver's entry points come from dlopen("libcuda.so.1") (load_driver;
// false where there is none, and then no CUDA recipe is taken), the current stream from torch's
// device guard or libc10_cuda (init_stream picks a way that agrees with torch's Python binding).
#pragma once

#include "common.h"

namespace {

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

// runtime/plan/rng.py's philox_state in C++: (seed, offset) for a launch drawing `increment` Philox counters from the
// default CUDA generator of `dev`, its offset advanced under the generator's lock; the same bases as
// Python's (abi.PHILOX_SEED_BIT, PHILOX_OFFSET_BASE) so that both paths give the kernel the same values
void philox_state(int dev, uint64_t increment, uint64_t* seed, uint64_t* offset) {
  at::Generator gen = at::globalContext().defaultGenerator(c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(dev)));
  std::lock_guard<std::mutex> lock(gen.mutex());
  uint64_t off = gen.get_offset();
  gen.set_offset(off + increment);
  *seed = (gen.current_seed() & (kPhiloxSeedBit - 1)) | kPhiloxSeedBit;
  *offset = off + kPhiloxOffsetBase;
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
// whether work queued on `stream` is being captured into a CUDA graph (then per-call host state, a
// Philox draw or a table upload, would be frozen into the graph: such calls take the Python path)
bool stream_capturing(void* stream) {
  if (!g_cuStreamIsCapturing) return true;   // cannot tell: the Python path decides
  int status = 0;
  if (g_cuStreamIsCapturing(stream, &status) != 0) return true;
  return status != 0;
}

// the current CUDA device's index, -1 where torch has no CUDA
int64_t current_device() {
  static const bool has_cuda = c10::impl::hasDeviceGuardImpl(c10::kCUDA);
  if (!has_cuda) return -1;
  return c10::impl::getDeviceGuardImpl(c10::kCUDA)->getDevice().index();
}

}  // namespace
