"""The master-weight cast kernels' unmasked paths compile to 16-byte loads and stores (sm_90 PTX).

Why: alignment hints fail silently. `tl.multiple_of` on a jit function's scalar parameter is
dropped (it annotates the op that defines a value, and a parameter has none), and that left
every MXFP8 master-cast store one byte wide until the twelfth session. The bytes stay right, so
no bit-exactness test notices; only the PTX shows it. A hint on a masked access is wrong the
other way: the accesses stay scalar and stop coalescing (the flat FP8 casts ran at half speed).
These tests compile the kernels with Triton for an sm_90 target, which needs Triton but no GPU
(`triton.compile` of an `ASTSource`), and count the global memory instructions:
- the MXFP8 maxima kernel (which casts the tiles inside the range) and the block FP8 maxima
  kernel store their codes as 16-byte vectors, and load the masters as vectors;
- the flat per-tensor casts, whose accesses are all masked, keep the one-element-per-thread
  layout (TTGIR `sizePerThread = [1]`, no vector instruction) that coalesces across a warp.
"""

from __future__ import annotations

import re
from collections import Counter

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from minifloat.kernels import master_cast, master_cast_mx, nvfp4  # noqa: E402
from minifloat.kernels import master_cast_plan as plan  # noqa: E402

SM90 = GPUTarget("cuda", 90, 32)
MANTISSA_BITS, MIN_EXPONENT, MAX_CODE = plan.E4M3_CONSTANTS
COMMON = {"BF16_BITS": False, "STEPS": 4, "FIELDS": plan.FIELDS, "ALIGNED": True}
E4M3_CODES = {"MANTISSA_BITS": MANTISSA_BITS, "MIN_EXPONENT": MIN_EXPONENT,
              "MAX_CODE": MAX_CODE, "E5M2": False, "HW_CAST": True}


def compile_for_sm90(kernel, runtime_types: str, constexprs: dict,
                     divisible: tuple[str, ...] = ()):
    """`kernel` compiled for sm_90, pointer arguments 16-byte aligned (as Triton specialises
    them for the plan's tensors), and the integer arguments named in `divisible` marked as
    multiples of 16, as a launch specialises such values (M and K of an NVFP4 or FP8 operand):
    without that, tile masks cannot be proven constant, loads stay scalar, and instruction
    counts mislead (KERNEL_NOTES.md, eighteenth session: 101 SASS an element against 30.5)."""
    names = list(kernel.arg_names)
    constexprs = {**{k: v for k, v in COMMON.items() if k in names}, **constexprs}
    runtime = [name for name in names if name not in constexprs]
    signature = dict(zip(runtime, runtime_types.split(), strict=True))
    signature.update({name: "constexpr" for name in constexprs})
    aligned = {(index,): [["tt.divisibility", 16]] for index, name in enumerate(names)
               if signature[name].startswith("*") or name in divisible}
    return triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs,
                                    attrs=aligned), target=SM90, options={"num_warps": 4})


def global_accesses(kernel, runtime_types: str, constexprs: dict,
                    divisible: tuple[str, ...] = ()) -> Counter:
    """ld.global / st.global instructions of the kernel's sm_90 PTX."""
    compiled = compile_for_sm90(kernel, runtime_types, constexprs, divisible)
    return Counter(re.findall(r"\b((?:ld|st)\.global[\w.]*)", compiled.asm["ptx"]))


def vectors(accesses: Counter, kind: str) -> int:
    return sum(count for op, count in accesses.items() if op.startswith(kind) and ".v" in op)


def test_mxfp8_interior_tiles_store_and_load_vectors():
    accesses = global_accesses(
        master_cast_mx._mxfp8_maxima_kernel, "*fp32 *u8 *u8 *i64 *i64 i32",
        {"COLUMNS": plan.TILE_COLUMNS["mxfp8"],
         "RECIPROCAL_BITS": plan._reciprocal_bits(448.0), **E4M3_CODES})
    # two copies of a 32 x 256 tile as 16-byte vectors: the interior tiles' int32 words, and
    # the byte codes of the rare tiles with a NaN element
    assert accesses["st.global.v4.b32"] >= 16, accesses
    assert vectors(accesses, "ld") >= 16, accesses
    assert accesses["st.global.b8"] <= 8, accesses  # the exponents only, not the codes


def test_block_fp8_interior_tiles_store_and_load_vectors():
    accesses = global_accesses(
        master_cast._block_maxima_kernel, "*fp32 *i32 *u8 *i64 *i64 i32 fp32",
        {"CHUNK": plan.BLOCK_CHUNK, "POW2": True, "OVERFLOW_BITS": 0x7F7FFFFF,
         "HW_CAST": True})
    assert accesses["st.global.v4.b32"] >= 2, accesses
    assert vectors(accesses, "ld") >= 8, accesses
    assert accesses["st.global.b8"] == 0, accesses


@pytest.mark.parametrize("name", ["_per_tensor_cast_kernel", "_delayed_cast_kernel"])
def test_masked_flat_casts_keep_the_coalesced_layout(name):
    types = {"_per_tensor_cast_kernel": "*fp32 *u8 *fp32 *fp32 *i64 *i64 i32 fp32",
             "_delayed_cast_kernel": "*fp32 *u8 *fp32 *i32 *i64 *i64 i32"}[name]
    extra = {"POW2": True} if name == "_per_tensor_cast_kernel" else {}
    compiled = compile_for_sm90(getattr(master_cast, name), types,
                                {"BLOCK": plan.FLAT_BLOCK, "E5M2": False, "HW_CAST": True,
                                 **extra})
    layouts = set(re.findall(r"sizePerThread = \[[^\]]*\]", compiled.asm["ttgir"]))
    assert layouts == {"sizePerThread = [1]"}, layouts


def test_mxfp8_scale_runs_copy_vectors():
    """Whole runs of the exponent vector copy into the scale tensors 16 bytes an access."""
    accesses = global_accesses(
        master_cast_mx._mxfp8_scales_kernel, "*u8 *u8 *i64 *i64 i32",
        {"BLOCK": plan.MXFP8_SCALE_BLOCK, "SCALES_ALIGNED": True})
    assert accesses["st.global.v4.b32"] >= 1 and accesses["ld.global.v4.b32"] >= 1, accesses


def test_nvfp4_scale_rows_store_vectors():
    """A block of 16 held rows stores its scale codes 16 bytes an access."""
    accesses = global_accesses(
        master_cast_mx._nvfp4_scales_kernel, "*u8 *fp32 *fp32 *i64 *i64 i32",
        {"BLOCK": plan.NVFP4_SCALE_COLUMNS, "TILE_ROWS": plan.NVFP4_SCALE_TILE_ROWS,
         "SCALES_ALIGNED": True})
    assert vectors(accesses, "st") >= 1, accesses


def test_nvfp4_1x16_rowwise_tile_loads_vectors_when_launch_specialised():
    """The NVFP4 1x16 quantize reads its bf16 tile 16 bytes an access once M and K are known
    multiples of 16 (as every launch specialises them); compiled without that fact, the same
    kernel loads two bytes an access, which is why SASS counts need `divisible`."""
    types = "*i16 *u8 *u8 *fp32 *u8 *u8 *fp32 *i64 i32 i32"
    flags = {"BF16_BITS": True, "ROWWISE": True, "COLUMNWISE": False, "RHT": False,
             "STOCHASTIC": False, "BLOCK_M": nvfp4.BLOCK_M, "BLOCK_K": nvfp4.BLOCK_K, "HW": True}
    specialised = global_accesses(nvfp4._nvfp4_1d_kernel, types, flags, divisible=("M", "K"))
    assert specialised["ld.global.v4.b32"] >= 1 and specialised["ld.global.b16"] == 0, specialised
    unspecialised = global_accesses(nvfp4._nvfp4_1d_kernel, types, flags)
    assert unspecialised["ld.global.b16"] > 0, unspecialised
