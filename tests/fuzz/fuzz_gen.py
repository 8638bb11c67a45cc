"""Random calls of a registered ATen overload, built from its schema (the differential fuzz's generator).

`make_case(name, seed, index)` returns a `Case` (the call's args and kwargs, on the test device) or raises
`Skip(reason)` when the schema holds an argument that cannot be drawn sensibly (sizes, generators, index
tensors, ...). A case is a pure function of (name, seed, index): `python -m pytest tests/fuzz` with
GEMS_FUZZ_SEED=<seed> GEMS_FUZZ_OPS=<name> GEMS_FUZZ_CASE=<index> replays one.

Tensors get random shapes (0- and 1-size dims, odd sizes), broadcasting between tensor arguments, layouts
(contiguous, sliced, transposed, permuted, expanded, channels_last for 4-d), the op's declared dtypes and
some it does not declare (int, bool, fp16, fp32), and special values (nan, +-inf, -0.0, large values).
"""
from __future__ import annotations

import math
import random
import zlib
from dataclasses import dataclass, field

import torch

from gems import registry

INF, NAN = float("inf"), float("nan")
# bfloat16 is not exact on the Triton interpreter (docs/known-differences.md): drawn on the GPU only
EXTRA_DTYPES = [torch.int32, torch.int64, torch.bool, torch.float16, torch.float32, torch.uint8]
FLOAT_SPECIALS = [NAN, INF, -INF, -0.0, 0.0, 3.0e38, -3.0e38, 6.5e4, 1e-40, 1.0, -1.0]
SCALARS = [0, 1, 2, -1, 3, 7, 300, 2**31, 0.5, -1.5, 2.0, 1e10, NAN, INF, -INF, -0.0, 3e38, True]
DIMS = [0, 1, 1, 2, 3, 5, 7, 16, 33]
MAX_NUMEL = 4096

# Ops whose arguments the schema cannot describe well enough (indices into another tensor, sizes,
# random streams, kernels with their own test files' generators): skipped, counted and listed.
SKIP_OPS = {
    "convolution": "convolution geometry", "convolution_backward": "convolution geometry",
    "native_dropout": "random", "native_dropout_backward": "random mask", "multinomial": "random",
    "scatter": "duplicate indices write in any order", "scatter_": "duplicate indices write in any order",
    "index": "index tensors", "index_put": "index tensors",
    "index_put_": "index tensors", "slice_backward": "sizes", "masked_scatter_backward": "sizes",
    "_fused_adam_": "optimizer state", "_fused_adamw_": "optimizer state",
    "_fused_adam": "optimizer state", "_fused_adamw": "optimizer state",
}
SKIP_WORDS = ("attention", "efficient", "flash", "cudnn", "rand", "bernoulli", "normal", "uniform",
              "exponential")
# arguments drawn from a fixed set of values ATen accepts (plus a wrong one where it says so)
CHOICES = {"approximate": ["none", "tanh"], "rounding_mode": [None, "trunc", "floor"],
           "ord": [2, 1, INF, -INF, 0, 3.5], "p": [0.0], "reduction": [0, 1, 2],
           # a ScalarType drawn as any small int reached -1 (no dtype): on the GPU such a call ended the
           # worker process, a case no user can write with a torch.dtype
           "out_dtype": [torch.float32, torch.float16, torch.bfloat16, torch.int32]}
UNDRAWABLE = {"generator", "sizes", "input_sizes", "output_mask", "bias_sizes", "stride", "padding",
              "dilation", "output_padding", "attn_mask", "start", "end", "step",
              "ignore_index", "num_weights", "num_samples", "target",
              "src_dtype", "state_steps"}


class Skip(Exception):
    pass


@dataclass
class Case:
    name: str
    seed: int
    index: int
    args: list
    kwargs: dict
    special: bool = False          # the inputs hold nan/inf/-0.0/huge values
    notes: list = field(default_factory=list)

    def describe(self) -> str:
        def d(v):
            if isinstance(v, torch.Tensor):
                return f"T{tuple(v.shape)}:{str(v.dtype)[6:]}:{tuple(v.stride())}"
            if isinstance(v, (list, tuple)):
                return "[" + ", ".join(d(x) for x in v) + "]"
            return repr(v)
        parts = [d(a) for a in self.args] + [f"{k}={d(v)}" for k, v in self.kwargs.items()]
        return f"{self.name}({', '.join(parts)})"


def skip_reason(name: str):
    """Why `name` is not fuzzed from its schema (None when it is)."""
    base = name.split(".")[0]
    if base in BUILDERS:
        return None
    if base in SKIP_OPS:
        return SKIP_OPS[base]
    if any(w in base for w in SKIP_WORDS):
        return "random or attention"
    for a in registry.aten_overload(name)._schema.arguments:
        if a.name in UNDRAWABLE and (str(a.type) != "Tensor" or a.name in ("target", "attn_mask")):
            return f"argument {a.name}"
    return None


class _Draw:
    def __init__(self, name, seed, index, device):
        self.rng = random.Random(zlib.crc32(f"{seed}:{name}:{index}".encode()))
        self.gen = torch.Generator().manual_seed(self.rng.getrandbits(31))
        self.device = device
        self.special = False

    def shape(self, ndim=None):
        nd = self.rng.choice([0, 1, 1, 2, 2, 3, 4]) if ndim is None else ndim
        for _ in range(8):
            s = tuple(self.rng.choice(DIMS) for _ in range(nd))
            if _numel(s) <= MAX_NUMEL:
                return s
        return tuple(self.rng.choice([1, 2, 3]) for _ in range(nd))

    def broadcast_to(self, base):
        """A shape that broadcasts with `base` (leading dims dropped, some dims 1); rarely one that does not."""
        r = self.rng.random()
        if r < 0.03 and base:
            return tuple(d + 1 for d in base)
        s = list(base[self.rng.randint(0, len(base)):] if r < 0.3 else base)
        return tuple(1 if self.rng.random() < 0.25 else d for d in s)

    def values(self, shape, dtype):
        if dtype == torch.bool:
            return torch.rand(shape, generator=self.gen) > 0.5
        if not dtype.is_floating_point:
            lo = 0 if dtype == torch.uint8 else -5
            return torch.randint(lo, 6, shape, generator=self.gen, dtype=torch.int64).to(dtype)
        scale = self.rng.choice([1.0, 1.0, 3.0, 100.0])
        t = torch.randn(shape, generator=self.gen, dtype=torch.float64) * scale
        if t.numel() and self.rng.random() < 0.25:
            self.special = True
            flat = t.view(-1)
            for _ in range(self.rng.randint(1, 3)):
                flat[self.rng.randrange(flat.numel())] = self.rng.choice(FLOAT_SPECIALS)
        return t.to(dtype)

    def tensor(self, shape, dtype):
        """A tensor of `shape` in a random layout."""
        shape = tuple(shape)
        nd, kind = len(shape), self.rng.choice(["contiguous", "contiguous", "sliced", "transposed",
                                                   "permuted", "expanded", "channels_last"])
        if kind == "sliced" and nd:
            t = self.values(shape[:-1] + (2 * shape[-1] + 1,), dtype)[..., 1::2]
        elif kind == "transposed" and nd >= 2:
            t = self.values(shape[:-2] + (shape[-1], shape[-2]), dtype).transpose(-1, -2)
        elif kind == "permuted" and nd >= 2:
            perm = list(range(nd))
            self.rng.shuffle(perm)
            inv = [perm.index(i) for i in range(nd)]
            t = self.values(tuple(shape[p] for p in perm), dtype).permute(inv)
        elif kind == "expanded" and nd:
            d = self.rng.randrange(nd)
            t = self.values(shape[:d] + (1,) + shape[d + 1:], dtype).expand(shape)
        elif kind == "channels_last" and nd == 4:
            t = self.values(shape, dtype).contiguous(memory_format=torch.channels_last)
        else:
            t = self.values(shape, dtype)
        assert tuple(t.shape) == shape
        return t.to(self.device)

    def dim(self, nd):
        if self.rng.random() < 0.03:
            return max(nd, 1) + 1                  # out of range: ATen's IndexError
        n = max(nd, 1)
        return self.rng.randrange(-n, n)

    def dims(self, nd):
        n = max(nd, 1)
        k = self.rng.randint(0 if self.rng.random() < 0.1 else 1, n)
        return sorted(self.rng.sample(range(n), k), key=lambda _: self.rng.random())


def _numel(s):
    n = 1
    for d in s:
        n *= d
    return n


def _dtype_of(impl, draw, backend):
    served = [d for d in registry.dtypes_on(impl, backend) if d != torch.bfloat16 or backend == "cuda"]
    if served and draw.rng.random() < 0.75:
        return draw.rng.choice(served)
    return draw.rng.choice(EXTRA_DTYPES)


def _scalar(draw, name):
    if name in CHOICES:
        return draw.rng.choice(CHOICES[name])
    if name == "alpha" and draw.rng.random() < 0.5:
        return 1
    v = draw.rng.choice(SCALARS)
    if isinstance(v, float) and v != v or v in (INF, -INF) or v == 3e38:
        draw.special = True
    return v


def make_case(name: str, seed: int, index: int, device: str = "cpu") -> Case:
    reason = skip_reason(name)
    if reason:
        raise Skip(reason)
    impl = registry.get(name)
    backend = "cuda" if device == "cuda" else "interpreter"
    schema = registry.aten_overload(name)._schema
    draw = _Draw(name, seed, index, device)
    dtype = _dtype_of(impl, draw, backend)
    base_name = name.split(".")[0]
    if base_name in BUILDERS:
        args = BUILDERS[base_name](draw, dtype)
        kwargs = {a.name: torch.empty(0, dtype=_out_dtype(a.name, args, dtype), device=device)
                  for a in schema.arguments if a.kwarg_only and a.alias_info is not None and a.alias_info.is_write}
        return Case(name, seed, index, args, kwargs, special=draw.special)
    is_list = any(str(a.type) == "List[Tensor]" for a in schema.arguments)
    base = draw.shape()
    list_shapes = [draw.shape() for _ in range(draw.rng.randint(1, 3))]
    shapes = _fixed_shapes(name.split(".")[0], draw)
    if shapes:
        base = shapes["self"]
    if name.startswith(("cat.", "stack.")):
        list_shapes = [base] * len(list_shapes)
    nd = len(base)
    args, kwargs, drawn = [], {}, {}
    first_tensor = True
    for a in schema.arguments:
        t, n = str(a.type), a.name
        mutable = a.alias_info is not None and a.alias_info.is_write
        if n == "out" or (mutable and a.kwarg_only):
            # an out= argument: empty (ATen resizes it) or of a wrong dtype now and then
            od = torch.int64 if n == "indices" or (n == "out" and name.startswith(("argmax", "argmin"))) else dtype
            if draw.rng.random() < 0.1:
                od = draw.rng.choice(EXTRA_DTYPES)
            v = torch.empty(0, dtype=od, device=device)
        elif t == "Tensor" and n in ("index", "indices"):
            v = _index_tensor(draw, name.split(".")[0], drawn, base)
        elif t == "Tensor" and n in shapes:
            v = draw.tensor(shapes[n], dtype)
            first_tensor = False
        elif t == "Tensor" or t == "Optional[Tensor]":
            if t.startswith("Optional") and draw.rng.random() < 0.3:
                v = None
            else:
                if first_tensor and not is_list:
                    shape = base
                elif is_list or n in ("scalars",):
                    shape = () if n == "other" else (len(list_shapes),)
                elif n in ("weight", "bias") and "normalized_shape" in [x.name for x in schema.arguments]:
                    shape = None
                elif name.startswith(("_softmax_backward_data", "_log_softmax_backward_data")):
                    shape = base   # ATen's CPU kernel divides by zero (SIGFPE) on an empty grad of another shape
                else:
                    shape = draw.broadcast_to(base)
                d = dtype if draw.rng.random() < 0.8 or n == "mask" else draw.rng.choice(EXTRA_DTYPES)
                if n == "mask":
                    d = torch.bool
                v = draw.tensor(shape, d) if shape is not None else ("norm", d)
            first_tensor = False
        elif t == "List[Tensor]":
            if draw.rng.random() < 0.2:
                d = draw.rng.choice(EXTRA_DTYPES)
            else:
                d = dtype
            v = [draw.tensor(s, d) for s in list_shapes]
        elif t == "List[number]":
            v = [_scalar(draw, n) for _ in list_shapes]
        elif t in ("number", "Optional[number]"):
            v = None if t.startswith("Optional") and draw.rng.random() < 0.3 else _scalar(draw, n)
        elif t == "int" and n == "dim":
            v = draw.dim(nd)
        elif t == "Optional[int]" and n == "dim":
            v = None if draw.rng.random() < 0.3 else draw.dim(nd)
        elif t in ("List[int]", "Optional[List[int]]") and n == "dim":
            v = None if t.startswith("Optional") and draw.rng.random() < 0.3 else draw.dims(nd)
        elif t == "List[int]" and n == "normalized_shape":
            v = list(base[len(base) - draw.rng.randint(1, max(nd, 1)):]) if nd else []
        elif t == "List[int]" and n == "pad":
            v = [draw.rng.randint(-2, 3) for _ in range(2 * draw.rng.randint(1, max(nd, 1)))]
        elif t == "int" and n == "input_dtype":
            v = drawn["output"].dtype if "output" in drawn else dtype
        elif t == "int" and n == "padding_idx":
            v = draw.rng.choice([-1, 0, 1])
        elif t == "int" and n in CHOICES:
            v = draw.rng.choice(CHOICES[n])
        elif t == "int":
            v = draw.rng.randint(-3, 4) if n not in ("k", "groups") else draw.rng.randint(0, 3)
        elif t == "Optional[int]" and n == "dtype":
            v = None if draw.rng.random() < 0.6 else draw.rng.choice(
                [torch.float32, torch.float16, torch.int64, torch.float64, torch.int32, torch.bool])
        elif t.startswith("Optional[") and n in ("memory_format", "layout", "device", "pin_memory", "stable",
                                                   "train"):
            v = None
        elif t in ("bool", "Optional[bool]"):
            v = False if n in ("sparse", "sparse_grad", "non_blocking", "scale_grad_by_freq") else \
                draw.rng.random() < 0.5
        elif t in ("float", "Optional[float]"):
            if t.startswith("Optional") and draw.rng.random() < 0.4:
                v = None
            else:
                v = draw.rng.choice([1e-5, 0.1, 1.0, 2.5]) if n == "eps" else draw.rng.choice(
                    [0.5, -1.0, 2.0, 0.0, 1e30, NAN])
        elif t in ("str", "Optional[str]") and n in CHOICES:
            v = draw.rng.choice(CHOICES[n])
        elif a.has_default_value():
            continue
        else:
            raise Skip(f"argument {n}: {t}")
        drawn[n] = v
        if a.kwarg_only:
            kwargs[n] = v
        else:
            args.append(v)
    if name.startswith("masked_scatter") and device == "cuda" and "source" in drawn:
        # a source shorter than the mask's count is ATen's device-side assert on the GPU, which ends the
        # process's CUDA context (tests/ops/test_masked_scatter.py checks that case in a child process)
        i = next(i for i, v in enumerate(args) if v is drawn["source"])
        args[i] = draw.tensor((max(1, math.prod(base)) + 2,), drawn["source"].dtype)
    if name.startswith("gelu_backward") and device == "cpu" and "self" in drawn and "grad_output" in drawn:
        # an empty result broadcast from operands of different shapes: ATen's CPU kernel (oneDNN) raises,
        # or divides by zero (SIGFPE, the process ends) when one of them is expanded
        go, x = drawn["grad_output"], drawn["self"]
        if isinstance(go, torch.Tensor) and isinstance(x, torch.Tensor) and go.shape != x.shape and \
                0 in go.shape + x.shape:
            i = next(i for i, v in enumerate(args) if v is x)
            args[i] = draw.tensor(tuple(go.shape), x.dtype)
    # weight/bias of a normalization: the normalized shape
    norm = next((v for v in args if isinstance(v, list) and v and all(isinstance(x, int) for x in v)), None)
    args = [draw.tensor(tuple(norm) if norm is not None else base[-1:], v[1])
            if isinstance(v, tuple) and len(v) == 2 and v[0] == "norm" else v for v in args]
    return Case(name, seed, index, args, kwargs, special=draw.special)


# ---- ops whose arguments depend on each other: built whole (BUILDERS), positional in schema order ----
def _ints(draw, shape, hi):
    """int64 values in [0, hi) (and in range however drawn: an index out of range is a device-side assert
    on the GPU, which ends the process's CUDA context)."""
    if hi <= 0:
        return torch.zeros(shape, dtype=torch.int64).to(draw.device)
    return torch.randint(0, hi, shape, generator=draw.gen).to(draw.device)


def _layer_norm_backward(draw, dtype):
    """grad, input, normalized_shape, mean and rstd of ATen's forward on that input, weight, bias, mask."""
    shape = draw.shape(draw.rng.randint(1, 3))
    ns = list(shape[len(shape) - draw.rng.randint(1, len(shape)):])
    x = draw.tensor(shape, dtype)
    w = draw.tensor(ns, dtype) if draw.rng.random() < 0.7 else None
    b = draw.tensor(ns, dtype) if draw.rng.random() < 0.7 else None
    if dtype.is_floating_point:
        _, mean, rstd = torch.ops.aten.native_layer_norm(x, ns, w, b, draw.rng.choice([1e-5, 0.1]))
    else:   # no forward for this dtype: statistics of another dtype, for ATen to reject the call
        mean = rstd = torch.ones(shape[:len(shape) - len(ns)] + (1,) * len(ns), device=draw.device)
    mask = [draw.rng.random() < 0.8 for _ in range(3)]
    return [draw.tensor(shape, dtype), x, ns, mean, rstd, w, b, mask]


def _nll_inputs(draw, dtype):
    """(log-probabilities [N, C] or [C], target, weight or None, reduction, ignore_index)."""
    n, c = draw.rng.choice([0, 1, 3, 7, 33]), draw.rng.choice([1, 2, 5, 17])
    one = draw.rng.random() < 0.15
    x = draw.tensor((c,) if one else (n, c), dtype)
    ignore = draw.rng.choice([-100, 0, 1])
    t = _ints(draw, () if one else (n,), c)
    if t.numel() and draw.rng.random() < 0.4:
        t.view(-1)[draw.rng.randrange(t.numel())] = ignore
    w = draw.tensor((c,), dtype) if draw.rng.random() < 0.5 else None
    return x, t, w, draw.rng.choice([0, 1, 2]), ignore


def _nll_loss_forward(draw, dtype):
    x, t, w, red, ignore = _nll_inputs(draw, dtype)
    return [x, t, w, red, ignore]


def _nll_loss_backward(draw, dtype):
    x, t, w, red, ignore = _nll_inputs(draw, dtype)
    if dtype.is_floating_point:
        out, total = torch.ops.aten.nll_loss_forward(x, t, w, red, ignore)
        shape = tuple(out.shape)
    else:   # no forward for this dtype: ATen rejects the call
        shape, total = (), torch.ones((), device=draw.device)
    return [draw.tensor(shape, dtype), x, t, w, red, ignore, total]


def _embedding_dense_backward(draw, dtype):
    """grad [*indices.shape, D], indices in range, num_weights, padding_idx, scale_grad_by_freq."""
    nw, dim = draw.rng.choice([1, 3, 17, 100]), draw.rng.choice([1, 4, 33, 64])
    idx = _ints(draw, draw.shape(draw.rng.randint(1, 2)), nw)
    if draw.rng.random() < 0.2:
        idx = idx.int()
    pad = draw.rng.choice([-1, 0, nw - 1])
    return [draw.tensor(tuple(idx.shape) + (dim,), dtype), idx, nw, pad, draw.rng.random() < 0.3]


BUILDERS = {"native_layer_norm_backward": _layer_norm_backward, "nll_loss_forward": _nll_loss_forward,
            "nll_loss_backward": _nll_loss_backward, "embedding_dense_backward": _embedding_dense_backward}


def _out_dtype(name, args, dtype):
    """The dtype of an out= argument of a built case: nll_loss's total_weight and the others are the
    input's floating dtype."""
    return dtype if dtype.is_floating_point else torch.float32


def _fixed_shapes(base, draw):
    """Operand shapes of the ops whose shapes must agree (matrix products); a wrong one now and then."""
    if base not in ("mm", "bmm", "addmm", "addmm_", "embedding"):
        return {}
    r = lambda: draw.rng.choice([0, 1, 2, 3, 5, 16, 33])   # noqa: E731
    m, k, n, b = r(), r(), r(), r()
    k2 = k + 1 if draw.rng.random() < 0.05 else k
    if base == "mm":
        return {"self": (m, k), "mat2": (k2, n)}
    if base == "bmm":
        return {"self": (b, m, k), "mat2": (b, k2, n)}
    if base == "embedding":
        return {"self": (), "weight": (max(m, 1), k)}
    return {"self": draw.broadcast_to((m, n)), "mat1": (m, k), "mat2": (k2, n)}


def _index_tensor(draw, base, drawn, shape):
    """int64 indices valid for the op (one out of range now and then: ATen's error)."""
    def ints(s, hi):
        if hi <= 0 and draw.device == "cuda":
            s = (0,) + tuple(s[1:])   # no valid index into an empty dim: a nonempty one would assert on the GPU
        t = torch.randint(0, max(hi, 1), s, generator=draw.gen) if hi > 0 else torch.zeros(s, dtype=torch.int64)
        # not on the GPU: ATen's CUDA index kernels stop the process's CUDA context with a device-side assert
        if t.numel() and draw.rng.random() < 0.03 and draw.device != "cuda":
            t.view(-1)[0] = hi + 1
        return t.to(draw.device)
    if base == "embedding":
        return ints(draw.shape(draw.rng.randint(0, 3)), drawn["weight"].shape[0])
    nd = len(shape)
    d = drawn.get("dim", 0) % max(nd, 1) if -max(nd, 1) <= drawn.get("dim", 0) < max(nd, 1) else 0
    size = shape[d] if nd else 1
    if base == "index_select":
        return ints((draw.rng.choice([0, 1, 3, 7]),), size)
    # gather: as many dims, each no longer than self's except along dim
    s = tuple(draw.rng.randint(0, n) if i != d else draw.rng.choice([0, 1, 3]) for i, n in enumerate(shape))
    return ints(s, size)


def clone_args(v):
    """A copy of a call's arguments whose tensors keep their shapes, strides and storage offsets (each
    run of a case, ATen's and Gems', writes its own copy)."""
    if isinstance(v, torch.Tensor):
        n = v.untyped_storage().nbytes() // v.element_size()
        flat = torch.as_strided(v, (n,), (1,), 0)
        return flat.clone().as_strided(v.shape, v.stride(), v.storage_offset())
    if isinstance(v, list):
        return [clone_args(x) for x in v]
    if isinstance(v, tuple):
        return tuple(clone_args(x) for x in v)
    if isinstance(v, dict):
        return {k: clone_args(x) for k, x in v.items()}
    return v
