// The headers and names every part of the C++ fast path uses.
//
// The fast path is one translation unit (module.cpp includes the parts in order): the per-call code
// (signature.h, replay.h, kernel.h, foreach_serve.h) is inlined across parts as it would be in one
// file, and the extension stays one compile on first use. Each part lives in an anonymous namespace.
// gems_abi.h is generated from gems/runtime/abi.py into the build directory (runtime/fast.py): the
// codes and limits shared with Python are defined there once.
#pragma once

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
#include <cstddef>
#include <iterator>
#include <optional>
#include <limits>
#include <cstring>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "gems_abi.h"

namespace py = pybind11;
using c10::IValue;
using torch::jit::Stack;
using namespace gems_abi;
