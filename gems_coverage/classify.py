"""Classify ATen overloads into compute, view/metadata, creation/random and other.

Coverage is computed over *compute* ops: the ones that launch a kernel which reads and writes values.
View/metadata ops only make a new tensor header (no kernel); creation/random ops allocate or fill from
nothing; *other* covers host synchronisation, profiler markers and ops from other namespaces.
"""
from __future__ import annotations

COMPUTE = "compute"
VIEW = "view"
CREATION = "creation"
OTHER = "other"
CATEGORIES = (COMPUTE, VIEW, CREATION, OTHER)
CATEGORY_LABELS = {COMPUTE: "compute", VIEW: "view/metadata", CREATION: "creation/random", OTHER: "other"}

# Ops that return a view of (or metadata about) their input: no kernel runs.
VIEW_OPS = frozenset("""
view _unsafe_view view_as reshape _reshape_alias t transpose transpose_ t_ permute expand expand_as
slice select narrow unsqueeze unsqueeze_ squeeze squeeze_ alias detach detach_ as_strided as_strided_
unfold split split_with_sizes unsafe_split unsafe_split_with_sizes chunk unsafe_chunk tensor_split unbind
diagonal movedim moveaxis swapaxes swapdims flatten unflatten view_as_real view_as_complex real imag
_conj _neg_view conj resolve_conj resolve_neg lift lift_fresh positive numpy_T matrix_H mT mH adjoint
_indices _values indices values crow_indices col_indices ccol_indices row_indices
sym_size sym_stride sym_numel sym_storage_offset size stride numel dim is_contiguous storage_offset
is_same_size is_complex is_floating_point is_nonzero _has_compatible_shallow_copy_type result_type
_shape_as_tensor set_ _nested_view_from_buffer _fw_primal _make_dual _unpack_dual
""".split())

# Ops that create a tensor from nothing (allocation, constants, ranges) or draw random numbers.
CREATION_OPS = frozenset("""
empty empty_like empty_strided new_empty new_empty_strided empty_permuted zeros zeros_like new_zeros
ones ones_like new_ones full full_like new_full fill fill_ zero_ arange range linspace logspace eye
scalar_tensor tensor lift_fresh_copy _to_dense
rand rand_like randn randn_like randint randint_like randperm normal normal_ uniform_ bernoulli
bernoulli_ random_ exponential_ geometric_ log_normal_ cauchy_ multinomial poisson
tril_indices triu_indices
""".split())

# Host syncs, bookkeeping and other non-kernel calls.
OTHER_OPS = frozenset("""
_local_scalar_dense item record_stream resize_ resize_as_ _assert_async _assert_scalar
_assert_tensor_metadata _functional_assert_async sym_constrain_range _print is_pinned pin_memory
_pin_memory _record_function_enter _record_function_enter_new _record_function_exit
""".split())


def packet_of(overload: str) -> str:
    """'add.Tensor' -> 'add'; 'aten::mm' -> 'mm'; 'profiler::x.y' keeps its namespace."""
    name = overload
    if name.startswith("aten::"):
        name = name[len("aten::"):]
    return name.split(".", 1)[0]


def classify(overload: str) -> str:
    """Category of an ATen overload name such as 'add.Tensor' or 'mm.default'.

    Names with a namespace other than aten ('profiler::...', 'prims::...') are 'other'.
    """
    if "::" in overload and not overload.startswith("aten::"):
        return OTHER
    p = packet_of(overload)
    if p in VIEW_OPS:
        return VIEW
    if p in CREATION_OPS:
        return CREATION
    if p in OTHER_OPS:
        return OTHER
    return COMPUTE
