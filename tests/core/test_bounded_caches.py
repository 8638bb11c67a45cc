"""Every cache a call can grow is bounded: the source of evicted call plans leaves linecache, and
the selection caches (op sets of include=/exclude= selections, the C++ side's config ids) keep a
bounded number of selections however many distinct ones a process builds."""
import linecache
import os
import subprocess
import sys

import torch

import gems
from gems.dispatch import selection
from gems.dispatch import state
from gems.dispatch.state import STATE
from gems.runtime.plan import cache as plan_cache
from harness import DEVICE, make


def _sources(prefix):
    return [k for k in linecache.cache if k.startswith(prefix)]


def test_evicted_plans_leave_linecache(monkeypatch):
    """4000 signatures through a plan cache of 8: linecache keeps only the plans still cached, whether
    they were compiled at once, compiled lazily, replaced, or compiled after their eviction."""
    monkeypatch.setattr(plan_cache, "MAX_PLANS", 8)
    prefix = "<gems bounded-cache test plan"
    cache = plan_cache.PlanCache()
    src = "def plan(x):\n    return x + 1\n"
    held = []
    for i in range(4000):
        name = f"{prefix} #{i}>"
        if i % 3 == 0:
            p = plan_cache.compile_plan(src, name, {}, None)
        else:
            p = plan_cache.LazyPlan(src, name, {}, None)
        cache.put(i, p)
        if i % 3 == 1:
            assert cache.plans[i](1) == 2     # compiles it: its source enters linecache
        if i % 500 == 2:
            held.append(p)                    # compiled only after its eviction, through this reference
        if i % 7 == 0:
            cache.put(i, plan_cache.compile_plan(src, name + " again", {}, None))   # replaced
    assert all(p(1) == 2 for p in held)
    assert len(cache.plans) == 8
    assert len(_sources(prefix)) <= 8, len(_sources(prefix))
    cache.clear()
    assert not _sources(prefix)


def test_dispatcher_plans_leave_linecache_with_the_python_path_only(tmp_path):
    """The issue's measurement, through the dispatcher with GEMS_FAST=0: many shapes, a bounded
    linecache."""
    code = (
        "import linecache, torch, gems\n"
        "from gems.runtime.plan import cache\n"
        "cache.MAX_PLANS = 8\n"
        "with gems.use_gems(include=['neg.default']):\n"
        "    for i in range(1, 300):\n"
        "        x = torch.randn(i)\n"
        "        for _ in range(3):\n"
        "            assert torch.equal(torch.neg(x), -x)\n"
        "print(sum(k.startswith('<gems plan neg') for k in linecache.cache),\n"
        "      gems.dispatch.op_runtime('neg.default').plans.built)\n")
    env = dict(os.environ, GEMS_FAST="0", TRITON_INTERPRET="1", GEMS_PLAN_AFTER="1")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    in_linecache, built = map(int, r.stdout.split()[-2:])
    assert built >= 299 and in_linecache <= 8, (in_linecache, built)


def test_distinct_selections_leave_the_selection_caches_bounded(monkeypatch):
    """1000 distinct include= selections: the op-set cache and the config ids stay bounded, ids are
    reused only when nothing selects their op set, and every selection is still served as it says
    (the C++ fast path's membership of a reused id is rewritten)."""
    monkeypatch.setattr(state, "MAX_CONFIG_IDS", 16)
    ids_before = len(STATE.cfg_ids)
    ops = [n for n in gems.registered_ops() if n not in ("neg.default", "gelu.default")][:50]
    x = make((4, 8))
    neg = gems.dispatch.op_runtime("neg.default")
    gelu = gems.dispatch.op_runtime("gelu.default")
    with gems.use_gems(include=["gelu.default"]):      # held throughout: its id is never reused
        n = 0
        for i in range(len(ops)):
            for j in range(i + 1, len(ops)):
                if n == 1000:
                    break
                with gems.use_gems(include=[ops[i], ops[j]]):
                    pass
                n += 1
        assert n == 1000
        assert len(STATE.cfg_cache) <= selection.MAX_SELECTIONS
        assert len(STATE.cfg_ids) <= max(16, ids_before)
        g0, n0 = gelu.served, neg.served
        for _ in range(3):
            torch.testing.assert_close(torch.nn.functional.gelu(x),
                                       torch.nn.functional.gelu(x.double()).float())
            torch.neg(x)
        assert gelu.served == g0 + 3 and neg.served == n0
        with gems.use_gems(include=["neg.default"]):
            for _ in range(3):
                torch.nn.functional.gelu(x)
                torch.neg(x)
        assert gelu.served == g0 + 3 and neg.served == n0 + 3
    assert DEVICE in ("cpu", "cuda")
