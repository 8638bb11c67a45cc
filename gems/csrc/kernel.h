// The boxed kernel the dispatcher calls for a served overload: the first code a call meets.
//
// Per call it
//   1. decides whether Gems serves the call on this thread (enabled.h), else calls the Python kernel;
//   2. for a _foreach_* overload, serves the call whole (foreach_serve.h), or hands it to the Python
//      kernel, which publishes the binary it compiled when that was all that was missing;
//   3. builds the call's key (signature.h);
//   4. on a hit replays the key's recipe (replay.h), or calls ATen's kernel where the recorded decision
//      was ATen's;
//   5. on a miss (or a guard that declines) calls the Python kernel (python_kernel.h), which records a
//      plan the usual way and publishes its recipe back for this key.
#pragma once

#include "common.h"
#include "enabled.h"
#include "foreach_serve.h"
#include "op.h"
#include "python_kernel.h"
#include "replay.h"
#include "signature.h"

namespace {

thread_local Key t_key;

struct Kernel final : c10::OperatorKernel {
  std::shared_ptr<Op> op;
  explicit Kernel(std::shared_ptr<Op> o) : op(std::move(o)) {}

  void operator()(const c10::OperatorHandle& h, c10::DispatchKeySet ks, Stack* stack) {
    Op& o = *op;
    if (t_depth > 0 || !o.member.serves()) {
      call_python(o, h, stack, nullptr);
      return;
    }
    size_t n = h.schema().arguments().size();
    if (o.fe) {
      std::vector<int64_t> miss;
      if (foreach_serve(*o.fe, o.fe_launches, o.name, *stack, n, miss)) {
        o.hits.fetch_add(1, std::memory_order_relaxed);
        return;
      }
      if (miss.empty()) {
        call_python(o, h, stack, nullptr);
        return;
      }
      // served but not yet compiled: the Python kernel launches it and publishes the binary
      ForeachPending prev = std::move(t_fpending);
      t_fpending = ForeachPending{&o.fe_launches, std::move(miss)};
      try {
        call_python(o, h, stack, nullptr);
      } catch (...) {
        t_fpending = std::move(prev);
        throw;
      }
      t_fpending = std::move(prev);
      return;
    }
    Key& key = t_key;
    if (!make_key(*stack, n, o.dynamic, o.precision_key, key)) {
      call_python(o, h, stack, nullptr);
      return;
    }
    if (auto r = o.plans.find(key)) {
      if (r->aten >= 0) {   // a recorded decision for ATen's kernel (Unsupported(signature=True))
        o.aten.counts[r->aten].fetch_add(1, std::memory_order_relaxed);
        o.aten.kernel->callBoxed(h, ks, stack);
        return;
      }
      if (replay(*r, *stack, n, o.name)) {
        o.hits.fetch_add(1, std::memory_order_relaxed);
        return;
      }
      call_python(o, h, stack, nullptr);   // declined (overlapping out=/in-place): the full path
      return;
    }
    Key mine = key;   // the thread-local one is reused by nested calls
    call_python(o, h, stack, &mine);
  }
};

}  // namespace
