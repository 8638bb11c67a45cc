// The extension module: Python's handle on the fast path (gems/runtime/fast.py loads it,
// gems.dispatch drives it) and the dispatcher registrations.
//
// Why a C++ fast path: a Python kernel behind the dispatcher costs ~1.3x ATen's host time per call
// even when all it does is look up a plan (GIL, IValue -> PyObject conversion of every argument, the
// Python frame, torch.empty_strided, Triton's C launcher parsing a Python tuple). Models call
// thousands of small ops per step, so that host time is the step time.
//
// What: one boxed C++ kernel per served overload (kernel.h), registered at the backend key on top of
// the Python kernel, which stays registered underneath and keeps every behaviour: support checks,
// fallbacks, errors, recording. Python is entered only on misses, while Gems is off for the call,
// and under the interpreter.
//
// The parts, in the order they build on each other (one translation unit, see common.h):
//   common.h         includes; gems_abi.h, generated from gems/runtime/abi.py (the shared codes)
//   driver.h         the CUDA driver looked up at run time, streams, Philox state, the allocator
//   enabled.h        whether Gems serves a call on this thread (gems.dispatch's enabled state)
//   signature.h      a call's key
//   recipe.h         recorded plans as data, parsed from Python's tuples
//   replay.h         running a recipe for a call
//   foreach_table.h  the C++ passes the Python path of _foreach_* ops calls
//   foreach_serve.h  _foreach_* calls served whole
//   op.h             one served overload: its recipes, ATen decisions, membership, foreach state
//   python_kernel.h  handing a call to the Python kernel, and what it publishes back
//   kernel.h         the boxed kernel the dispatcher calls
//   module.cpp       the Python bindings and registrations (this file)

#include <ATen/ScalarOps.h>

#include "common.h"
#include "driver.h"
#include "enabled.h"
#include "foreach_serve.h"
#include "foreach_table.h"
#include "kernel.h"
#include "op.h"
#include "python_kernel.h"
#include "recipe.h"
#include "replay.h"
#include "signature.h"

namespace {

// registrations: one torch::Library fragment per register() call; destroying it restores what was
// registered underneath (the Python kernels)
std::vector<std::unique_ptr<torch::Library>> g_libs;

// the dispatcher's handle of an overload named as Gems names it ("add.Tensor", "relu.default")
c10::OperatorHandle aten_handle(const std::string& name) {
  auto dot = name.find('.');
  std::string base = "aten::" + name.substr(0, dot);
  std::string overload = dot == std::string::npos ? "" : name.substr(dot + 1);
  if (overload == "default") overload = "";
  return c10::Dispatcher::singleton().findSchemaOrThrow(base.c_str(), overload.c_str());
}

// the values this build took from gems_abi.h, under abi.py's names
py::dict abi_values() {
  py::dict d;
  py::list ranges;
  for (int k = 0; k < kNumberRanges; k++) {
    if (k < kIntRanges) {
      ranges.append(py::make_tuple(kIntRangeLo[k], kIntRangeHi[k]));
    } else {
      ranges.append(py::make_tuple(kFloatRangeLo[k], kFloatRangeHi[k]));
    }
  }
  d["NUMBER_RANGES"] = py::tuple(ranges);
  d["BEYOND_RANGE"] = kBeyondRange;
  d["INF_RANGE"] = kInfRange;
  d["SRC_ARG"] = int(SRC_ARG);
  d["SRC_ALLOC"] = int(SRC_ALLOC);
  d["SRC_UNDEFINED"] = int(SRC_UNDEFINED);
  d["SRC_LIST_ELEMENT"] = int(SRC_LIST_ELEMENT);
  d["SRC_CONST_INT"] = int(SRC_CONST_INT);
  d["LIST_ELEMENT_BITS"] = kListElementBits;
  d["LIST_REF"] = kListRef;
  d["LAUNCH_CUDA"] = int(LAUNCH_CUDA);
  d["LAUNCH_INTERPRETER"] = int(LAUNCH_INTERPRETER);
  d["PARAM_TENSOR"] = int(P_TENSOR);
  d["PARAM_CONST"] = int(P_CONST);
  d["PARAM_DYN"] = int(P_DYN);
  d["PARAM_PHILOX"] = int(P_PHILOX);
  d["PARAM_TMA"] = int(P_TMA);
  py::dict conv;
  conv[""] = int(C_RAW);
  conv["float"] = int(C_FLOAT);
  conv["int"] = int(C_INT);
  conv[".item()"] = int(C_ITEM);
  d["CONVERSIONS"] = conv;
  py::dict ptypes;
  ptypes["i8"] = int(T_I8);
  ptypes["i16"] = int(T_I16);
  ptypes["i32"] = int(T_I32);
  ptypes["i64"] = int(T_I64);
  ptypes["fp32"] = int(T_F32);
  ptypes["fp64"] = int(T_F64);
  ptypes["fp16"] = int(T_F16);
  ptypes["bf16"] = int(T_BF16);
  d["PTYPES"] = ptypes;
  d["PTR_TYPE"] = int(T_PTR);
  d["FILL_NONE"] = int(FILL_NONE);
  d["FILL_ZEROS"] = int(FILL_ZEROS);
  d["FILL_POISON"] = int(FILL_POISON);
  d["MAX_PARAMS"] = kMaxParams;
  d["MAX_PLANS"] = kMaxPlans;
  d["PHILOX_SEED_BIT"] = kPhiloxSeedBit;
  d["PHILOX_OFFSET_BASE"] = kPhiloxOffsetBase;
  d["PHILOX_SEED"] = int(PHILOX_SEED);
  d["PHILOX_OFFSET"] = int(PHILOX_OFFSET);
  d["MAX_CONFIGS"] = kMaxConfigs;
  d["UNSCOPED"] = kUnscoped;
  d["FOREACH_NO_SCALAR"] = int(FS_NONE);
  d["FOREACH_SCALAR"] = int(FS_SCALAR);
  d["FOREACH_SCALARLIST"] = int(FS_LIST);
  d["FOREACH_TENSOR"] = int(FS_TENSOR);
  d["FOREACH_ROLE_COUNT"] = int(R_COUNT);
  d["FOREACH_FACTS"] = kForeachFacts;
  d["FOREACH_MAX_TABLES"] = kForeachMaxTables;
  return d;
}

// the stack the dispatcher would hand the Kernel for these Python arguments (a test aid): a Python
// number at a Tensor position becomes a wrapped number, as torch's argument parser makes it
at::Tensor wrapped_number(py::handle v) {
  at::Tensor t;
  if (PyBool_Check(v.ptr())) {
    t = c10::scalar_to_tensor(at::Scalar(v.cast<bool>()));
  } else if (PyLong_Check(v.ptr())) {
    t = c10::scalar_to_tensor(at::Scalar(v.cast<int64_t>()));
  } else if (PyComplex_Check(v.ptr())) {
    t = c10::scalar_to_tensor(at::Scalar(c10::complex<double>(PyComplex_RealAsDouble(v.ptr()),
                                                              PyComplex_ImagAsDouble(v.ptr()))));
  } else {
    t = c10::scalar_to_tensor(at::Scalar(v.cast<double>()));
  }
  t.unsafeGetTensorImpl()->set_wrapped_number(true);
  return t;
}

Stack stack_for(const c10::FunctionSchema& schema, py::tuple args, py::dict kwargs) {
  Stack stack;
  const auto& sargs = schema.arguments();
  for (size_t i = 0; i < sargs.size(); i++) {
    const auto& a = sargs[i];
    py::object v;
    if (i < args.size()) {
      v = args[i];
    } else if (kwargs.contains(a.name())) {
      v = kwargs[py::str(a.name())];
    } else {
      TORCH_CHECK(a.default_value().has_value(), "signature_key: no value for ", a.name());
      stack.push_back(*a.default_value());
      continue;
    }
    auto type = a.real_type();
    if (auto opt = type->cast<c10::OptionalType>()) type = opt->getElementType();
    bool number = PyFloat_Check(v.ptr()) || PyLong_Check(v.ptr()) || PyComplex_Check(v.ptr());
    if (type->kind() == c10::TensorType::Kind && number) {
      stack.emplace_back(wrapped_number(v));
    } else {
      stack.push_back(torch::jit::toIValue(v, a.real_type()));
    }
  }
  return stack;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Gems' C++ fast path (gems/csrc/module.cpp)";
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
      // a _foreach_* overload (ops/foreach/overloads.py's registrations): served whole by foreach_serve.
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
        o.member.on[cfg] = on;
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
        o.plans.put(*p.key, std::move(r));
        p.replay = replay;
        p.key = nullptr;
        return true;
      })
      // the call this thread's Python kernel is serving goes to ATen for its whole signature
      // (Unsupported(signature=True)): later calls with this key call ATen's kernel from here
      .def("publish_aten", [](Op& o, const std::string& reason) {
        Pending& p = t_pending;
        if (p.op != &o || p.key == nullptr || !o.aten.kernel) return false;
        int id = o.aten.reason_id(reason);
        if (id < 0) return false;
        auto r = std::make_shared<Recipe>();
        r->aten = id;
        o.plans.put(*p.key, std::move(r));
        p.key = nullptr;
        return true;
      })
      // capture ATen's kernel at `dispatch_key` (call before Gems registers its own there)
      .def("capture_aten", [](Op& o, const std::string& dispatch_key) {
        if (o.aten.kernel) return;
        auto h = aten_handle(o.name);
        auto key = c10::parseDispatchKey(dispatch_key);
        if (h.hasComputedKernelForDispatchKey(key)) o.aten.kernel.emplace(h.getComputedKernelForDispatchKey(key));
      })
      .def("aten_counts", [](Op& o) { return o.aten.counts_by_reason(); })
      .def("reset_aten_counts", [](Op& o) { o.aten.reset_counts(); })
      .def("pending", [](Op& o) { return t_pending.op == &o && t_pending.key != nullptr; })
      .def("clear", &Op::clear)
      .def("size", [](Op& o) { return o.plans.size(); })
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
  m.def("set_any_scope", [](bool on) { g_any_scope = on; });
  m.def("set_task", [](int64_t task, int cfg) { t_task = task; t_task_cfg = cfg; });
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
  m.def("foreach_pending", []() { return t_fpending.launches != nullptr; });
  // the launch of that call: taken (true) only if the Python path's binary facts are the ones C++
  // computed for the call. facts: (dtype, device index, smode, W, VEC, Base aligned, S's dtype or None,
  // S aligned, then whether N, TOP, LOGN, B0, S0 fit 32 bits); launch: (0, CUfunction, threads, shared
  // bytes, chunk, ((role, type), ..)) or (1, interpreter callable, chunk)
  m.def("foreach_publish", [](py::tuple facts, py::tuple launch) {
    ForeachPending& p = t_fpending;
    if (p.launches == nullptr || facts.size() != kForeachFacts) return false;
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
    ForeachLaunches* launches = p.launches;
    p.launches = nullptr;
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
    launches->add(std::move(f), std::move(fl));
    return true;
  });
  m.attr("UNSCOPED") = kUnscoped;
  m.attr("MAX_CONFIGS") = kMaxConfigs;

  // test aids (tests/core/test_abi.py): what this build took from gems_abi.h, and how it keys calls
  m.attr("ABI") = abi_values();
  m.def("number_range", [](py::object v) {
    if (py::isinstance<py::float_>(v)) return float_range(v.cast<double>());
    return int_range(v.cast<int64_t>());
  });
  // the key the Kernel builds for aten::`name` called with these arguments (the objects the Python
  // kernel receives: a Python number at a Tensor position stands for a wrapped number), or None where
  // it builds none. dynamic: per schema argument, whether its numbers are keyed by class.
  m.def("signature_key", [](const std::string& name, py::tuple args, py::dict kwargs, std::vector<uint8_t> dynamic)
                             -> py::object {
    const auto& schema = aten_handle(name).schema();
    Stack stack = stack_for(schema, args, kwargs);
    TORCH_CHECK(dynamic.size() == stack.size(), "signature_key: one dynamic flag per schema argument");
    Key key;
    if (!make_key(stack, stack.size(), dynamic, false, key)) return py::none();
    return py::make_tuple(py::tuple(py::cast(key.words)), key.hash);
  });
}
