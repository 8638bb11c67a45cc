// Replaying a recipe: the per-call work of a call whose key has one.
//
// Overlap guards for written arguments (a guard that meets memory declines: the Python kernel then
// decides exactly as it would without a recipe), the allocations, the launches (cuLaunchKernel on
// the recorded CUfunction; under the Triton interpreter a call back into Python), the results. Per-call
// numbers and Philox state are read from the call; everything else was fixed when the plan was
// recorded for the call's key.
#pragma once

#include "common.h"
#include "driver.h"
#include "enabled.h"
#include "recipe.h"

namespace {

// a per-call number (a dynamic argument) as double or int64
struct Num {
  bool is_float;
  double d;
  int64_t i;
};

// the number an argument gives a kernel parameter, converted as the recipe says (Conv)
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

// a number as the bytes of a kernel parameter of type `type` (PType), as Triton's launcher packs it
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

// a tensor-list element named in a recipe: (schema argument index << kListElementBits) | element index
const IValue& list_element(const IValue* args, int ref) {
  return args[ref >> kListElementBits].toListRef()[ref & ((1 << kListElementBits) - 1)];
}

// the tensor a recipe names: an argument, a list element or one of this call's allocations
const at::Tensor& source(const IValue* args, const c10::SmallVector<at::Tensor, 4>& outs, int src, int idx) {
  if (src == SRC_LIST_ELEMENT) return list_element(args, idx).toTensor();
  return src == SRC_ARG ? args[idx].toTensor() : outs[idx];
}

// whether every overlap guard passes: a written argument's memory meets no other tensor it names
bool guards_pass(const Recipe& r, const IValue* args) {
  for (const auto& g : r.guards) {
    const auto& a = args[g.written];
    const IValue& b = g.other >= kListRef ? list_element(args, g.other - kListRef) : args[g.other];
    if (!a.isTensor() || !b.isTensor() || !a.toTensor().defined() || !b.toTensor().defined()) continue;
    auto pa = reinterpret_cast<uintptr_t>(a.toTensor().const_data_ptr());
    auto pb = reinterpret_cast<uintptr_t>(b.toTensor().const_data_ptr());
    if (pa < pb + g.other_bytes && pb < pa + g.written_bytes) return false;
  }
  return true;
}

// the recipe's allocations for this call: torch's CUDA caching allocator directly where it serves
// the current device (no dispatcher round trip), else at::empty_strided
void allocate(const Recipe& r, c10::SmallVector<at::Tensor, 4>& outs) {
  for (const auto& a : r.allocs) {
    at::Tensor t;
    if (a.device.is_cuda() && a.device.index() == current_device() && cuda_allocator()) {
      t = at::detail::empty_strided_generic(a.sizes, a.strides, cuda_allocator(),
                                            c10::DispatchKeySet(c10::DispatchKey::CUDA), a.dtype);
    } else {
      t = at::empty_strided(a.sizes, a.strides, at::TensorOptions().dtype(a.dtype).device(a.device));
    }
    if (a.fill == FILL_ZEROS) {
      t.zero_();
    } else if (a.fill == FILL_POISON) {
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
}

// one CUDA launch: its parameters packed as Triton's launcher passes them, then cuLaunchKernel on
// the current stream of the launch's device
void launch_cuda(const Launch& L, const IValue* args, const c10::SmallVector<at::Tensor, 4>& outs,
                 const std::string& name) {
  uint64_t storage[kMaxParams];
  void* params[kMaxParams + 2];
  size_t np = L.params.size();
  TORCH_CHECK(np <= kMaxParams, "gems fast path: too many kernel parameters");   // such plans keep their Python replay
  uint64_t philox_seed = 0, philox_offset = 0;
  TensorMap maps[kMaxTma];
  int n_maps = 0;
  for (size_t i = 0; i < np; i++) {
    const Param& P = L.params[i];
    if (P.kind == P_TMA) {
      // the signature's descriptor with this call's address; a 128-byte parameter by value
      TensorMap& m = maps[n_maps++];
      m = *P.tmap;
      auto addr = reinterpret_cast<uintptr_t>(source(args, outs, P.src, P.idx).const_data_ptr()) + P.byte_off;
      int err = g_cuTensorMapReplaceAddress(&m, reinterpret_cast<void*>(addr));
      TORCH_CHECK(err == 0, "gems: cuTensorMapReplaceAddress failed for aten::", name, " (error ", err, ")");
      params[i] = &m;
      continue;
    }
    if (P.kind == P_TENSOR) {
      storage[i] = reinterpret_cast<uintptr_t>(source(args, outs, P.src, P.idx).const_data_ptr()) + P.byte_off;
    } else if (P.kind == P_CONST) {
      storage[i] = P.payload;
    } else if (P.kind == P_PHILOX) {
      if (P.conv == PHILOX_SEED) philox_state(P.idx, P.payload, &philox_seed, &philox_offset);
      storage[i] = P.conv == PHILOX_SEED ? philox_seed : philox_offset;
    } else {
      storage[i] = pack(read_number(args[P.idx], P.conv), P.type);
    }
    params[i] = &storage[i];
  }
  uint64_t scratch[2] = {0, 0};   // Triton's global and profile scratch pointers (unused)
  params[np] = &scratch[0];
  params[np + 1] = &scratch[1];
  if (L.grid[0] * L.grid[1] * L.grid[2] == 0) return;
  void* stream = cuda_stream(L.device);
  ensure_context(L.device);
  int err = g_cuLaunchKernel(L.function, L.grid[0], L.grid[1], L.grid[2], L.block, 1, 1, L.shared, stream,
                             params, nullptr);
  if (err != 0) {
    const char* msg = "unknown";
    if (g_cuGetErrorString) g_cuGetErrorString(err, &msg);
    TORCH_CHECK(false, "gems: cuLaunchKernel failed for aten::", name, ": ", msg);
  }
}

// one launch under the interpreter: Triton's Python launch, called with tensors and Python numbers
void launch_interpreter(const Launch& L, const IValue* args, const c10::SmallVector<at::Tensor, 4>& outs) {
  py::gil_scoped_acquire gil;
  py::tuple pargs(L.params.size());
  for (size_t i = 0; i < L.params.size(); i++) {
    const Param& P = L.params[i];
    py::object o;
    if (P.kind == P_TENSOR) {
      const at::Tensor& base = source(args, outs, P.src, P.idx);
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

// the recipe's answer for the call whose n arguments are on top of the stack (they are replaced by
// its results); false: it declines (the caller goes on to the Python kernel with the stack untouched)
bool replay(const Recipe& r, Stack& stack, size_t n, const std::string& name) {
  const IValue* args = stack.data() + stack.size() - n;
  if (r.random && !r.launches.empty() && stream_capturing(cuda_stream(r.launches[0].device))) return false;
  if (!guards_pass(r, args)) return false;
  c10::SmallVector<at::Tensor, 4> outs;
  allocate(r, outs);
  for (const auto& L : r.launches) {
    if (L.cuda) {
      launch_cuda(L, args, outs, name);
    } else {
      launch_interpreter(L, args, outs);
    }
  }
  c10::SmallVector<IValue, 4> results;
  for (const auto& R : r.results) {
    if (R.src == SRC_UNDEFINED) {   // a result not asked for (a backward's output mask): undefined, as ATen's
      results.emplace_back(at::Tensor());
      continue;
    }
    if (R.src == SRC_CONST_INT) {   // an int result that only the keyed shapes decide (attention's max_q)
      results.emplace_back(R.value);
      continue;
    }
    const at::Tensor& base = source(args, outs, R.src, R.idx);
    results.emplace_back(R.view.on ? base.as_strided(R.view.sizes, R.view.strides,
                                                     base.storage_offset() + R.view.offset)
                                   : base);
  }
  torch::jit::drop(stack, n);
  for (auto& v : results) stack.push_back(std::move(v));
  return true;
}

}  // namespace
