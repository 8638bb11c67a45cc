"""use_gems() is thread-local, backward included: each thread is served exactly as its own scope says
while other threads hold other scopes; a backward follows the scope of the thread that started it
(on CUDA autograd runs it on device threads of its own), never another thread's."""
import threading

import pytest
import torch
import torch.nn.functional as F

import gems
from harness import DEVICE, make

GELU = ("gelu.default", "gelu_backward.default")
SILU = ("silu.default", "silu_backward.default")
ALL = GELU + SILU


def _counts():
    return {n: gems.dispatch.op_runtime(n).served for n in ALL}


def _forward_backward(x):
    """gelu and silu forward and backward, checked against float64 ATen."""
    for fn in (F.gelu, F.silu):
        a = x.detach().clone().requires_grad_(True)
        y = fn(a)
        y.backward(torch.ones_like(y))
        ref = x.detach().double().requires_grad_(True)
        fn(ref).backward(torch.ones_like(ref))
        torch.testing.assert_close(y, fn(ref).detach().float(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a.grad, ref.grad.float(), rtol=1e-5, atol=1e-5)


def _in_turns(workers):
    """Run each worker's body in a thread of its own, all of them inside their scopes at once, one body
    at a time (so gems.stats() deltas belong to one thread); returns each body's served deltas."""
    n = len(workers)
    entered = threading.Barrier(n + 1, timeout=60)
    turn = [threading.Event() for _ in range(n)]
    done = [threading.Event() for _ in range(n)]
    leave = threading.Event()
    deltas, errors = [None] * n, []

    def run(i, scope, body):
        try:
            ctx = scope() if scope is not None else None
            if ctx is not None:
                ctx.__enter__()
            try:
                entered.wait()
                assert turn[i].wait(60)
                before = _counts()
                body()
                after = _counts()
                deltas[i] = {k: after[k] - before[k] for k in ALL}
                done[i].set()
                assert leave.wait(60)
            finally:
                if ctx is not None:
                    ctx.__exit__(None, None, None)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)
            done[i].set()

    threads = [threading.Thread(target=run, args=(i, s, b)) for i, (s, b) in enumerate(workers)]
    for t in threads:
        t.start()
    entered.wait()
    for i in range(n):
        turn[i].set()
        assert done[i].wait(120)
    leave.set()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return deltas


def test_scope_does_not_leak_into_an_unscoped_backward():
    """The issue's case: while thread A holds use_gems(include=gelu and gelu_backward), a forward and
    backward in thread B with no scope at all runs ATen only."""
    x = make((4, 16))
    a, b = _in_turns([(lambda: gems.use_gems(include=list(GELU)), lambda: None),
                      (None, lambda: _forward_backward(x))])
    assert b == dict.fromkeys(ALL, 0), b


def test_threads_with_different_scopes_are_each_served_as_their_own_scope_says():
    x = make((4, 16))
    work = [(lambda: gems.use_gems(include=list(GELU)), lambda: _forward_backward(x)),
            (lambda: gems.use_gems(include=list(SILU)), lambda: _forward_backward(x)),
            (None, lambda: _forward_backward(x)),
            (lambda: gems.use_gems(include=["gelu.default", "silu_backward.default"]), lambda: _forward_backward(x))]
    gelu_only, silu_only, unscoped, mixed = _in_turns(work)
    # silu's backward is silu_backward; gelu's is gelu_backward: one call each per body
    assert gelu_only == {"gelu.default": 1, "gelu_backward.default": 1, "silu.default": 0,
                         "silu_backward.default": 0}, gelu_only
    assert silu_only == {"gelu.default": 0, "gelu_backward.default": 0, "silu.default": 1,
                         "silu_backward.default": 1}, silu_only
    assert unscoped == dict.fromkeys(ALL, 0), unscoped
    assert mixed == {"gelu.default": 1, "gelu_backward.default": 0, "silu.default": 0,
                     "silu_backward.default": 1}, mixed


def test_a_backward_follows_enable_outside_scopes_and_the_scope_inside_one():
    """With enable(include=silu) process-wide and a gelu scope held by another thread: an unscoped
    thread's backward follows enable(), a scoped thread's its scope, repeatedly (plans replayed)."""
    x = make((4, 16))
    gems.enable(include=list(SILU))
    try:
        def three_times():
            for _ in range(3):
                _forward_backward(x)
        held, unscoped, scoped = _in_turns([(lambda: gems.use_gems(include=list(GELU)), lambda: None),
                                            (None, three_times),
                                            (lambda: gems.use_gems(include=list(GELU)), three_times)])
    finally:
        gems.disable()
    assert unscoped == {"gelu.default": 0, "gelu_backward.default": 0, "silu.default": 3,
                        "silu_backward.default": 3}, unscoped
    assert scoped == {"gelu.default": 3, "gelu_backward.default": 3, "silu.default": 0,
                      "silu_backward.default": 0}, scoped


def test_nested_scopes_restore_what_a_backward_sees():
    x = make((4, 16))
    before = _counts()
    with gems.use_gems(include=list(SILU)):
        with gems.use_gems(include=list(GELU)):
            pass
        _forward_backward(x)     # the outer scope again, forward and backward
    _forward_backward(x)         # no scope: ATen
    after = _counts()
    assert {k: after[k] - before[k] for k in ALL} == {"gelu.default": 0, "gelu_backward.default": 0,
                                                      "silu.default": 1, "silu_backward.default": 1}


@pytest.mark.skipif(DEVICE != "cuda", reason="autograd's device threads run CUDA backward work only")
def test_backward_on_autograd_device_threads_follows_the_starting_thread():
    """On CUDA the backward kernels run on autograd's device thread, which never entered a scope: they
    follow the scope of the thread that called backward(), and only that one."""
    x = make((4, 16))

    def scoped_body():
        for _ in range(3):
            _forward_backward(x)

    held, scoped, unscoped = _in_turns([(lambda: gems.use_gems(include=list(SILU)), lambda: None),
                                        (lambda: gems.use_gems(include=list(GELU)), scoped_body),
                                        (None, scoped_body)])
    assert scoped == {"gelu.default": 3, "gelu_backward.default": 3, "silu.default": 0,
                      "silu_backward.default": 0}, scoped
    assert unscoped == dict.fromkeys(ALL, 0), unscoped


def test_backward_work_on_an_unscoped_thread_follows_its_graph_task():
    """What autograd's device threads see, on the CPU: a thread outside any scope of its own runs the
    nodes of a graph task whose starting thread-local state holds a gems.use_gems() selection (here
    stashed by hand where use_gems() stashes it; autograd restores the captured state around every
    node). The nodes follow that selection, not the scope another thread holds; within one graph task
    the C++ fast path replays what Python resolved for its first call."""
    from gems.dispatch import state
    x = make((4, 16))
    bw = gems.dispatch.op_runtime("gelu_backward.default")
    gelu_only = gems.use_gems(include=list(GELU)).cfg

    def device_thread_like():
        torch._C._stash_obj_in_tls(state.SCOPE_KEY, gelu_only)
        try:
            hits = bw.fast.hits if bw.fast is not None else 0
            for _ in range(3):
                a = x.detach().clone().requires_grad_(True)
                y = F.gelu(F.gelu(F.gelu(a)))        # three gelu_backward nodes in one graph task
                y.backward(torch.ones_like(y))
                ref = x.detach().double().requires_grad_(True)
                F.gelu(F.gelu(F.gelu(ref))).backward(torch.ones_like(ref))
                torch.testing.assert_close(a.grad, ref.grad.float(), rtol=1e-5, atol=1e-5)
            if bw.fast is not None:
                assert bw.fast.hits > hits, "the C++ fast path replayed nothing within a graph task"
        finally:
            torch._C._stash_obj_in_tls(state.SCOPE_KEY, None)

    held, unscoped = _in_turns([(lambda: gems.use_gems(include=list(SILU)), lambda: None),
                                (None, device_thread_like)])
    # the forward ran outside any selection (ATen); each backward node followed the graph task's
    assert unscoped == {"gelu.default": 0, "gelu_backward.default": 9, "silu.default": 0,
                        "silu_backward.default": 0}, unscoped


def test_a_stashed_scope_stays_alive_while_stashed():
    """Some torch releases' TLS stash releases a reference it never took: the stashed op set would be
    freed while stashed (reads then returned unrelated objects). Fresh op sets, stashed and replaced
    many times, must read back intact."""
    import gc

    from gems.dispatch import state

    for i in range(30):   # each gc.collect() walks the whole heap of a long-lived test worker
        state.stash_scope(frozenset({f"op{i}.default", "add.Tensor"}))
        gc.collect()
        got = torch._C._get_obj_in_tls(state.SCOPE_KEY)
        assert got == frozenset({f"op{i}.default", "add.Tensor"})
    state.stash_scope(None)
    assert torch._C._get_obj_in_tls(state.SCOPE_KEY) is None
