// _foreach_* calls served whole from C++ (Op::fe; the Python side is gems/ops/foreach/launch.py).
//
// An optimizer's step makes about ten such calls over hundreds of tensors, and the Python path pays,
// per call, the lists' conversion to Python, the Python kernel, two C++ passes and Triton's launcher
// (about 50 us on an H100's host against ATen's 47 for a one-list call; docs/perf.md). Here, per
// call: the checks of foreach_lists on the stack's lists, the numbers' checks (launch.scalar_value,
// launch._number_list), results, the overlap check, the table and its device copy (kept by content,
// as launch._TABLES), one cuLaunchKernel. The binary is the one the Python path compiled for the
// same *binary facts* (dtype, device, scalar mode, table width, vector width, alignments, which ints
// need 64 bits: all that selects foreach_kernel's binary and its parameter list); a call whose facts
// have none yet runs the Python kernel, which publishes its launch (foreach_publish) only if its own
// facts are these: a disagreement between the two paths costs speed, never a wrong binary. Anything
// this code does not serve goes to the Python kernel, which decides as always (ATen fallbacks, their
// counts, errors).
#pragma once

#include "common.h"
#include "driver.h"
#include "enabled.h"
#include "signature.h"
#include "replay.h"
#include "foreach_table.h"

namespace {

// a _foreach_* overload served whole from here: where its tensor lists and its number are on the
// stack (set from ops/foreach/overloads.py's registrations through Op.set_foreach)
struct ForeachDtype {
  at::ScalarType dtype;
  int64_t range_limit;   // the widest number range class that fits (generator.number_misfit)
  double max_finite;     // a ScalarList's values must lie within +-this (launch._number_list)
};
struct ForeachSpec {
  std::vector<int> lists;   // schema argument indices of the kernel's input lists, in order
  int scalar = -1, skind = FS_NONE, alpha = -1;
  bool inplace = true;
  bool poison = false;      // GEMS_POISON (a test aid): functional results start as NaN
  std::vector<ForeachDtype> dtypes;
};
// a binary the Python path compiled and published (foreach_publish); its parameters are named by
// role (ForeachRole: foreach_kernel's parameters, abi.FOREACH_ROLES)
struct ForeachLaunch {
  bool cuda = true;
  void* function = nullptr;
  unsigned block = 128, shared = 0;
  int64_t chunk = 4096;                      // the binary's CHUNK (the table is cut by it)
  std::vector<std::pair<int, int>> params;   // (role, PType) of the non-constexpr parameters
  py::object py_launch;                      // interpreter: callable(programs, *the ten arguments)
};
// an overload's published binaries, one per binary facts
struct ForeachLaunches {
  static constexpr size_t kMax = 64;   // binaries kept per overload; more: start over
  std::mutex mu;
  std::vector<std::pair<std::vector<int64_t>, std::shared_ptr<ForeachLaunch>>> entries;

  std::shared_ptr<ForeachLaunch> find(const std::vector<int64_t>& facts) {
    std::lock_guard<std::mutex> g(mu);
    for (auto& e : entries) {
      if (e.first == facts) return e.second;
    }
    return nullptr;
  }

  void add(std::vector<int64_t> facts, std::shared_ptr<ForeachLaunch> launch) {
    std::lock_guard<std::mutex> g(mu);
    if (entries.size() >= kMax) entries.clear();
    entries.emplace_back(std::move(facts), std::move(launch));
  }

  void clear() {
    std::lock_guard<std::mutex> g(mu);
    entries.clear();
  }
};

// the binary facts a Python-kernel call may publish a launch for (the call the Kernel handed to
// Python because its binary was missing)
struct ForeachPending {
  ForeachLaunches* launches = nullptr;
  std::vector<int64_t> facts;
};
thread_local ForeachPending t_fpending;

std::optional<c10::OperatorHandle> g_copy_op;         // aten::copy_
std::optional<c10::SafeKernelFunction> g_copy_kernel; // ATen's copy_ at the CUDA key, captured before
                                                      // Gems registers its own there (a table's upload
                                                      // must not come back into Gems)

struct TableCache {
  std::mutex mu;
  std::unordered_map<std::string, at::Tensor> map;
  std::vector<std::string> order;   // oldest first
} g_tables;

// A table's device copy on `dev` (a GPU) kept by the key `tb.bytes`: a header naming the device, the
// stream and what else the call's overlap verdict depends on, then the table's content (launch._TABLES'
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
  if (g_tables.map.size() >= kForeachMaxTables && !g_tables.order.empty()) {
    g_tables.map.erase(g_tables.order.front());
    g_tables.order.erase(g_tables.order.begin());
  }
  if (g_tables.map.emplace(tb.bytes, t).second) g_tables.order.push_back(tb.bytes);
  return t;
}

// a Scalar argument as the kernel's number, false where launch.scalar_value would not take it
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
// then `miss` holds the call's binary facts when a binary was all that was missing. name: the
// overload's, for errors.
bool foreach_serve(const ForeachSpec& sp, ForeachLaunches& launches, const std::string& name, Stack& stack,
                   size_t n, std::vector<int64_t>& miss) {
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
    if (device.index() != current_device() || g_stream_mode == 0 || !load_driver() || !cuda_allocator() ||
        !g_copy_kernel) {
      return false;
    }
    stream = cuda_stream(device.index());
    if (stream_capturing(stream)) return false;   // the table's upload would be captured (launch._first_checks)
  } else if (!device.is_cpu()) {
    return false;
  }
  // foreach_lists' checks, reading the addresses on the way
  std::vector<std::vector<int64_t>> ptr(nin + (sp.inplace ? 0 : 1), std::vector<int64_t>(N));
  std::vector<int64_t> numel(N);
  bool zero_dim = false;   // a 0-dim tensor in the first list (see the scalar tensor's check below)
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
        zero_dim = zero_dim || t.dim() == 0;
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
    // a bool number goes to the Python kernel, which knows the op (ATen's sub rejects one)
    if (args[sp.scalar].isBool() || !fits_number(args[sp.scalar], fd->range_limit, s)) return false;
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
    // a 0-dim tensor of the list and a scalar tensor of another dtype compute in the wider dtype
    // (ATen's per-tensor op): the Python path leaves such calls to ATen
    if (zero_dim && st.scalar_type() != dtype) return false;
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
  auto fl = launches.find(facts);
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
        case R_Base: v = static_cast<uint64_t>(b0); break;
        case R_Tab: v = reinterpret_cast<uintptr_t>(tab.const_data_ptr()); break;
        case R_N: v = N; break;
        case R_TOP: v = static_cast<uint64_t>(top); break;
        case R_LOGN: v = static_cast<uint64_t>(logn); break;
        case R_B0: v = static_cast<uint64_t>(b0); break;
        case R_s: v = pack(Num{true, s, 0}, type); break;
        case R_alpha: v = pack(Num{true, alpha, 0}, type); break;
        case R_S: v = static_cast<uint64_t>(sptr); break;
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
      TORCH_CHECK(false, "gems: cuLaunchKernel failed for aten::", name, ": ", msg);
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

}  // namespace
