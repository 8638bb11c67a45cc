"""Op classification: compute vs view/metadata vs creation/random vs other."""
import pytest

from gems_coverage.classify import COMPUTE, CREATION, OTHER, VIEW, classify, packet_of


@pytest.mark.parametrize("name,cat", [
    ("mm.default", COMPUTE), ("add.Tensor", COMPUTE), ("_to_copy.default", COMPUTE), ("clone.default", COMPUTE),
    ("native_layer_norm.default", COMPUTE), ("_safe_softmax.default", COMPUTE), ("cat.default", COMPUTE),
    ("native_dropout.default", COMPUTE), ("copy_.default", COMPUTE), ("addcmul_.default", COMPUTE),
    ("view.default", VIEW), ("_unsafe_view.default", VIEW), ("t.default", VIEW), ("transpose.int", VIEW),
    ("expand.default", VIEW), ("slice.Tensor", VIEW), ("alias.default", VIEW), ("detach.default", VIEW),
    ("unsqueeze.default", VIEW), ("as_strided.default", VIEW), ("split.Tensor", VIEW), ("permute.default", VIEW),
    ("lift_fresh.default", VIEW),
    ("zeros.default", CREATION), ("ones_like.default", CREATION), ("arange.start", CREATION),
    ("empty.memory_format", CREATION), ("full.default", CREATION), ("scalar_tensor.default", CREATION),
    ("normal_.default", CREATION), ("randint.low", CREATION), ("fill_.Scalar", CREATION),
    ("_local_scalar_dense.default", OTHER), ("profiler::_record_function_enter_new.default", OTHER),
    ("prims::convert_element_type.default", OTHER),
])
def test_classify(name, cat):
    assert classify(name) == cat


def test_packet():
    assert packet_of("add.Tensor") == "add" and packet_of("aten::mm") == "mm"


def test_dtype_supported_checks_the_first_tensor_like_the_dispatcher():
    import torch
    from gems_coverage.gemsinfo import ImplInfo, dtype_supported
    impl = ImplInfo("where.self", "pointwise", (torch.bool,))
    assert dtype_supported(impl, {"bool"}) is True
    assert dtype_supported(ImplInfo("silu.default", "pointwise", (torch.float32,)), {"bf16"}) is False
    assert dtype_supported(None, {"f32"}) is None and dtype_supported(impl, set()) is None
