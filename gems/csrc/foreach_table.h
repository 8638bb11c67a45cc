// The C++ passes over a _foreach_* call's tensor lists that the Python path calls
// (ops/foreach/launch.py).
//
// Python would do this work at about 1 us per tensor and list: `foreach_lists` checks that one launch
// serves the lists (list 0's dtype and device throughout, contiguous tensors, list 0's shapes; the
// reasons and their order are launch.uniform_lists'); `foreach_table` checks in-place operands for
// overlaps (launch.lists_overlap) and writes the launch's table (launch.table) as bytes;
// `foreach_empty` allocates a functional variant's results. foreach_serve.h reuses the overlap check
// and the table for the calls it serves whole.
#pragma once

#include "common.h"

namespace {

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

// Whether in-place operands race (launch.lists_overlap, the same rules): list 0 is written; lists
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

// The launch's table (ops/foreach/launch.py): [S_0 .. S_{N-1} | row_i = (n_i, address_i in each column of
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
