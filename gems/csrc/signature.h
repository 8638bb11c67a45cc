// A call's key: the facts a recorded plan depends on, read from the dispatcher's stack.
//
// Per tensor: dtype, device, sizes, strides, 16-byte alignment; numbers by value (or, for arguments
// the op declared dynamic, by class, sign, range class, NaN-ness and what Triton specializes ints
// on); lists, strings, devices by value; which tensor arguments are the same tensor; the current
// device; torch's default dtype. It is at least as fine as runtime/plan/signature.py's make_signature, so a
// recipe recorded for a Python plan is valid for every call with this key (tests/core/test_abi.py
// checks that the two group calls alike). Codes and ranges come from gems_abi.h.
#pragma once

#include "common.h"
#include "driver.h"

namespace {

// tensors (list elements included) a call's key may hold: a call with more runs the Python kernel
constexpr int kMaxKeyTensors = 128;

// a call's key: its words and their hash (plans are looked up by hash, then compared by words)
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

// the range class of a per-call number (abi.NUMBER_RANGES, plan/signature.py's number_range): the index of the
// narrowest of nested dtype ranges holding it, kBeyondRange beyond, kInfRange for +-inf, so that an
// op's "does it fit the dtype" check decides alike for every call of a key. An int64 always fits one
// of the leading int-bounded ranges (the int64 range is among them).
int64_t int_range(int64_t i) {
  for (int k = 0; k < kIntRanges; k++) {
    if (i >= kIntRangeLo[k] && i <= kIntRangeHi[k]) return k;
  }
  return kBeyondRange;
}

// (not NaN; the bounds are the doubles on the inside of each range, so that the comparison decides
// as Python's exact one of a float with an int bound)
int64_t float_range(double d) {
  for (int k = 0; k < kNumberRanges; k++) {
    if (d >= kFloatRangeLo[k] && d <= kFloatRangeHi[k]) return k;
  }
  return std::isinf(d) ? kInfRange : kBeyondRange;
}

// a number's part of the key; `dynamic`: by class, sign, range class and NaN-ness (ints: also what
// Triton specializes), else by value -- the facts plan/signature.py's _dyn_sig keys
void key_number(std::vector<int64_t>& w, const IValue& v, bool dynamic) {
  if (v.isDouble()) {
    double d = v.toDouble();
    w.push_back(10);
    // per-call floats key NaN-ness, sign and range (an op's check may send such numbers to ATen), and
    // -0.0 apart from +0.0 and from the negative numbers, like _dyn_sig
    w.push_back(!dynamic ? bits(d) : std::isnan(d) ? -1 : int64_t(std::signbit(d)) | float_range(d) << 1 |
                int64_t(d == 0.0 && std::signbit(d)) << 8);
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
// a tensor's part of the key: dtype, device, sizes, strides, 16-byte alignment
bool key_tensor(std::vector<int64_t>& w, const at::Tensor& t, c10::TensorImpl** impls, int& n_impls) {
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

// the key of the call whose n arguments are on top of the stack; false: no key (a kind of argument
// a plan cannot serve), the Python kernel decides. dynamic: per schema argument, whether its
// numbers are keyed by class; precision_key: the key includes the fp32 matmul precision (GEMM).
bool make_key(const Stack& stack, size_t n, const std::vector<uint8_t>& dynamic, bool precision_key, Key& key) {
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
      // elements join the aliasing pattern after the tensors before them (Python's order:
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

}  // namespace
