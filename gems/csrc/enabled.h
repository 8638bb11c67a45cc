// Whether Gems serves a call on this thread: a mirror of gems.dispatch's enabled state.
//
// enable() sets the global config, use_gems() a thread's own. Backward work autograd runs on a thread
// of its own follows the scope of the thread that started the backward: Python finds it (autograd
// carries the starting thread's thread-local Python objects to its threads) and tells set_task, per
// thread, which config the running graph task has. Python keeps these in sync through the module's
// set_global / set_any_scope / set_thread / set_task; a config is an id for one include/exclude
// selection.
#pragma once

#include "common.h"

namespace {

std::atomic<int> g_cfg{-1};           // enable()'s config id, -1 when off
std::atomic<bool> g_any_scope{false}; // some thread is inside a use_gems() scope
thread_local int t_cfg = kUnscoped;   // this thread's use_gems() config, or kUnscoped
thread_local int64_t t_task = -1;     // the autograd graph task t_task_cfg belongs to
thread_local int t_task_cfg = kUnscoped;  // its config on this thread (kUnscoped: enable()'s)
thread_local int t_depth = 0;         // > 0 while this thread runs Python on behalf of a Gems op
std::atomic<bool> g_check{false};     // GEMS_PLAN_CHECK: the first call of a new recipe replays it

// which configs serve one overload: per config id (kMaxConfigs of them), whether it is included
struct Membership {
  std::vector<uint8_t> on = std::vector<uint8_t>(kMaxConfigs, 0);

  // whether the config in force for this call on this thread serves the overload (false: Python
  // decides -- Gems off, the overload not selected, or a case not mirrored here)
  bool serves() const {
    int cfg = t_cfg;
    if (cfg == kUnscoped) {
      if (g_any_scope.load(std::memory_order_relaxed)) {
        // backward work a scoped thread may have started: its graph task's config, once Python
        // has resolved it on this thread (until then Python decides)
        int64_t task = torch::autograd::get_current_graph_task_id();
        if (task != -1) {
          if (task != t_task) return false;
          cfg = t_task_cfg;
        }
      }
      if (cfg == kUnscoped) cfg = g_cfg.load(std::memory_order_relaxed);
    }
    return cfg >= 0 && cfg < kMaxConfigs && on[cfg];
  }
};

}  // namespace
