"""Fused dequantize-GEMM (prototype, not wired into general_gemm): C = A @ B^T straight from
the rowwise copies of two MXFP8 or two NVFP4 tensors (the fprop case, K contiguous in both).

Why: the library's emulated path decodes both operands to bf16 in memory
(kernels/dequantize.py), then runs a cuBLAS bf16 GEMM (and, for NVFP4, an fp32 product plus a
one-pass alpha epilogue). This kernel reads the 1-byte (MXFP8) or half-byte (NVFP4) codes and
their block scales, decodes each tile to bf16 in registers and feeds tl.dot (wgmma on Hopper),
fp32 accumulation; the epilogue multiplies by alpha (NVFP4: S_dec(A) * S_dec(B), fp32) and rounds
to bf16 (nearest even). benchmarks/fused_dequant_gemm.py measures it against the current path.

Exactness: every decoded value is the bf16 number dequantize.py writes (same device functions
or an exact equivalent), so C equals torch.mm(decoded A, decoded B^T, out fp32) (* alpha, then
bf16) up to the fp32 summation order. tests/gpu/test_fused_gemm.py checks it.

Decodes (the DECODE constexpr), to compare their instruction cost:
- MXFP8 0 "lib": dequantize.py's _mx_fast (code bits placed in an fp32, one exact multiply);
  1 "cvt": the hardware FP8 -> bf16 conversion times the bf16 power of two 2^(e-127) (exact:
  in the fast range every product is a bf16 normal); 2 "dot_scaled": Triton's tl.dot_scaled
  (its own upcast on Hopper; the tests decide whether it is exact). All three serve programs
  whose E8M0 bytes all lie in dequantize.py's fast range (E4M3_DECODE / E5M2_DECODE); range
  checks ride along the K loop (elementwise, one reduction at the end, no per-step barrier),
  and a program that saw any other byte redoes its tile with _mx_general (exact for every byte).
- NVFP4 0 "lib": _e2m1_float(code) * fp32(s_b); 1 "bits": the code's bits placed in an fp32
  (E2M1 value * 2^-126, subnormal for codes 0/1), * 2^126, * fp32(s_b): two exact multiplies,
  fewer integer ops. Products have at most 6 significant bits: the bf16 cast is exact.

Measured (H100, Triton 3.6, benchmarks/fused_dequant_gemm.py): the fused kernel LOSES by far,
3.8-5.2x slower than decode + cuBLAS for MXFP8 (best: dot_scaled / cvt at 128x256x64, w8, s3,
~170 TFLOP/s against ~700) and 9.7-12x slower for NVFP4 (~58 TFLOP/s). Each operand tile is
decoded again for every output tile (MNK * (1/BM + 1/BN) decodes), the decode is ALU work in
the K loop, and the decoded tile goes registers -> one shared buffer -> wgmma -> wait, so decode
and MMA do not overlap; Triton does not pipeline loads that feed a dot through a decode (the
loop prefetches one step ahead in registers by hand). The decode + cuBLAS path stays.

Tiles are [BLOCK_M, BLOCK_K // 32, 32] (MXFP8) or [rows, BLOCK_K // 16, 8 bytes] (NVFP4) so a
block's scale broadcasts over its last axis, then reshaped to [rows, BLOCK_K]. Shapes: any M, N
(rows past the end are clamped for loads, masked for stores); K a multiple of 32 (MXFP8) or 16
(NVFP4), a K tail shorter than BLOCK_K is masked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import interpreter_enabled
from .dequantize import E4M3_DECODE, E5M2_DECODE, _e2m1_float, _mx_fast, _mx_general
from .element_cast import round_to_bf16
from .launch import launch

MX_DECODES = {"lib": 0, "cvt": 1, "dot_scaled": 2}
NV_DECODES = {"lib": 0, "bits": 1}
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages); defaults until the benchmark says better
DEFAULT_CONFIG = (128, 256, 64, 8, 3)
GROUP_M = 8
FP32_NAN = tl.constexpr(0x7FC00000)
TWO_POW_126 = tl.constexpr(2.0**126)


@triton.jit
def _tile_ids(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr):
    """Grouped program order: GROUP row-tiles share their B column-tiles while in L2."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP * tiles_n
    first_m = (pid // per_group) * GROUP
    group_size = tl.minimum(tiles_m - first_m, GROUP)
    pid_m = first_m + (pid % per_group) % group_size
    pid_n = (pid % per_group) // group_size
    return pid_m, pid_n


@triton.jit
def _store(c_ptr, acc, pid_m, pid_n, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
           OUT_FP32: tl.constexpr):
    """bf16 by round-to-nearest-even on the bits (every backend agrees), or the raw fp32."""
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    mask = (rows < M) & (cols < N)
    ptrs = c_ptr + rows.to(tl.int64) * N + cols
    if OUT_FP32:
        tl.store(ptrs, acc, mask=mask)
    else:
        tl.store(ptrs, round_to_bf16(acc).to(tl.bfloat16), mask=mask)


@triton.jit
def _bf16_from_bits(bits, INTERPRET: tl.constexpr):
    """bf16 of int32 bf16 bits: a bitcast on the GPU; the interpreter converts int16 -> bf16
    bitcasts by value, so there the bits go through an fp32 (exact: low half zero)."""
    if INTERPRET:
        return (bits << 16).to(tl.float32, bitcast=True).to(tl.bfloat16)
    else:
        return bits.to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _dot(a, b, acc, INTERPRET: tl.constexpr):
    """acc + a @ b^T of bf16 tiles (wgmma on Hopper). The interpreter's bf16 dot multiplies
    the bit patterns as integers, so there the (exact) fp32 values are multiplied instead."""
    if INTERPRET:
        return tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), acc, input_precision="ieee")
    else:
        return tl.dot(a, tl.trans(b), acc)


@triton.jit
def _mx_operand(codes, scales, FAST: tl.constexpr, MANTISSA_BITS: tl.constexpr,
                BIAS: tl.constexpr, E5M2: tl.constexpr, DECODE: tl.constexpr,
                ROWS: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr):
    """[ROWS, BLOCK_K] bf16 of int8 codes [ROWS, NB, 32] and int32 E8M0 bytes [ROWS, NB, 1]."""
    if FAST:
        if DECODE == 1:
            if E5M2:
                value = codes.to(tl.float8e5, bitcast=True).to(tl.bfloat16)
            else:
                value = codes.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)
            factor = _bf16_from_bits(scales << 7, INTERPRET)  # 2^(e-127), exact
            if INTERPRET:  # its bf16 arithmetic is wrong and its E4M3 0x7F is 480, not NaN
                out = (value.to(tl.float32) * factor.to(tl.float32)).to(tl.bfloat16)
                if not E5M2:
                    nan = _bf16_from_bits(tl.full(codes.shape, 0x7FC0, tl.int32), INTERPRET)
                    out = tl.where((codes & 0x7F) == 0x7F, nan, out)
            else:
                out = value * factor
        else:
            bits = _mx_fast(codes.to(tl.int32), scales, MANTISSA_BITS, BIAS, E5M2)
            out = _bf16_from_bits(bits, INTERPRET)
    else:
        bits = _mx_general(codes.to(tl.int32), scales, MANTISSA_BITS, BIAS, E5M2)
        out = _bf16_from_bits(bits, INTERPRET)
    return tl.reshape(out, (ROWS, BLOCK_K))


@triton.jit
def _mx_load(k0, a_codes, b_codes, a_scales, b_scales, K, BLOCK_K: tl.constexpr):
    """Codes and scale bytes of the BLOCK_K step at k0 (zeros / 127 past K)."""
    blk = tl.arange(0, BLOCK_K // 32)[None, :, None]
    kmask = (k0 + blk * 32 + tl.arange(0, 32)[None, None, :]) < K
    smask = (k0 + blk * 32) < K
    ca = tl.load(a_codes + k0, mask=kmask, other=0)
    cb = tl.load(b_codes + k0, mask=kmask, other=0)
    sa = tl.load(a_scales + k0 // 32, mask=smask, other=127).to(tl.int32)
    sb = tl.load(b_scales + k0 // 32, mask=smask, other=127).to(tl.int32)
    return ca, cb, sa, sb


@triton.jit
def _mx_step(ca, cb, sa, sb, acc, ok_a, ok_b,
             FAST: tl.constexpr, MANTISSA_BITS: tl.constexpr, BIAS: tl.constexpr,
             FAST_MIN: tl.constexpr, FAST_MAX: tl.constexpr, E5M2: tl.constexpr,
             DECODE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr):
    """One BLOCK_K step on loaded tiles: range-check the scales, decode, dot."""
    NB: tl.constexpr = BLOCK_K // 32
    if FAST:
        ok_a = tl.minimum(ok_a, ((sa >= FAST_MIN) & (sa <= FAST_MAX)).to(tl.int32))
        ok_b = tl.minimum(ok_b, ((sb >= FAST_MIN) & (sb <= FAST_MAX)).to(tl.int32))
    if FAST and DECODE == 2:
        fa = tl.reshape(ca.to(tl.uint8, bitcast=True), (BLOCK_M, BLOCK_K))
        fb = tl.trans(tl.reshape(cb.to(tl.uint8, bitcast=True), (BLOCK_N, BLOCK_K)))
        ea = tl.reshape(sa.to(tl.uint8), (BLOCK_M, NB))
        eb = tl.reshape(sb.to(tl.uint8), (BLOCK_N, NB))
        if E5M2:
            acc = tl.dot_scaled(fa, ea, "e5m2", fb, eb, "e5m2", acc)
        else:
            acc = tl.dot_scaled(fa, ea, "e4m3", fb, eb, "e4m3", acc)
    else:
        a = _mx_operand(ca, sa, FAST, MANTISSA_BITS, BIAS, E5M2, DECODE, BLOCK_M, BLOCK_K,
                        INTERPRET)
        b = _mx_operand(cb, sb, FAST, MANTISSA_BITS, BIAS, E5M2, DECODE, BLOCK_N, BLOCK_K,
                        INTERPRET)
        acc = _dot(a, b, acc, INTERPRET)
    return acc, ok_a, ok_b


@triton.jit
def _mx_loop(a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, rows_a, rows_b, K,
             FAST: tl.constexpr, MANTISSA_BITS: tl.constexpr, BIAS: tl.constexpr,
             FAST_MIN: tl.constexpr, FAST_MAX: tl.constexpr, E5M2: tl.constexpr,
             DECODE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, INTERPRET: tl.constexpr):
    """The K loop; returns (fp32 accumulator, 1 if every scale byte read was in the fast
    range else 0; always 1 when not FAST). A `for` (software-pipelined by Triton) on the GPU; a
    `while` under the interpreter, which cannot take a runtime bound in range()."""
    NB: tl.constexpr = BLOCK_K // 32
    SK = K // 32
    blk = tl.arange(0, NB)[None, :, None]
    lane = tl.arange(0, 32)[None, None, :]
    ra = rows_a.to(tl.int64)[:, None, None]
    rb = rows_b.to(tl.int64)[:, None, None]
    a_codes = a_ptr + ra * K + blk * 32 + lane
    b_codes = b_ptr + rb * K + blk * 32 + lane
    a_scales = a_scale_ptr + ra * SK + blk
    b_scales = b_scale_ptr + rb * SK + blk
    ok_a = tl.full((BLOCK_M, NB, 1), 1, tl.int32)
    ok_b = tl.full((BLOCK_N, NB, 1), 1, tl.int32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # software pipelining by hand: the loads of step k + 1 are issued before step k's decode
    # and dot (Triton does not pipeline loads that feed a dot through a decode)
    ca, cb, sa, sb = _mx_load(0, a_codes, b_codes, a_scales, b_scales, K, BLOCK_K)
    if INTERPRET:
        k0 = 0
        while k0 < K:
            na, nb, nsa, nsb = _mx_load(k0 + BLOCK_K, a_codes, b_codes, a_scales, b_scales, K,
                                        BLOCK_K)
            acc, ok_a, ok_b = _mx_step(ca, cb, sa, sb, acc, ok_a, ok_b, FAST, MANTISSA_BITS,
                                       BIAS, FAST_MIN, FAST_MAX, E5M2, DECODE, BLOCK_M,
                                       BLOCK_N, BLOCK_K, INTERPRET)
            ca, cb, sa, sb = na, nb, nsa, nsb
            k0 += BLOCK_K
    else:
        for k0 in range(0, K, BLOCK_K):
            na, nb, nsa, nsb = _mx_load(k0 + BLOCK_K, a_codes, b_codes, a_scales, b_scales, K,
                                        BLOCK_K)
            acc, ok_a, ok_b = _mx_step(ca, cb, sa, sb, acc, ok_a, ok_b, FAST, MANTISSA_BITS,
                                       BIAS, FAST_MIN, FAST_MAX, E5M2, DECODE, BLOCK_M,
                                       BLOCK_N, BLOCK_K, INTERPRET)
            ca, cb, sa, sb = na, nb, nsa, nsb
    return acc, tl.min(ok_a) * tl.min(ok_b)


@triton.jit
def _fused_mxfp8_kernel(a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, c_ptr, M, N, K,
                        MANTISSA_BITS: tl.constexpr, BIAS: tl.constexpr,
                        FAST_MIN: tl.constexpr, FAST_MAX: tl.constexpr, E5M2: tl.constexpr,
                        DECODE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, GROUP: tl.constexpr, EVEN_K: tl.constexpr,
                        OUT_FP32: tl.constexpr, INTERPRET: tl.constexpr):
    """C[M, N] = bf16(decode(A) @ decode(B)^T); A codes [M, K] int8, scales [M, K/32] uint8."""
    pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP)
    rows_a = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    rows_b = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    acc, ok = _mx_loop(a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, rows_a, rows_b, K, True,
                       MANTISSA_BITS, BIAS, FAST_MIN, FAST_MAX, E5M2, DECODE, BLOCK_M, BLOCK_N,
                       BLOCK_K, EVEN_K, INTERPRET)
    if ok == 0:  # a scale byte outside the fast range: the whole tile again, exact for any byte
        acc, ok = _mx_loop(a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, rows_a, rows_b, K, False,
                           MANTISSA_BITS, BIAS, FAST_MIN, FAST_MAX, E5M2, 0, BLOCK_M, BLOCK_N,
                           BLOCK_K, EVEN_K, INTERPRET)
    _store(c_ptr, acc, pid_m, pid_n, M, N, BLOCK_M, BLOCK_N, OUT_FP32)


@triton.jit
def _ue4m3_float(s):
    """fp32 of UE4M3 bytes (int32): normals from bits, subnormals m * 2^-9, 0x7F NaN, sign bit
    kept (as dequantize.py's NVFP4 kernel decodes them)."""
    magnitude = s & 0x7F
    normal = ((magnitude << 20) + (120 << 23)).to(tl.float32, bitcast=True)
    subnormal = (magnitude & 7).to(tl.float32) * 0.001953125
    value = tl.where((magnitude >> 3) == 0, subnormal, normal)
    nan = tl.full(value.shape, FP32_NAN, tl.int32).to(tl.float32, bitcast=True)
    value = tl.where(magnitude == 0x7F, nan, value)
    return (value.to(tl.int32, bitcast=True) | ((s & 0x80) << 24)).to(tl.float32, bitcast=True)


@triton.jit
def _e2m1_times(nibble, s_value, DECODE: tl.constexpr):
    """E2M1 codes (int32 0..15) times fp32 block scales, exact, in fp32."""
    if DECODE == 1:
        # code bits as fp32 sign/exponent/mantissa: value * 2^-126 exactly (codes 0, 1 land on
        # fp32 subnormals; Triton's fp32 multiply keeps them: no .ftz)
        bits = ((nibble & 7) << 22) | ((nibble & 8) << 28)
        return (bits.to(tl.float32, bitcast=True) * TWO_POW_126) * s_value
    else:
        return _e2m1_float(nibble) * s_value


@triton.jit
def _nv_operand(packed, s, DECODE: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """[ROWS, BLOCK_K] bf16 of packed bytes [ROWS, NB, 8] (int32) and UE4M3 bytes
    [ROWS, NB, 1]; element 2j (low nibble) before 2j + 1, as in memory."""
    s_value = _ue4m3_float(s)
    low = _e2m1_times(packed & 0xF, s_value, DECODE).to(tl.bfloat16)  # exact: <= 6 bits
    high = _e2m1_times(packed >> 4, s_value, DECODE).to(tl.bfloat16)
    return tl.reshape(tl.join(low, high), (ROWS, BLOCK_K))


@triton.jit
def _nv_load(k0, a_bytes, b_bytes, a_scales, b_scales, K, BLOCK_K: tl.constexpr):
    """Packed bytes and scale bytes of the step at k0 (elements; zeros / 1.0 past K)."""
    blk = tl.arange(0, BLOCK_K // 16)[None, :, None]
    kmask = (k0 + blk * 16 + 2 * tl.arange(0, 8)[None, None, :]) < K
    smask = (k0 + blk * 16) < K
    pa = tl.load(a_bytes + k0 // 2, mask=kmask, other=0)
    pb = tl.load(b_bytes + k0 // 2, mask=kmask, other=0)
    sa = tl.load(a_scales + k0 // 16, mask=smask, other=0x38)
    sb = tl.load(b_scales + k0 // 16, mask=smask, other=0x38)
    return pa, pb, sa, sb


@triton.jit
def _nv_step(pa, pb, sa, sb, acc, DECODE: tl.constexpr, BLOCK_M: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr):
    """One step on loaded tiles: decode, dot."""
    pa, pb, sa, sb = pa.to(tl.int32), pb.to(tl.int32), sa.to(tl.int32), sb.to(tl.int32)
    a = _nv_operand(pa, sa, DECODE, BLOCK_M, BLOCK_K)
    b = _nv_operand(pb, sb, DECODE, BLOCK_N, BLOCK_K)
    return _dot(a, b, acc, INTERPRET)


@triton.jit
def _fused_nvfp4_kernel(a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, alpha_ptr, c_ptr, M, N, K,
                        DECODE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, GROUP: tl.constexpr, EVEN_K: tl.constexpr,
                        OUT_FP32: tl.constexpr, INTERPRET: tl.constexpr):
    """C[M, N] = bf16(alpha * (decode(A) @ decode(B)^T)); A packed [M, K/2] uint8, scales
    [M, K/16] UE4M3 bytes; alpha one fp32 on the device (no host sync)."""
    pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP)
    rows_a = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    rows_b = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    KB = K // 2
    SK = K // 16
    blk = tl.arange(0, BLOCK_K // 16)[None, :, None]
    lane = tl.arange(0, 8)[None, None, :]
    ra = rows_a.to(tl.int64)[:, None, None]
    rb = rows_b.to(tl.int64)[:, None, None]
    a_bytes = a_ptr + ra * KB + blk * 8 + lane
    b_bytes = b_ptr + rb * KB + blk * 8 + lane
    a_scales = a_scale_ptr + ra * SK + blk
    b_scales = b_scale_ptr + rb * SK + blk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    pa, pb, sa, sb = _nv_load(0, a_bytes, b_bytes, a_scales, b_scales, K, BLOCK_K)
    if INTERPRET:  # see _mx_loop
        k0 = 0
        while k0 < K:
            na, nb, nsa, nsb = _nv_load(k0 + BLOCK_K, a_bytes, b_bytes, a_scales, b_scales, K,
                                        BLOCK_K)
            acc = _nv_step(pa, pb, sa, sb, acc, DECODE, BLOCK_M, BLOCK_N, BLOCK_K, INTERPRET)
            pa, pb, sa, sb = na, nb, nsa, nsb
            k0 += BLOCK_K
    else:
        for k0 in range(0, K, BLOCK_K):
            na, nb, nsa, nsb = _nv_load(k0 + BLOCK_K, a_bytes, b_bytes, a_scales, b_scales, K,
                                        BLOCK_K)
            acc = _nv_step(pa, pb, sa, sb, acc, DECODE, BLOCK_M, BLOCK_N, BLOCK_K, INTERPRET)
            pa, pb, sa, sb = na, nb, nsa, nsb
    acc = acc * tl.load(alpha_ptr)
    _store(c_ptr, acc, pid_m, pid_n, M, N, BLOCK_M, BLOCK_N, OUT_FP32)


def _prepare(a_data, a_scale, b_data, b_scale, block, config):
    block_m, block_n, block_k, warps, stages = config or DEFAULT_CONFIG
    if a_data.dim() != 2 or b_data.dim() != 2 or a_data.shape[1] != b_data.shape[1]:
        raise ValueError(f"fused GEMM needs 2-D operands with one reduction dim, got "
                         f"{tuple(a_data.shape)} and {tuple(b_data.shape)}")
    if block_k % block:
        raise ValueError(f"BLOCK_K {block_k} must hold whole {block}-element scale blocks")
    m, n = a_data.shape[0], b_data.shape[0]
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    tiles = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP=GROUP_M)
    return (a_scale.contiguous().view(torch.uint8), b_scale.contiguous().view(torch.uint8), m, n,
            grid, tiles, dict(num_warps=warps, options={"num_stages": stages}))


def fused_mxfp8_gemm(a_data, a_scale, b_data, b_scale, *, decode: str = "lib", config=None,
                     out_fp32: bool = False) -> torch.Tensor:
    """bf16 [M, N] = A @ B^T of two MXFP8 rowwise copies: data [M, K] / [N, K] (float8),
    E8M0 scales [M, K/32] / [N, K/32]; K % 32 == 0. `out_fp32` returns the fp32 accumulator
    (tests); `config` = (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)."""
    if a_data.dtype != b_data.dtype or a_data.dtype not in (torch.float8_e4m3fn,
                                                            torch.float8_e5m2):
        raise ValueError(f"MXFP8 data must be one FP8 dtype, got {a_data.dtype}, {b_data.dtype}")
    e5m2 = a_data.dtype == torch.float8_e5m2
    mantissa_bits, bias, fast_min, fast_max = E5M2_DECODE if e5m2 else E4M3_DECODE
    k = a_data.shape[-1]
    if k % 32:
        raise ValueError(f"MXFP8 K = {k} must be a multiple of 32")
    sa, sb, m, n, grid, tiles, launch_opts = _prepare(a_data, a_scale, b_data, b_scale, 32,
                                                      config)
    out = torch.empty((m, n), dtype=torch.float32 if out_fp32 else torch.bfloat16,
                      device=a_data.device)
    if m * n and k:
        launch(_fused_mxfp8_kernel, grid, a_data.contiguous().view(torch.int8), sa,
               b_data.contiguous().view(torch.int8), sb, out, m, n, k,
               MANTISSA_BITS=mantissa_bits, BIAS=bias, FAST_MIN=fast_min, FAST_MAX=fast_max,
               E5M2=e5m2, DECODE=MX_DECODES[decode], **tiles,
               EVEN_K=k % tiles["BLOCK_K"] == 0, OUT_FP32=out_fp32,
               INTERPRET=interpreter_enabled(), **launch_opts)
    elif m * n:
        out.zero_()
    return out


def fused_nvfp4_gemm(a_data, a_scale, b_data, b_scale, alpha, *, decode: str = "lib",
                     config=None, out_fp32: bool = False) -> torch.Tensor:
    """bf16 [M, N] = alpha * (A @ B^T) of two NVFP4 rowwise copies: packed data [M, K/2] /
    [N, K/2] (uint8), UE4M3 scales [M, K/16] / [N, K/16]; alpha a 1-element fp32 tensor
    (S_dec(A) * S_dec(B)) on the device; K % 16 == 0."""
    k = 2 * a_data.shape[-1]
    sa, sb, m, n, grid, tiles, launch_opts = _prepare(a_data, a_scale, b_data, b_scale, 16,
                                                      config)
    out = torch.empty((m, n), dtype=torch.float32 if out_fp32 else torch.bfloat16,
                      device=a_data.device)
    alpha = alpha.reshape(1).float()
    if m * n and k:
        launch(_fused_nvfp4_kernel, grid, a_data.contiguous().view(torch.uint8), sa,
               b_data.contiguous().view(torch.uint8), sb, alpha, out, m, n, k,
               DECODE=NV_DECODES[decode], **tiles, EVEN_K=k % tiles["BLOCK_K"] == 0,
               OUT_FP32=out_fp32, INTERPRET=interpreter_enabled(), **launch_opts)
    elif m * n:
        out.zero_()
    return out


def fused_gemm(a, b, **kwargs) -> torch.Tensor:
    """fprop Y = X W^T from two storages (or QuantizedTensors) of one format, rowwise copies:
    what general_gemm(a, b) computes on the "bf16" path, with bf16 output and no bias."""
    from .. import numerics
    from ..quantizers import MXFP8Storage, NVFP4Storage, as_storage

    a, b = as_storage(a).direction_storage(False), as_storage(b).direction_storage(False)
    if isinstance(a, MXFP8Storage) and isinstance(b, MXFP8Storage):
        return fused_mxfp8_gemm(a.rowwise_data, a.rowwise_scale, b.rowwise_data, b.rowwise_scale,
                                **kwargs)
    if isinstance(a, NVFP4Storage) and isinstance(b, NVFP4Storage):
        alpha = (numerics.global_decode_scale(a.amax_rowwise).float()
                 * numerics.global_decode_scale(b.amax_rowwise).float())
        return fused_nvfp4_gemm(a.rowwise_data, a.rowwise_scale, b.rowwise_data, b.rowwise_scale,
                                alpha, **kwargs)
    raise TypeError(f"fused_gemm takes two MXFP8 or two NVFP4 storages, got "
                    f"{type(a).__name__} and {type(b).__name__}")
