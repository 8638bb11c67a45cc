"""Every hand-written kernel compiles for an H100 (sm_90), checked without a GPU.

The CPU suite runs kernels under the Triton interpreter, which accepts code that Triton's compiler
rejects (a constexpr re-bound in a loop made sort fail on the GPU only). Here Triton's real compiler
(front end, LLVM, ptxas: all in the triton wheel) compiles one recorded signature per kernel from
tests/data/kernel_signatures.jsonl, in a process without the interpreter. A new `@kernel` needs a
record, and a kernel whose parameters change needs a new one; scripts/compile_check.py says how.
"""
import importlib
import json
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import gems.decode
import gems.fused
import gems.ops
from gems.runtime.launch import LaunchCache
from harness import ON_GPU

ROOT = Path(__file__).resolve().parents[2]
RECORDS = ROOT / "tests" / "data" / "kernel_signatures.jsonl"
HOW = ("record them: GEMS_COMPILE_RECORD=/tmp/k.jsonl python -m pytest -n 2 tests/core tests/ops tests/fused; "
       "python scripts/compile_check.py /tmp/k.jsonl --per-kernel 1 --write tests/data/kernel_signatures.jsonl")


def _launch_caches():
    found = {}
    for pkg in (gems.ops, gems.fused, gems.decode):
        for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
            mod = importlib.import_module(info.name)
            for name, obj in vars(mod).items():
                # the module that defines the kernel (not one importing it): the Python function's, under
                # the LaunchCache and the JIT/interpreted function (whose own __module__ is Triton's)
                if isinstance(obj, LaunchCache) and _defining_module(obj) == mod.__name__:
                    found[(mod.__name__, name)] = obj
    assert found, "no kernels found: the search is broken"
    return found


def _defining_module(obj):
    import inspect
    fn = obj
    while not inspect.isfunction(fn) and hasattr(fn, "fn"):
        fn = fn.fn
    return getattr(fn, "__module__", None)


def _records():
    return [json.loads(line) for line in RECORDS.read_text().splitlines() if line.strip()]


def test_every_kernel_has_a_record():
    have = {(r["module"], r["name"]) for r in _records()}
    missing = sorted(f"{m}.{n}" for m, n in _launch_caches() if (m, n) not in have)
    assert not missing, f"kernels without a compile record: {missing}; {HOW}"


def test_records_match_the_kernels():
    import inspect
    for r in _records():
        fn = getattr(importlib.import_module(r["module"]), r["name"])
        while not inspect.isfunction(fn):       # LaunchCache -> JIT/interpreted function -> function
            fn = fn.fn
        params = inspect.signature(fn).parameters
        required = [n for n, p in params.items() if p.default is inspect.Parameter.empty]
        what = f"{r['module']}.{r['name']}"
        assert set(r["signature"]) <= set(params), f"{what}: the record names parameters the kernel lost; {HOW}"
        assert set(required) <= set(r["signature"]), f"{what}: the kernel has new parameters; {HOW}"


@pytest.mark.skipif(ON_GPU, reason="on the GPU the suite compiles every kernel anyway")
def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "compile_check.py"), str(RECORDS), "-j", "2"],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"kernels that do not compile for sm_90:\n{proc.stdout[-6000:]}{proc.stderr[-3000:]}"


def _attention_gpu_records():
    """Records of the attention kernels at every launch config of sdpa.launch_config's GPU table, with the
    largest float bias the kind may read (its tiles are pipelined through shared memory too: the most a
    config can need; kind "fwd" reads at most one bias row per key block) and 16-bit
    operands, from the recorded interpreter signatures; each distinct (kernel, config) once."""
    from gems.ops.attention import sdpa as A
    base = {r["name"]: r for r in _records() if r["module"] == "gems.ops.attention.kernels"}
    kernel_of = {"fwd": "attn_fwd", "fwd_bias": "attn_fwd", "fwd_dropout": "attn_fwd",
                 "fwd_causal": "attn_fwd",
                 "decode": "attn_fwd", "dkdv": "attn_bwd_dkdv", "dq": "attn_bwd_dq"}
    out, seen = [], set()
    for block_d in (64, 128, 256):
        for ieee in (False,):    # (fp32's configs are small and run in the GPU suite's fp32 tests)
            for kind, name in kernel_of.items():
                bm, bn, w, st = A.launch_config(kind, block_d, ieee, False)
                key = (name, block_d, ieee, bm, bn, w, st, kind in ("decode", "fwd"))
                if key in seen:
                    continue
                seen.add(key)
                r = json.loads(json.dumps(base[name]))
                dt = "*fp32" if ieee else "*bf16"
                for p in ("Q", "K", "V", "O", "DO", "Bias"):
                    if p in r["signature"]:
                        r["signature"][p] = dt
                c = r["constexprs"]
                # kind fwd: at most a bias shared by the queries (one vector per key block); the others
                # may read [BLOCK_M, BLOCK_N] bias tiles
                c.update(BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=block_d, HAS_BIAS=True, BIAS_BOOL=False,
                         BIAS_ROW=kind == "fwd", IEEE=ieee,
                         CAUSAL=kind in ("fwd_causal", "dkdv", "dq"))
                if name == "attn_fwd":
                    c.update(SPLIT=kind == "decode", REVERSE=kind == "fwd_causal", STORE_LSE=kind != "decode")
                    if kind == "decode":      # the split partials are fp32
                        r["signature"]["O"] = "*fp32"
                # as a model's call specializes: unit strides along the head dim and the mask's keys are the
                # constant 1, the others and every pointer multiples of 16 (vectorized, pipelined loads)
                sig = r["signature"]
                for n in list(sig):
                    if n.startswith("stride_") and (n.endswith("d") or n == "stride_bn"):
                        sig[n] = "constexpr"
                        c[n] = 1
                r["divisible_16"] = [n for n, t in sig.items() if t.startswith("*") or
                                     (n.startswith("stride_") and t != "constexpr")]
                r["num_warps"], r["num_stages"] = w, st
                out.append(r)
                if kind == "decode" and block_d <= 128:
                    # decode on Hopper: K and V through TMA descriptors (attention._decode_tma)
                    t = json.loads(json.dumps(r))
                    box = f"tensordesc<bf16[1, 1, {bn}, {block_d}]>"
                    t["signature"].update(KD=box, VD=box)
                    t["constexprs"]["TMA"] = True
                    t["divisible_16"] = [n for n in t["divisible_16"] if n not in ("KD", "VD")]
                    out.append(t)
                # with dropout (Philox mask per tile; the forward's per-call seed/offset are 64-bit): a
                # forward with dropout takes kind fwd_dropout's, fwd_causal's or decode's tiles (attention._fwd_kind). Mode 2: the
                # forward also stores the mask's bits (a superset of mode 1's code), the backward reads
                # them instead of running Philox (mode 1): both backward modes are compiled
                modes = () if block_d > 128 or kind in ("fwd", "fwd_bias") else (2,) if name == "attn_fwd" else (1, 2)
                for mode in modes:
                    d = json.loads(json.dumps(r))
                    d["constexprs"]["DROPOUT"] = mode
                    d["signature"].update(thr="i64")
                    if name == "attn_fwd":
                        d["signature"].update(seed="i64", offset="i64", SeedOut="*i64")
                        d["divisible_16"] = [n for n in d["divisible_16"] if n not in ("seed", "offset")]
                    else:
                        d["signature"]["SeedOff"] = "*i64"
                    out.append(d)
    return out


@pytest.mark.skipif(ON_GPU, reason="on the GPU the attention tests launch these configs")
def test_attention_gpu_configs_fit_sm90(tmp_path):
    # the interpreter knows no shared-memory limit and the CPU suite runs the interpreter's configs: a GPU
    # table entry that needs more than sm_90's 227 KiB would fail only on the GPU
    recs = _attention_gpu_records()
    assert len(recs) >= 9
    _compile_all(tmp_path / "attention_gpu.jsonl", recs, "attention configs that do not fit sm_90")


def _compile_all(path, recs, what):
    """compile_check.py over `recs` (written to `path`) in a process without the interpreter."""
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "compile_check.py"), str(path), "-j", "2"],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{what}:\n{proc.stdout[-6000:]}{proc.stderr[-3000:]}"


def _gluon_desc_type(block, dtype):
    """Triton's type string of a Gluon host descriptor: dtype ("bf16" / "fp16" / "fp32"), block shape and the
    default shared-memory layout for them (what gemm_gluon.descriptor attaches)."""
    from triton.experimental.gluon import language as gl
    gdt = {"bf16": gl.bfloat16, "fp16": gl.float16, "fp32": gl.float32}[dtype]
    layout = gl.NVMMASharedLayout.get_default_for(list(block), gdt)
    return f"tensordesc<{dtype}[{', '.join(map(str, block))}],{layout!r}>"


def gluon_gemm_record(cfg, a_t, b_t, has_bias, dtype="bf16"):
    """A compile record of gemm_gluon.matmul_gluon_kernel for one launch config: host descriptors are typed
    by their dtype, block shape and shared-memory layout (Triton's tensordesc<...> string)."""
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]

    def desc(block):
        return _gluon_desc_type(block, dtype)

    from gems.ops.blas import gluon as gemm_gluon
    if cfg.get("FILL_K"):     # the K-split kernel: fp32 partials into a workspace, no bias or alpha
        sig = {"a_desc": desc([bk, bm] if a_t else [bm, bk]), "b_desc": desc([bn, bk] if b_t else [bk, bn]),
               "w_desc": _gluon_desc_type([bm, bn], "fp32"), "M": "i32", "N": "i32", "K": "i32", "splits": "i32",
               "k_per": "i32", "ws_rows": "i32"}
        consts = dict(A_T=a_t, B_T=b_t, GROUP_M=cfg["GROUP_M"], NUM_BUF=cfg["NUM_BUF"])
        sig.update({k: "constexpr" for k in consts})
        return {"module": "gems.ops.blas.gluon", "name": "matmul_gluon_splitk_kernel", "signature": sig,
                "constexprs": consts, "num_warps": cfg["num_warps"], "maxnreg": cfg["maxnreg"]}
    bn1, bn2 = gemm_gluon.split_n(bn)
    sig = {"a_desc": desc([bk, bm] if a_t else [bm, bk]), "b_desc": desc([bn1, bk] if b_t else [bk, bn1])}
    if bn2:      # the wide kernel: B's second part and C's second tile
        sig["b2_desc"] = desc([bn2, bk] if b_t else [bk, bn2])
    sig["c_desc"] = desc([bm, bn1])
    if bn2:
        sig["c2_desc"] = desc([bm, bn2])
    sig.update({"Bias": "*" + dtype, "M": "i32", "N": "i32", "K": "i32", "alpha": "fp32", "beta": "fp32",
                "s_xn": "i32"})
    consts = dict(A_T=a_t, B_T=b_t, HAS_BIAS=has_bias, GROUP_M=cfg["GROUP_M"], NUM_BUF=cfg["NUM_BUF"])
    sig.update({k: "constexpr" for k in consts})
    name = "matmul_gluon_wide_kernel" if bn2 else "matmul_gluon_kernel"
    return {"module": "gems.ops.blas.gluon", "name": name, "signature": sig, "constexprs": consts,
            "num_warps": cfg["num_warps"], "maxnreg": cfg["maxnreg"]}


@pytest.mark.skipif(ON_GPU, reason="on the GPU test_gemm_gluon launches these configs")
def test_gluon_gemm_configs_fit_sm90(tmp_path):
    # Gluon has no interpreter: the CPU suite never runs this kernel. Every config of the GEMM search space
    # compiles here for sm_90 in the layouts the models pass (a weight read transposed with a bias row, a
    # transposed activation, plain), and fits its ring and output tile in shared memory
    from gems.ops.blas import matmul as blas
    cfgs = [c for c in blas._CONFIGS_16 + [c for g in blas.CANDIDATE_GROUPS.values() for c in g] if c.get("GLUON")]
    assert cfgs
    # a K-split config runs the plain kernel where a call does not split: both kernels compile
    cfgs += [{k: v for k, v in c.items() if k != "FILL_K"} for c in cfgs if c.get("FILL_K")]
    recs = [gluon_gemm_record(c, a_t, b_t, bias) for c in cfgs
            for a_t, b_t, bias in ((False, True, True), (True, False, False), (False, False, False))]
    _compile_all(tmp_path / "gluon_gemm.jsonl", recs, "Gluon GEMM configs that do not fit sm_90")


@pytest.mark.skipif(ON_GPU, reason="on the GPU test_blas launches these configs")
def test_decode_gemm_configs_fit_sm90(tmp_path):
    # the decode (M <= 32) tiles are chosen without tuning (blas._skinny) and the interpreter runs its own
    # tile: each one the models' decode shapes pick (narrow, wide, K split) compiles for sm_90 and fits
    # its stages in shared memory, in 16-bit and fp32 (K halves the stride-1 tile: twice the bytes), 16 and
    # 32 rows tall
    from gems.ops.blas import matmul as blas
    base = next(r for r in _records() if (r["module"], r["name"]) == ("gems.ops.blas.kernels", "matmul_kernel"))

    def record(cfg, dtype, K, N):
        split, _ = blas.split_k(cfg.get("SPLIT_K", 1), K, cfg["BLOCK_K"], N)
        r = json.loads(json.dumps(base))
        for p in ("A", "B", "Bias"):
            r["signature"][p] = "*" + dtype
        r["signature"]["C"] = "*fp32" if split > 1 or dtype == "fp32" else "*" + dtype
        r["constexprs"].update(BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
                               GROUP_M=cfg["GROUP_M"], SPLIT_K=split, EVEN_K=True, HAS_BIAS=False)
        r["divisible_16"] = [n for n, t in r["signature"].items() if t.startswith("*")] + ["K", "k_per"]
        r["num_warps"], r["num_stages"] = cfg["num_warps"], cfg["num_stages"]
        return r
    recs = [record(blas._skinny(M, N, K, size, 132), dtype, K, N) for dtype, size in (("bf16", 2), ("fp32", 4))
            for M in (1, 32) for N, K in ((4096, 4096), (4096, 11008), (32000, 4096), (512, 4096))]
    _compile_all(tmp_path / "decode_gemm.jsonl", recs, "decode GEMM configs that do not fit sm_90")


def gluon_attention_record(head_dim, cfg, causal, store_lse, dtype="bf16"):
    """A compile record of attention_gluon.attn_fwd_gluon for (BLOCK_N, STAGES, OVERLAP, PERSISTENT) `cfg`
    (the last one only sizes the grid): 4-d host descriptors typed like gluon_gemm_record's."""
    from gems.ops.attention import gluon_fwd as G
    bn, stages, overlap = cfg[:3]

    def desc(block):
        return _gluon_desc_type(block, dtype)

    rows = [1, 1, G.ROWS.value, head_dim]
    keys = [1, 1, bn, head_dim]
    sig = {"q_desc": desc(rows), "k_desc": desc(keys), "v_desc": desc(keys), "o_desc": desc(rows),
           "LSE": "*fp32", "Hq": "i32", "GROUP": "i32", "Sq": "i32", "Sk": "i32", "qk_scale": "fp32",
           "s_lb": "i32", "s_lh": "i32", "s_lm": "i32", "n_tiles": "i32"}
    consts = dict(CAUSAL=causal, STORE_LSE=store_lse, OVERLAP=overlap, STAGES=stages)
    sig.update({k: "constexpr" for k in consts})
    return {"module": "gems.ops.attention.gluon_fwd", "name": "attn_fwd_gluon", "signature": sig, "constexprs": consts,
            "num_warps": 4, "num_stages": 1}


@pytest.mark.skipif(ON_GPU, reason="on the GPU test_attention_gluon launches these configs")
def test_gluon_attention_configs_fit_sm90(tmp_path):
    # Gluon has no interpreter: every head dim's configs (long and short keys) compile here for sm_90,
    # causal or not, in both 16-bit dtypes, and fit Q, the K/V ring and the barriers in shared memory
    from gems.ops.attention import gluon_fwd as G
    cfgs = [(d, cfg) for table in (G._CONFIGS, G._SHORT, G._ONE_ROUND_SHORT) for d, cfg in table.items()]
    recs = [gluon_attention_record(d, cfg, causal, causal, dt) for d, cfg in cfgs
            for causal in (False, True) for dt in ("bf16", "fp16")]
    _compile_all(tmp_path / "gluon_attention.jsonl", recs, "Gluon attention configs that do not fit sm_90")


def gluon_attention_bwd_record(causal, split, dtype="bf16"):
    """A compile record of attention_gluon_bwd.attn_bwd_gluon (head dim 128): Q/dO descriptors of 64 rows,
    K/V of BLOCK_N, lse2's and delta's of 64 fp32, the fp32 dQ accumulator's of [64, 64]; DK/DV fp32 sums
    when `split`."""
    from gems.ops.attention import gluon_bwd as GB
    rows = [1, 1, GB.ROWS.value, 128]
    keys = [1, 1, GB.BLOCK_N, 128]
    grad = "*fp32" if split else "*" + dtype
    sig = {"q_desc": _gluon_desc_type(rows, dtype), "k_desc": _gluon_desc_type(keys, dtype),
           "v_desc": _gluon_desc_type(keys, dtype), "do_desc": _gluon_desc_type(rows, dtype),
           "l_desc": _gluon_desc_type([1, 1, GB.ROWS.value], "fp32"),
           "d_desc": _gluon_desc_type([1, 1, GB.ROWS.value], "fp32"),
           "dq_desc": _gluon_desc_type([1, 1, GB.ROWS.value, GB.ROWS.value], "fp32"), "DK": grad, "DV": grad}
    sig.update({n: "i32" for n in ("Hkv", "GROUP", "NG", "Sq", "Sk")})
    sig.update({"qk_scale": "fp32", "scale": "fp32"})
    sig.update({n: "i32" for n in ("s_kb", "s_kh", "s_km", "s_vb", "s_vh", "s_vm")})
    consts = dict(CAUSAL=causal, SPLIT=split, STAGES=GB.STAGES)
    sig.update({k: "constexpr" for k in consts})
    return {"module": "gems.ops.attention.gluon_bwd", "name": "attn_bwd_gluon", "signature": sig,
            "constexprs": consts, "num_warps": 4, "num_stages": 1}


@pytest.mark.skipif(ON_GPU, reason="on the GPU test_attention_gluon launches this kernel")
def test_gluon_attention_backward_fits_sm90(tmp_path):
    # the Gluon backward compiles for sm_90 causal or not, with dK/dV stored or added into fp32 sums (GQA
    # split), in both 16-bit dtypes, and fits K, V, the Q/dO ring, P^T, dS^T and the dQ staging in shared
    # memory
    recs = [gluon_attention_bwd_record(causal, split, dt) for causal in (False, True) for split in (False, True)
            for dt in ("bf16", "fp16")]
    _compile_all(tmp_path / "gluon_attention_bwd.jsonl", recs, "Gluon attention backward that does not fit sm_90")
