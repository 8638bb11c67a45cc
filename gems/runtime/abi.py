"""The contract between the Python side and the C++ fast path (gems/csrc/), defined once.

The C++ fast path replays plans that Python recorded and keys calls the way Python's signatures do
(gems/csrc/signature.h beside runtime/plan/signature.py's make_signature). Both read the codes and limits
below: Python imports them from here, and runtime/fast.py generates the C++ header `gems_abi.h`
from this module (`header()`) into the build directory before it compiles the extension, so the
C++ sources hold no copy of any of these values. A change here rebuilds the extension (the header
is part of the build's cache key), and tests/core/test_abi.py checks that the loaded extension
reports the same values and keys calls as Python does.
"""
from __future__ import annotations

import math

# ----------------------------------------------------------------------------------------------
# numbers in a call's signature
# ----------------------------------------------------------------------------------------------
# A per-call number's range class: the index of the narrowest of these nested ranges holding it
# (c10's overflow rule compares a number with the target dtype's lowest/max; an unsigned target
# also takes negative ints down to -max, wrapping, hence [-255, 255]): int8, uint8, int16, float16,
# int32, int64 (for a float: v < 2**63), bfloat16, float32. A signature keys the class, so that an
# op's "does the number fit the dtype" check decides alike for every call with that signature.
NUMBER_RANGES = ((-128, 127), (-255, 255), (-32768, 32767), (-65504, 65504), (-0x80000000, 0x7FFFFFFF),
                 (-0x8000000000000000, 0x7FFFFFFFFFFFFFFF), (-3.3895313892515355e38, 3.3895313892515355e38),
                 (-3.4028234663852886e38, 3.4028234663852886e38))
# the class of a finite number beyond every range above
BEYOND_RANGE = len(NUMBER_RANGES)
# the class of +-inf
INF_RANGE = len(NUMBER_RANGES) + 1

# ----------------------------------------------------------------------------------------------
# recipes: a recorded plan as data for the C++ replay (runtime/plan/recipe.py builds them, the C++ side's
# parse_recipe reads them)
# ----------------------------------------------------------------------------------------------
# where a recipe's tensor comes from: a schema argument, an allocation of the plan, an undefined
# tensor (a result not asked for), an element of a tensor-list argument (its code is
# argument index << LIST_ELEMENT_BITS | element index), a constant int (a result only)
SRC_ARG, SRC_ALLOC, SRC_UNDEFINED, SRC_LIST_ELEMENT, SRC_CONST_INT = 0, 1, 2, 3, 4
# bits of a tensor-list element's index in its code (a list longer than this gets no recipe)
LIST_ELEMENT_BITS = 20
# an overlap guard's `other` at or above this names a tensor-list element: LIST_REF + its code
LIST_REF = 1 << 30

# how a launch runs: a CUDA binary through cuLaunchKernel, or Triton's interpreter called back in Python
LAUNCH_CUDA, LAUNCH_INTERPRETER = 0, 1

# what a launch's kernel parameter is: a tensor's address, a constant, a per-call number of the call
# (converted by CONVERSIONS), per-call Philox state (PHILOX_SEED/PHILOX_OFFSET), a TMA descriptor
PARAM_TENSOR, PARAM_CONST, PARAM_DYN, PARAM_PHILOX, PARAM_TMA = 0, 1, 2, 3, 4

# how a per-call number reaches a kernel argument: as given, float(), int(), or .item() of a CPU
# 0-dim tensor (the spellings are those kernels declare in plan.dynamic)
CONVERSIONS = {"": 0, "float": 1, "int": 2, ".item()": 3}

# Triton signature types -> the code of the C++ replay's parameter type (how it packs a number into
# the launch's argument bytes); PTR_TYPE is any pointer ("*fp32", ...)
PTYPES = {"i1": 0, "i8": 0, "u1": 0, "u8": 0, "i16": 1, "u16": 1, "i32": 2, "u32": 2, "i64": 3, "u64": 3,
          "fp32": 4, "f32": 4, "fp64": 5, "fp16": 6, "bf16": 7}
PTR_TYPE = 8

# an allocation's initial content: none, zeros (a workspace), poison (GEMS_POISON, a test aid)
FILL_NONE, FILL_ZEROS, FILL_POISON = 0, 1, 2

# kernel parameters one replayed launch may pass (the C++ replay's fixed parameter array); a plan
# with more keeps its Python replay. cat's 64 input slots and their geometry fit.
MAX_PARAMS = 128

# signatures each overload keeps plans for; an op seeing more keeps the newest (Python), or starts
# over (C++)
MAX_PLANS = 512

# ----------------------------------------------------------------------------------------------
# per-call random state
# ----------------------------------------------------------------------------------------------
# A Philox seed and offset reach kernels at or above these, so Triton types both int64 whatever the
# generator holds (a plan keeps the binary of its recorded call: an i32 slot would truncate an
# offset grown past 2^31 and repeat earlier random streams). Any seed is a seed; a constant added to
# every counter keeps the counters of distinct calls and elements distinct. The C++ replay draws
# the state itself with the same bases, so both paths give a kernel the same values.
PHILOX_SEED_BIT = 1 << 62
PHILOX_OFFSET_BASE = 1 << 32
# which of the two a PARAM_PHILOX parameter takes
PHILOX_SEED, PHILOX_OFFSET = 0, 1

# ----------------------------------------------------------------------------------------------
# the enabled state the C++ side mirrors (dispatch.py's enable() / use_gems())
# ----------------------------------------------------------------------------------------------
# distinct include/exclude selections ("configs") per process the C++ side can tell apart; calls
# under a config beyond it take the Python path
MAX_CONFIGS = 1024
# a thread's config id when it is in no use_gems() scope of its own
UNSCOPED = -2

# ----------------------------------------------------------------------------------------------
# _foreach_* calls served whole in C++ (ops/foreach.py)
# ----------------------------------------------------------------------------------------------
# the kind of an overload's number argument: none, a Scalar, a ScalarList, a 0-dim Tensor
FOREACH_NO_SCALAR, FOREACH_SCALAR, FOREACH_SCALARLIST, FOREACH_TENSOR = 0, 1, 2, 3
# foreach_kernel's runtime parameters, in its order: the C++ side fills a launch's parameters by
# these roles (a published launch names each parameter by its index here; C++ calls them R_<name>)
FOREACH_ROLES = ("Base", "Tab", "N", "TOP", "LOGN", "B0", "s", "alpha", "S", "S0")
# how many binary facts select a foreach binary (foreach_publish's tuple)
FOREACH_FACTS = 13
# device copies of launch tables kept, per process (a table is kept by content)
FOREACH_MAX_TABLES = 64


# ----------------------------------------------------------------------------------------------
# the C++ header
# ----------------------------------------------------------------------------------------------
def _double(v, down: bool) -> str:
    """A C++ double literal for bound `v`: the double nearest `v` on the inside of the range, so that
    `lo <= d && d <= hi` on doubles decides as Python's exact comparison of a float with an int."""
    f = float(v)
    if isinstance(v, int) and f != v:
        f = math.nextafter(f, -math.inf if down else math.inf)
    return repr(f) if math.isfinite(f) else ("-" if f < 0 else "") + "HUGE_VAL"


def _int(v: int) -> str:
    return "INT64_MIN" if v == -0x8000000000000000 else "INT64_MAX" if v == 0x7FFFFFFFFFFFFFFF else f"{v}LL"


def header() -> str:
    """The text of gems_abi.h: this module's values as C++ constants (runtime/fast.py writes it)."""
    int_ranges = [(lo, hi) for lo, hi in NUMBER_RANGES if isinstance(lo, int) and isinstance(hi, int)]
    assert NUMBER_RANGES[:len(int_ranges)] == tuple(int_ranges), "int ranges come first"
    lines = [
        "// Generated from gems/runtime/abi.py by gems/runtime/fast.py: edit abi.py, not this file.",
        "// The meaning of every value is documented there.",
        "#pragma once",
        "#include <cmath>",
        "#include <cstddef>",
        "#include <cstdint>",
        "",
        "namespace gems_abi {",
        f"constexpr int kNumberRanges = {len(NUMBER_RANGES)};",
        f"constexpr int kIntRanges = {len(int_ranges)};   // the leading ranges with int bounds",
        "constexpr int64_t kIntRangeLo[] = {" + ", ".join(_int(lo) for lo, _ in int_ranges) + "};",
        "constexpr int64_t kIntRangeHi[] = {" + ", ".join(_int(hi) for _, hi in int_ranges) + "};",
        "constexpr double kFloatRangeLo[] = {" + ", ".join(_double(lo, False) for lo, _ in NUMBER_RANGES) + "};",
        "constexpr double kFloatRangeHi[] = {" + ", ".join(_double(hi, True) for _, hi in NUMBER_RANGES) + "};",
        f"constexpr int64_t kBeyondRange = {BEYOND_RANGE};",
        f"constexpr int64_t kInfRange = {INF_RANGE};",
        "",
        f"enum Src : int {{ SRC_ARG = {SRC_ARG}, SRC_ALLOC = {SRC_ALLOC}, SRC_UNDEFINED = {SRC_UNDEFINED}, "
        f"SRC_LIST_ELEMENT = {SRC_LIST_ELEMENT}, SRC_CONST_INT = {SRC_CONST_INT} }};",
        f"constexpr int kListElementBits = {LIST_ELEMENT_BITS};",
        f"constexpr int kListRef = {LIST_REF};",
        f"enum LaunchKind : int {{ LAUNCH_CUDA = {LAUNCH_CUDA}, LAUNCH_INTERPRETER = {LAUNCH_INTERPRETER} }};",
        f"enum ParamKind : int {{ P_TENSOR = {PARAM_TENSOR}, P_CONST = {PARAM_CONST}, P_DYN = {PARAM_DYN}, "
        f"P_PHILOX = {PARAM_PHILOX}, P_TMA = {PARAM_TMA} }};",
        f"enum Conv : int {{ C_RAW = {CONVERSIONS['']}, C_FLOAT = {CONVERSIONS['float']}, "
        f"C_INT = {CONVERSIONS['int']}, C_ITEM = {CONVERSIONS['.item()']} }};",
        f"enum PType : int {{ T_I8 = {PTYPES['i8']}, T_I16 = {PTYPES['i16']}, T_I32 = {PTYPES['i32']}, "
        f"T_I64 = {PTYPES['i64']}, T_F32 = {PTYPES['fp32']}, T_F64 = {PTYPES['fp64']}, T_F16 = {PTYPES['fp16']}, "
        f"T_BF16 = {PTYPES['bf16']}, T_PTR = {PTR_TYPE} }};",
        f"enum Fill : int {{ FILL_NONE = {FILL_NONE}, FILL_ZEROS = {FILL_ZEROS}, FILL_POISON = {FILL_POISON} }};",
        f"constexpr size_t kMaxParams = {MAX_PARAMS};",
        f"constexpr size_t kMaxPlans = {MAX_PLANS};",
        "",
        f"constexpr uint64_t kPhiloxSeedBit = {PHILOX_SEED_BIT}ULL;",
        f"constexpr uint64_t kPhiloxOffsetBase = {PHILOX_OFFSET_BASE}ULL;",
        f"enum PhiloxPart : int {{ PHILOX_SEED = {PHILOX_SEED}, PHILOX_OFFSET = {PHILOX_OFFSET} }};",
        "",
        f"constexpr int kMaxConfigs = {MAX_CONFIGS};",
        f"constexpr int kUnscoped = {UNSCOPED};",
        "",
        f"enum ForeachScalar : int {{ FS_NONE = {FOREACH_NO_SCALAR}, FS_SCALAR = {FOREACH_SCALAR}, "
        f"FS_LIST = {FOREACH_SCALARLIST}, FS_TENSOR = {FOREACH_TENSOR} }};",
        "enum ForeachRole : int { " + ", ".join(f"R_{r} = {i}" for i, r in enumerate(FOREACH_ROLES))
        + f", R_COUNT = {len(FOREACH_ROLES)} }};",
        f"constexpr size_t kForeachFacts = {FOREACH_FACTS};",
        f"constexpr size_t kForeachMaxTables = {FOREACH_MAX_TABLES};",
        "}  // namespace gems_abi",
        "",
    ]
    return "\n".join(lines)
