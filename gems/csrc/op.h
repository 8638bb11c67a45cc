// One served overload (Op): what the Kernel needs to answer its calls, in named parts.
//
//   PlanTable   the recipes published for its keys (bounded: an op seeing kMaxPlans keys starts over)
//   AtenRoute   ATen's own kernel and the recorded decisions to call it (Unsupported(signature=True)),
//               with a count per reason
//   Membership  which configs (enable() / use_gems() selections) serve it (enabled.h)
//   foreach     for a _foreach_* overload: how to read its calls and the binaries published for them
//
// Python creates one Op per overload (gems.dispatch) and registers it at the backend key (module.cpp).
#pragma once

#include "common.h"
#include "enabled.h"
#include "foreach_serve.h"
#include "recipe.h"
#include "signature.h"

namespace {

// the recipes of one overload, by key
struct PlanTable {
  std::mutex mu;
  std::unordered_map<uint64_t, std::vector<std::pair<std::vector<int64_t>, std::shared_ptr<Recipe>>>> plans;
  size_t count = 0;

  std::shared_ptr<Recipe> find(const Key& k) {
    std::lock_guard<std::mutex> g(mu);
    auto it = plans.find(k.hash);
    if (it == plans.end()) return nullptr;
    for (auto& e : it->second) {
      if (e.first == k.words) return e.second;
    }
    return nullptr;
  }

  void put(const Key& k, std::shared_ptr<Recipe> r) {
    std::lock_guard<std::mutex> g(mu);
    if (count >= kMaxPlans) {   // an op seeing this many signatures: start over
      plans.clear();
      count = 0;
    }
    auto& bucket = plans[k.hash];
    for (auto& e : bucket) {
      if (e.first == k.words) {
        e.second = std::move(r);
        return;
      }
    }
    bucket.emplace_back(k.words, std::move(r));
    count++;
  }

  void clear() {
    std::lock_guard<std::mutex> g(mu);
    plans.clear();
    count = 0;
  }

  size_t size() {
    std::lock_guard<std::mutex> g(mu);
    return count;
  }
};

// ATen's kernel at this key as it was before Gems registered (replays of ATen decisions call it),
// the reasons of those decisions and how many calls each sent there
struct AtenRoute {
  static constexpr int kMaxReasons = 16;
  std::optional<c10::SafeKernelFunction> kernel;
  std::mutex mu;
  std::vector<std::string> reasons;
  std::atomic<int64_t> counts[kMaxReasons] = {};

  // the id under which calls sent to ATen for `reason` are counted; -1 when kMaxReasons are taken
  int reason_id(const std::string& reason) {
    std::lock_guard<std::mutex> g(mu);
    for (size_t i = 0; i < reasons.size(); i++) {
      if (reasons[i] == reason) return static_cast<int>(i);
    }
    if (reasons.size() >= kMaxReasons) return -1;
    reasons.push_back(reason);
    return static_cast<int>(reasons.size()) - 1;
  }

  py::dict counts_by_reason() {
    py::dict d;
    std::lock_guard<std::mutex> g(mu);
    for (size_t i = 0; i < reasons.size(); i++) {
      int64_t c = counts[i].load();
      if (c) d[py::str(reasons[i])] = c;
    }
    return d;
  }

  void reset_counts() {
    for (auto& c : counts) c = 0;
  }
};

struct Op : std::enable_shared_from_this<Op> {
  std::string name;
  py::object py_kernel;            // gems.dispatch's Python kernel for this overload
  std::vector<uint8_t> dynamic;    // per schema argument: numbers keyed by class
  bool precision_key = false;      // GEMM: the key includes the fp32 matmul precision
  Membership member;
  std::atomic<int64_t> hits{0};    // calls answered in C++
  AtenRoute aten;
  PlanTable plans;
  std::shared_ptr<ForeachSpec> fe;   // a _foreach_* overload: served by foreach_serve
  ForeachLaunches fe_launches;

  void clear() {
    plans.clear();
    fe_launches.clear();
  }
};

}  // namespace
