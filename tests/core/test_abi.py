"""One contract between Python and the C++ fast path: gems/runtime/abi.py defines the codes and
limits both sides use, and the build generates the C++ header from it. The extension built here
(on first use, about 35 s on a CPU) must report abi.py's values, range numbers as Python does, and
group calls into plans exactly as Python's make_signature does: a recipe Python records for one
signature is replayed by C++ for every call with the same key, so a key coarser than Python's
signature would replay a plan for a call it was not recorded for, and a finer one would record it
again on every call."""
import inspect
import math
import os
import shutil

import pytest
import torch

from gems.runtime import abi, fast, plan


@pytest.fixture(scope="module")
def ext():
    if os.environ.get("GEMS_FAST", "1") in ("", "0"):
        pytest.skip("the fast path is switched off in this run (GEMS_FAST=0)")
    if not (os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")):
        pytest.skip("no C++ compiler on this machine (set CXX): the extension cannot be built here")
    m = fast.load()
    assert m is not None, fast.status()
    return m


def _public_constants():
    return {k: v for k, v in vars(abi).items() if k.isupper() and not k.startswith("_")}


def test_the_extension_reports_abi_values(ext):
    reported = dict(ext.ABI)
    for name, value in _public_constants().items():
        if name == "PTYPES":      # C++ names one code per width; Triton's aliases map onto them
            assert {k: abi.PTYPES[k] for k in reported[name]} == reported[name]
            assert set(reported[name].values()) == set(value.values())
        elif name == "FOREACH_ROLES":
            assert reported["FOREACH_ROLE_COUNT"] == len(value)
        else:
            assert name in reported, f"abi.{name} does not reach the C++ side (abi.header, module.cpp abi_values)"
            assert reported[name] == value, name
    assert ext.MAX_CONFIGS == abi.MAX_CONFIGS and ext.UNSCOPED == abi.UNSCOPED


def test_the_header_is_part_of_the_build_key(monkeypatch):
    before = fast._cache_dir()
    monkeypatch.setattr(abi, "MAX_PARAMS", abi.MAX_PARAMS + 1)
    assert fast._cache_dir() != before


_EDGES = [0, 1, -1, 2, 16, 127, 128, -128, -129, 255, 256, -255, -256, 32767, 32768, -32768, -32769, 65504,
          65505, -65504, -65505, 2 ** 31 - 1, 2 ** 31, -2 ** 31, -2 ** 31 - 1, 2 ** 40, 2 ** 63 - 1, -2 ** 63]


@pytest.mark.parametrize("v", _EDGES + [float(v) for v in _EDGES] + [
    0.5, -0.5, -0.0, 127.5, 254.9, 65504.5, 2.0 ** 63, math.nextafter(2.0 ** 63, 0), -2.0 ** 63,
    math.nextafter(-2.0 ** 63, -math.inf), 3.3895313892515355e38, math.nextafter(3.3895313892515355e38, math.inf),
    3.4028234663852886e38, -3.4028234663852886e38, 1e39, -1e300, math.inf, -math.inf, 1e-300])
def test_numbers_fall_in_the_same_range_class(ext, v):
    assert ext.number_range(v) == plan.number_range(v)


def _overload(name):
    base, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, base), overload or "default")


def _groups_agree(ext, name, dynamic, calls):
    """Python's signature and C++'s key put the calls (args, kwargs) in the same groups."""
    schema = _overload(name)._schema
    sig = plan.make_signature(schema, dynamic=frozenset(dynamic))
    flags = [a.name in dynamic for a in schema.arguments]
    py_keys = [sig(*args, **kwargs) for args, kwargs in calls]
    cpp_keys = [ext.signature_key(name, tuple(args), dict(kwargs), flags) for args, kwargs in calls]
    assert all(k is not None for k in cpp_keys)
    for i in range(len(calls)):
        for j in range(i + 1, len(calls)):
            same_py, same_cpp = py_keys[i] == py_keys[j], cpp_keys[i][0] == cpp_keys[j][0]
            assert same_py == same_cpp, (f"{name}: calls {i} and {j} are {'one' if same_py else 'two'} "
                                         f"signature(s) in Python, {'one' if same_cpp else 'two'} key(s) in C++")
    return py_keys


def _offset_view(shape, elements):
    """A tensor of `shape` starting `elements` float32 elements into a fresh buffer."""
    n = math.prod(shape)
    return torch.randn(n + elements)[elements:].view(shape)


def _numbers():
    """Numbers of every range class (abi.NUMBER_RANGES), both signs, and the values keyed apart."""
    per_range = [100, 200, 1000, 40000, 10 ** 6, 2 ** 40]
    floats = [float(v) for v in per_range] + [1e20, 3.3950e38, 1e300]
    return ([2.0, 3.0, 0.5, -1.0, -0.0, 0.0, math.nan, math.inf, -math.inf] + floats + [-v for v in floats]
            + [2, 3, 1, 0, -1, 16, 32] + per_range + [-v for v in per_range] + [True, False])


@pytest.mark.parametrize("dynamic", [(), ("other", "alpha")], ids=["by_value", "dynamic"])
def test_tensor_and_number_calls_group_alike(ext, dynamic):
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    calls = [
        ((x, y), {}), ((torch.randn(4, 8), torch.randn(4, 8)), {}), ((y, x), {}),
        ((x, x), {}),                                            # the same tensor twice
        ((x, torch.randn(1, 8)), {}), ((x, torch.randn(8)), {}), ((x, torch.randn(4, 1)), {}),   # broadcast
        ((torch.randn(1, 8), torch.randn(1, 8)), {}),            # size-1 dims
        ((x.t(), y.t()), {}), ((x[:, :4], y[:, :4]), {}),        # transposed, sliced
        ((_offset_view((4, 8), 1), y), {}), ((_offset_view((4, 8), 4), y), {}),   # 4 and 16 bytes in
        ((_offset_view((4, 8), 8), y), {}),
        ((x.double(), y.double()), {}),
        ((x, torch.tensor(2.0)), {}), ((x, torch.tensor(3.0)), {}), ((x, torch.tensor(2)), {}),   # CPU 0-dim
        ((x, y), {"alpha": 2}), ((x, y), {"alpha": 3}), ((x, y), {"alpha": 2.5}), ((x, y), {"alpha": -0.0}),
    ] + [((x, v), {}) for v in _numbers()] + [((x, y), {"alpha": v}) for v in _numbers()]
    _groups_agree(ext, "add.Tensor", dynamic, calls)


def test_nan_signs_by_value_group_alike(ext):
    x = torch.randn(4, 8)
    _groups_agree(ext, "add.Tensor", (), [((x, math.nan), {}), ((x, -math.nan), {})])


def test_three_tensors_alias_alike(ext):
    c = torch.rand(4, 8) > 0.5
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    calls = [((c, x, y), {}), ((c, x, x), {}), ((c, y, x), {}), ((c, y, y), {}), ((c, x, 2.0), {}),
             ((c, 2.0, x), {}), ((c, x, 0), {})]
    _groups_agree(ext, "where.self", (), calls)


def test_tensor_lists_group_alike(ext):
    x, y, z = torch.randn(2, 3), torch.randn(2, 3), torch.randn(4, 3)
    calls = [(([x, y], 0), {}), (([y, x], 0), {}), (([x, x], 0), {}), (([x, y], 1), {}), (([x, z], 0), {}),
             (([x, y, x], 0), {}), (([x, y, z], 0), {}), (([x, y, y], 0), {}), (([x], 0), {}),
             (([x.t(), y.t()], 0), {})]
    _groups_agree(ext, "cat.default", (), calls)
    many = [torch.randn(2) for _ in range(13)]     # past the pairwise aliasing bits
    calls = [((many, 0), {}), ((many[:6] + many[:7], 0), {}), ((many[:12] + many[:1], 0), {}),
             (([torch.randn(2) for _ in range(13)], 0), {})]
    _groups_agree(ext, "cat.default", (), calls)


def test_int_lists_and_optionals_group_alike(ext):
    x = torch.randn(4, 8)
    calls = [((x, [0]), {}), ((x, [1]), {}), ((x, [0, 1]), {}), ((x, None), {}), ((x, [0], True), {}),
             ((x, [0], False), {}), ((x, [0]), {"dtype": torch.float64}), ((x, [0]), {"dtype": torch.float32})]
    _groups_agree(ext, "sum.dim_IntList", (), calls)


def test_cpp_builds_no_key_for_tensors_it_cannot_replay(ext):
    z = torch.randn(4, dtype=torch.complex64)
    flags = [False, False, False]
    assert ext.signature_key("add.Tensor", (z.conj(), z), {}, flags) is None
    assert ext.signature_key("add.Tensor", (z, 1j), {}, flags) is None
    assert ext.signature_key("add.Tensor", (z, z), {}, flags) is not None


def test_foreach_roles_are_the_kernels_parameters():
    # the C++ side fills a published foreach binary's parameters by role: the kernel's runtime
    # parameters, in order (ops/foreach/launch.py publishes each by its index)
    from gems.ops.foreach.launch import foreach_kernel
    params = inspect.signature(foreach_kernel.fn.fn).parameters.values()     # the Python function
    runtime = tuple(p.name for p in params if "constexpr" not in str(p.annotation))
    assert runtime == abi.FOREACH_ROLES
