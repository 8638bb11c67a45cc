// Whether Gems serves a call on this thread: a mirror of gems.dispatch's enabled state.
//
// enable() sets the global config, use_gems() a thread's own; autograd's device threads follow the
// innermost active scope while a backward pass runs. Python keeps these in sync through the module's
// set_global / set_top_scope / set_thread; a config is an id for one include/exclude selection.
#pragma once

#include "common.h"

namespace {

std::atomic<int> g_cfg{-1};           // enable()'s config id, -1 when off
std::atomic<int> g_top_scope{-1};     // innermost active use_gems() scope's config, -1 when none
thread_local int t_cfg = kUnscoped;   // this thread's use_gems() config, or kUnscoped
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
      cfg = g_cfg.load(std::memory_order_relaxed);
      if (cfg < 0) {
        int top = g_top_scope.load(std::memory_order_relaxed);
        if (top < 0 || torch::autograd::get_current_graph_task_id() == -1) return false;
        cfg = top;
      }
    }
    return cfg >= 0 && cfg < kMaxConfigs && on[cfg];
  }
};

}  // namespace
