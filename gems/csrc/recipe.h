// Recipes: a recorded plan as data the C++ replay runs (replay.h), and their parsing.
//
// runtime/plan/recipe.py builds a recipe from a recorded call and hands it to Op.publish as nested tuples:
// (guards, allocations, launches, results). A guard names a written argument and another tensor whose
// memory must not meet it; an allocation is an output or workspace (sizes, strides, dtype, device,
// fill); a launch is a CUDA binary (CUfunction, grid, block, shared bytes, device) or the
// interpreter's callable, with its parameters; a result names a tensor (an argument, an allocation,
// a list element; maybe a view of it), an undefined tensor or a constant int. The codes (SRC_*,
// P_*, T_*, C_*, FILL_*, kListRef) are abi.py's, through gems_abi.h.
#pragma once

#include "common.h"
#include "driver.h"

namespace {

struct View {     // an as_strided view of a source tensor (interpreter arguments, results)
  bool on = false;
  std::vector<int64_t> sizes, strides;
  int64_t offset = 0;   // elements, added to the source's storage offset
};

struct Param {
  int kind = P_CONST;
  int src = SRC_ARG, idx = 0;   // P_TENSOR, P_TMA: the source (SRC_ARG, SRC_ALLOC, SRC_LIST_ELEMENT)
                                // and its index;
                            // P_DYN: argument index
  int64_t byte_off = 0;     // P_TENSOR on CUDA
  View view;                // P_TENSOR under the interpreter
  int type = T_I64;         // CUDA parameter type
  uint64_t payload = 0;     // P_CONST on CUDA: the packed value
  int conv = C_RAW;         // P_DYN; P_PHILOX: PHILOX_SEED or PHILOX_OFFSET (payload: counters drawn,
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
  int fill = FILL_NONE;   // FILL_ZEROS: a workspace; FILL_POISON (GEMS_POISON test aid): NaN / -1 / true
};

struct Guard {
  int written, other;
  int64_t written_bytes, other_bytes;
};

struct Result {
  int src = SRC_ARG, idx = 0;   // SRC_UNDEFINED: an undefined tensor; SRC_CONST_INT: the int `value`
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

// A TMA descriptor as Triton's launcher encodes it (driver.c fillTMADescriptor), from recipe.py's
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
    L.cuda = lt[0].cast<int>() == LAUNCH_CUDA;
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
    if (R.src == SRC_CONST_INT) {
      R.value = rt[1].cast<int64_t>();
    } else {
      R.idx = rt[1].cast<int>();
      R.view = parse_view(rt[2]);
    }
    rec->results.push_back(std::move(R));
  }
  return rec;
}

}  // namespace
