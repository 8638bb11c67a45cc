// Handing a call to the overload's Python kernel (gems.dispatch), and what it may publish back.
//
// The Python kernel keeps every behaviour the C++ side does not mirror: support checks, fallbacks,
// errors, recording. While it serves a call the C++ side holds that call's key (t_pending), so that
// a plan recorded for it is published for exactly that key (Op.publish / publish_aten). t_depth
// counts the Python frames run on behalf of a Gems op: calls made from there take the Python kernel.
#pragma once

#include "common.h"
#include "enabled.h"
#include "op.h"
#include "replay.h"
#include "signature.h"

namespace {

struct Pending {           // the key a Python-kernel call may publish a recipe for
  Op* op = nullptr;
  const Key* key = nullptr;
  bool replay = false;     // GEMS_PLAN_CHECK: answer this call from the recipe just published
};
thread_local Pending t_pending;

// the Python kernel, called as torch.library calls a Python kernel (same args/kwargs split)
void call_py(const Op& o, const c10::FunctionSchema& schema, std::vector<IValue>& arguments, Stack* stack) {
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
  PyObject* res = PyObject_Call(o.py_kernel.ptr(), args.ptr(), kwargs.ptr());
  if (!res) throw python_error();
  py::object out = py::reinterpret_steal<py::object>(res);
  const auto& rets = schema.returns();
  if (rets.empty()) {
    TORCH_CHECK(out.is_none(), "gems: aten::", o.name, " returned a value where its schema has none");
  } else if (rets.size() == 1) {
    stack->push_back(torch::jit::toIValue(out, rets[0].real_type()));
  } else {
    auto seq = py::cast<py::sequence>(out);
    for (size_t i = 0; i < rets.size(); i++) stack->push_back(torch::jit::toIValue(seq[i], rets[i].real_type()));
  }
}

// the call on top of the stack answered by the overload's Python kernel. key: the call's key when a
// recipe may be published for it (the Python kernel records and publishes through Op.publish)
void call_python(Op& o, const c10::OperatorHandle& op, Stack* stack, const Key* key) {
  const auto& schema = op.schema();
  size_t n = schema.arguments().size();
  std::vector<IValue> saved;
  if (key != nullptr && g_check.load(std::memory_order_relaxed)) {
    saved.assign(stack->end() - n, stack->end());
  }
  Pending prev = t_pending;
  t_pending = Pending{key ? &o : nullptr, key, false};
  t_depth++;
  try {
    py::gil_scoped_acquire gil;
    auto arguments = torch::jit::pop(*stack, n);
    call_py(o, schema, arguments, stack);
  } catch (...) {
    t_depth--;
    t_pending = prev;
    throw;
  }
  t_depth--;
  bool check_replay = t_pending.replay;
  t_pending = prev;
  if (check_replay && !saved.empty()) {
    // GEMS_PLAN_CHECK: the Python side restored what the call wrote; answer from the new recipe
    auto r = o.plans.find(*key);
    torch::jit::drop(*stack, schema.returns().size());
    for (auto& v : saved) stack->push_back(v);
    if (r && replay(*r, *stack, n, o.name)) return;
    auto arguments = torch::jit::pop(*stack, n);
    t_depth++;
    try {
      py::gil_scoped_acquire gil;
      call_py(o, schema, arguments, stack);
    } catch (...) {
      t_depth--;
      throw;
    }
    t_depth--;
  }
}

}  // namespace
