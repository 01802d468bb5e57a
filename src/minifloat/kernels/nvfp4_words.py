"""NVFP4 16x16 (2D) quantization on words (v3), bit-exact against numerics.nvfp4 (RNE).

Why a separate kernel: `_nvfp4_2d_kernel` (nvfp4.py) spends ~28 SASS instructions an element:
every nibble is an int32 of its own, packed into bytes with byte stores, and the columnwise copy
is a transpose of the int32 codes through shared memory. Here, as in MXFP8 v3 (mxfp8.py
`_mxfp8_words_kernel`), values only ever travel as words:
- the tile is read as 16 row slices (slice j = rows 16 r + j, as nvfp4._load_slices), each an
  [R, BLOCK_K / 8] pair of int64 words of four bf16 (eight consecutive columns, one 16-byte load);
- magnitudes are halfwise maxima of `word & 0x7FFF7FFF` (max.u16x2 on sm_90: two elements an
  instruction, NaN above inf as unsigned halves);
- each element's nibble is computed once and shifted into two int32 words: the rowwise word of
  its eight columns (a word of the [M, K / 2] layout) and, elementwise across the slices, the
  columnwise word of its column's eight rows (half of an int64 of the [K, M / 2] layout: a run
  of 16 rows is exactly one int64), so the columnwise copy needs no transpose of anything;
- the E2M1 code is nvfp4._e2m1_nibbles's rule (min of three magic adds), with the constant
  top bits of the magic sums left in the shifted words and removed once per word.

nvfp4.quantize_nvfp4 launches it when nvfp4.WORDS_2D holds and takes_words_2d accepts the
input (bf16, round to nearest).
"""

import torch
import triton
import triton.language as tl

from .fp8_common import _capability, cdiv
from .halfwise import max_halves as _max_halves
from .halfwise import max_u16x2 as _max_u16x2
from .launch import launch
from .nvfp4_scales import block_scales, e2m1_magic_bits, global_scales

# bits(2^23 + 8 + c) = MAGIC_TOP + 8 + c for every E2M1 code c in 0..7 (exponent 150)
MAGIC_TOP = 0x4B000000


def _top_bits_sum() -> int:
    """sum(MAGIC_TOP << 4 i, i < 8) mod 2^32: what the constant top bits of eight magic sums
    add to a word they were shifted into (removed with one subtraction per word)."""
    return sum((MAGIC_TOP << (4 * i)) for i in range(8)) % 2**32


TOP_BITS_SUM = tl.constexpr(_top_bits_sum() - 2**32 if _top_bits_sum() >= 2**31
                            else _top_bits_sum())


@triton.jit
def _magnitudes(word):
    """The two int32 halves of an int64 word of four bf16 with the sign bits cleared: |x| of
    elements (0, 1) and (2, 3), as unsigned 16-bit halves ordered like the values (NaN above
    inf). Both the tile amax and the elements' |x| come from these."""
    return word.to(tl.int32) & 0x7FFF7FFF, (word >> 32).to(tl.int32) & 0x7FFF7FFF


@triton.jit
def _hmax(a, b, MAX_U16X2: tl.constexpr):
    if MAX_U16X2:
        return _max_u16x2(a, b)
    return _max_halves(a, b)


@triton.jit
def _magic_code(v_bits, element_scale):
    """bits(2^23 + 8 + c) for the E2M1 code c of |v| * element_scale (|v| given as fp32 bits):
    nvfp4._e2m1_nibbles's round-to-nearest rule, without the sign and the masking, which the
    caller does per word. NaN products give some value <= MAGIC_SEVEN_BITS on the GPU (its NaN
    is positive) and are overwritten per word anyway (NaN tiles)."""
    return e2m1_magic_bits(v_bits.to(tl.float32, bitcast=True) * element_scale)


@triton.jit
def _prmt(a, b, SELECTOR: tl.constexpr, HW: tl.constexpr):
    """prmt.b32 a, b, SELECTOR: byte k of the result is byte (SELECTOR >> 4 k) & 7 of the eight
    bytes of (b:a), sign-replicated (0xFF or 0x00) where bit 3 of that selector nibble is set.
    One instruction on CUDA (HW); plain integer ops under the interpreter."""
    if HW:
        out = tl.inline_asm_elementwise(f"prmt.b32 $0, $1, $2, {SELECTOR};", "=r,r,r", [a, b],
                                        dtype=tl.int32, is_pure=True, pack=1)
    else:
        out = tl.zeros(a.shape, tl.int32)
        for k in tl.static_range(4):
            # a plain name, not `pick: tl.constexpr`: the compiler refuses to reassign an
            # annotated constexpr in the unrolled loop (the interpreter did not mind)
            pick = (SELECTOR >> (4 * k)) & 7
            source = a if pick < 4 else b
            byte = (source >> (8 * (pick % 4))) & 0xFF
            if (SELECTOR >> (4 * k)) & 8:
                byte = ((byte >> 7) & 1) * 0xFF
            out = out | (byte << (8 * k))
    return out


@triton.jit
def _signs(h0, h1, h2, h3, HW: tl.constexpr):
    """Sign bits of eight bf16 as the sign bits (bit 3) of an eight-nibble word, nibble 2 i + p
    taking the element in half p (0: bits 0-15, 1: bits 16-31) of h_i; other bits garbage
    (callers keep only bits 4 i + 3). Five instructions for eight elements instead of two per
    element: sign-replicated bytes gathered by PRMT as (e0, e2, e1, e3) and (e4, e6, e5, e7),
    then the even and odd elements' bytes, merged by nibbles."""
    a = _prmt(h0, h1, 0xFBD9, HW)  # bytes 1, 5, 3, 7 of (h1:h0), sign-replicated
    b = _prmt(h2, h3, 0xFBD9, HW)
    even = _prmt(a, b, 0x5410, HW)  # (e0, e2, e4, e6)
    odd = _prmt(a, b, 0x7632, HW)  # (e1, e3, e5, e7)
    return (even & 0x0F0F0F0F) | (odd & -252645136)  # -252645136 = 0xF0F0F0F0


@triton.jit
def _elements(low, high, element_scale, HW: tl.constexpr):
    """fp32 bits of the four bf16 halves of two int32 words, element 0 first (one shift or mask
    each). On CUDA through inline PTX that also takes element_scale (unused): without that
    dependency ptxas unpacks the whole tile ahead of the block-scale division, holding twice
    the registers (128 unpacked values instead of 64 words)."""
    if HW:
        v0, v1, v2, v3 = tl.inline_asm_elementwise(
            "{ shl.b32 $0, $4, 16; and.b32 $1, $4, 0xffff0000; shl.b32 $2, $5, 16; "
            "and.b32 $3, $5, 0xffff0000; }",
            "=r,=r,=r,=r,r,r,r", [low, high, element_scale.to(tl.int32, bitcast=True)],
            dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)
    else:
        v0, v1, v2, v3 = low << 16, low & -65536, high << 16, high & -65536
    return v0, v1, v2, v3


@triton.jit
def _half(word, HIGH: tl.constexpr):
    """Half HIGH (0: elements 0, 1; 1: elements 2, 3) of an int64 word of four bf16."""
    return (word >> 32).to(tl.int32) if HIGH else word.to(tl.int32)


@triton.jit
def _column_signs(halves, ODD: tl.constexpr, HW: tl.constexpr):
    """_signs for one column over eight slices: halves[i] holds the column's element of slice i
    in its half ODD; nibble i of the result takes slice i. Written as _signs on the halves
    rearranged so that each of its h_i pairs two slices (the column's bytes are 1 or 3)."""
    # (s0, s2) of the column in bytes 0, 1 (ODD = 0) or 2, 3 (ODD = 1); likewise the others
    a = _prmt(halves[0], halves[2], 0xFBD9, HW)
    b = _prmt(halves[4], halves[6], 0xFBD9, HW)
    c = _prmt(halves[1], halves[3], 0xFBD9, HW)
    d = _prmt(halves[5], halves[7], 0xFBD9, HW)
    if ODD:
        even = _prmt(a, b, 0x7632, HW)  # (s0, s2, s4, s6)
        odd = _prmt(c, d, 0x7632, HW)  # (s1, s3, s5, s7)
    else:
        even = _prmt(a, b, 0x5410, HW)
        odd = _prmt(c, d, 0x5410, HW)
    return (even & 0x0F0F0F0F) | (odd & -252645136)


@triton.jit
def _finish(word_sum, signs):
    """Nibble word from the sum of eight shifted magic sums and the signs (_signs): minus the
    constant top bits leaves 8 + c per nibble (no carries: 8 + c <= 15); then bit 3 of each
    nibble is taken from the signs (one LOP3)."""
    eights = -2004318072  # 0x88888888
    return ((word_sum - TOP_BITS_SUM) & ~eights) | (signs & eights)


@triton.jit
def _nvfp4_2d_words_kernel(
    x_ptr, row_data_ptr, row_scale_ptr, col_data_ptr, col_scale_ptr, amax_ptr, M, K,
    ROWWISE: tl.constexpr, COLUMNWISE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr, MAX_U16X2: tl.constexpr, HW: tl.constexpr,
):
    """Grid (M / BLOCK_M, K / BLOCK_K tiles). x_ptr: the bf16 [M, K] input as int64 [M, K / 4];
    row_data_ptr: int32 view [M, K / 8] of the rowwise data; col_data_ptr: int64 view
    [K, M / 16] of the columnwise data; scale pointers: the uint8 [M, K / 16] and [K, M / 16]
    buffers, every 16x16 tile's scale replicated over its 16 rows (columns).

    Index space: slice j, run r (rows 16 r + j of the tile), pair q (columns 8 q .. 8 q + 7);
    the 16x16 scale tile t = q // 2. Rows and columns are masked per run and per pair (M, K are
    multiples of 16, so a tile is inside the tensor or outside)."""
    R: tl.constexpr = BLOCK_M // 16
    Q: tl.constexpr = BLOCK_K // 8
    T: tl.constexpr = BLOCK_K // 16
    k_pairs = K // 8
    row_start = tl.program_id(0) * BLOCK_M
    pair_start = tl.program_id(1) * Q
    runs = tl.arange(0, R)
    pairs = tl.arange(0, Q)
    ok = ((row_start + 16 * runs)[:, None] < M) & ((pair_start + pairs)[None, :] < k_pairs)
    # int64 word offsets inside the tile (32-bit: BLOCK_M * K / 4 < 2^31) from a 64-bit origin
    origin = row_start.to(tl.int64) * (K // 4) + 2 * pair_start
    offsets = (16 * runs[:, None] * (K // 4) + 2 * pairs[None, :])[:, :, None] + tl.arange(0, 2)
    mask3 = tl.broadcast_to(ok[:, :, None], [R, Q, 2])
    evens = ()
    odds = ()
    for j in tl.static_range(16):
        even, odd = tl.split(tl.load(x_ptr + origin + (offsets + j * (K // 4)), mask=mask3,
                                     other=0))
        evens = evens + (even,)
        odds = odds + (odd,)

    # the signs of every output word, gathered first so that only the magnitudes stay live:
    # rowwise, the eight elements of slice j; columnwise, column c of slices 8 g .. 8 g + 7,
    # element c % 2 of half c // 2 of the even word (c < 4) or of the odd word
    row_signs = ()
    if ROWWISE:
        for j in tl.static_range(16):
            row_signs = row_signs + (_signs(_half(evens[j], 0), _half(evens[j], 1),
                                            _half(odds[j], 0), _half(odds[j], 1), HW),)
    col_signs = ()
    if COLUMNWISE:
        for c in tl.static_range(8):
            run_signs = ()
            for g in tl.static_range(2):
                halves = ()
                for i in tl.static_range(8):
                    word = evens[8 * g + i] if c < 4 else odds[8 * g + i]
                    halves = halves + (_half(word, (c // 2) % 2),)
                run_signs = run_signs + (_column_signs(halves, c % 2, HW),)
            col_signs = col_signs + (run_signs,)

    # |x| as halves (the loaded words die once the signs above are taken); the tile amax is
    # their halfwise maximum over the slices, then over the two pairs of a 16x16 tile
    magnitudes = ()
    for j in tl.static_range(16):
        magnitudes = magnitudes + (_magnitudes(evens[j]) + _magnitudes(odds[j]),)
    peak = _hmax(_hmax(magnitudes[0][0], magnitudes[0][1], MAX_U16X2),
                 _hmax(magnitudes[0][2], magnitudes[0][3], MAX_U16X2), MAX_U16X2)
    for j in tl.static_range(1, 16):
        peak = _hmax(peak, _hmax(_hmax(magnitudes[j][0], magnitudes[j][1], MAX_U16X2),
                                 _hmax(magnitudes[j][2], magnitudes[j][3], MAX_U16X2),
                                 MAX_U16X2), MAX_U16X2)
    if MAX_U16X2:
        peak = tl.reduce(tl.reshape(peak, [R, T, 2]), 2, _max_u16x2)
    else:
        peak = tl.reduce(tl.reshape(peak, [R, T, 2]), 2, _max_halves)
    tile_amax = (tl.maximum(peak & 0xFFFF, peak >> 16) << 16).to(tl.float32, bitcast=True)
    factor, s_dec = global_scales(amax_ptr)
    scale_code, element_scale = block_scales(tile_amax, factor, s_dec)  # [R, T]
    element_scale = tl.reshape(tl.broadcast_to(element_scale[:, :, None], [R, T, 2]), [R, Q])
    keep = element_scale == element_scale  # NaN tiles encode as +0 nibbles

    # every nibble once, into its rowwise word (per slice) and its columnwise word (column c of
    # the pair, rows 0-7 of the run in `lows`, 8-15 in `highs`) as sums of shifted magic sums;
    # the signs are gathered per word (_signs) and merged when the word is finished (_finish)
    row_ptrs = row_data_ptr + (row_start.to(tl.int64) * k_pairs + pair_start
                               + runs[:, None] * (16 * k_pairs) + pairs[None, :])
    lows = ()
    highs = ()
    for j in tl.static_range(16):
        v0, v1, v2, v3 = _elements(magnitudes[j][0], magnitudes[j][1], element_scale, HW)
        v4, v5, v6, v7 = _elements(magnitudes[j][2], magnitudes[j][3], element_scale, HW)
        values = (v0, v1, v2, v3, v4, v5, v6, v7)
        updated = ()
        row_sum = 0  # replaced by the first code (no zero-initialised word)
        for c in tl.static_range(8):
            code = _magic_code(values[c], element_scale)
            if ROWWISE:
                row_sum = code if c == 0 else row_sum + (code << (4 * c))
            if COLUMNWISE:
                if j % 8 == 0:
                    updated = updated + (code,)
                elif j < 8:
                    updated = updated + (lows[c] + (code << (4 * (j % 8))),)
                else:
                    updated = updated + (highs[c] + (code << (4 * (j % 8))),)
        if COLUMNWISE:
            if j < 8:
                lows = updated
            else:
                highs = updated
        if ROWWISE:
            words = tl.where(keep, _finish(row_sum, row_signs[j]), 0)
            tl.store(row_ptrs + j * k_pairs, words, mask=ok)

    if ROWWISE:
        # scale of tile q // 2 replicated over the 16 rows of its run: the two positions of a
        # tile (q even, odd) store the even and the odd rows, eight bytes each
        k_tiles = K // 16
        scale_ptrs = row_scale_ptr + (row_start.to(tl.int64) * k_tiles + pair_start // 2
                                      + runs[:, None] * (16 * k_tiles)
                                      + (pairs[None, :] // 2 + (pairs[None, :] % 2) * k_tiles))
        codes = tl.reshape(tl.broadcast_to(scale_code.to(tl.uint8)[:, :, None], [R, T, 2]),
                           [R, Q])
        for i in tl.static_range(8):
            tl.store(scale_ptrs + (2 * i) * k_tiles, codes, mask=ok)
    if COLUMNWISE:
        m_runs = M // 16
        # int64 run word of column 8 (pair_start + q) + c, run row_start / 16 + r
        col_ptrs = col_data_ptr + ((pair_start + pairs[None, :]).to(tl.int64) * (8 * m_runs)
                                   + row_start // 16 + runs[:, None])
        for c in tl.static_range(8):
            run_signs = col_signs[c]
            low = tl.where(keep, _finish(lows[c], run_signs[0]), 0)
            high = tl.where(keep, _finish(highs[c], run_signs[1]), 0)
            run_word = (low.to(tl.uint32).to(tl.int64)) | (high.to(tl.int64) << 32)
            tl.store(col_ptrs + c * m_runs, run_word, mask=ok)
        # scale byte of column 16 t + i, run r: the tile's code for each of its 16 columns
        col_scale = tl.reshape(tl.broadcast_to(scale_code.to(tl.uint8)[:, :, None], [R, T, 2]),
                               [R, Q])
        scale_ptrs = col_scale_ptr + ((pair_start + pairs[None, :]).to(tl.int64) * (8 * m_runs)
                                      + row_start // 16 + runs[:, None])
        for c in tl.static_range(8):
            tl.store(scale_ptrs + c * m_runs, col_scale, mask=ok)


def takes_words_2d(x2d: torch.Tensor, stochastic_rounding: bool, block_m: int,
                   block_k: int) -> bool:
    """Whether _nvfp4_2d_words_kernel serves x2d: bf16, round to nearest, the input 16-byte
    aligned (it is read in 16-byte pairs of int64 words), and a tile of power-of-two runs of 16
    rows and pairs of 8 columns covering whole 16x16 tiles. Others take nvfp4._nvfp4_2d_kernel."""
    runs, pairs = block_m // 16, block_k // 8
    return (x2d.dtype == torch.bfloat16 and not stochastic_rounding
            and x2d.data_ptr() % 16 == 0 and block_m % 16 == 0 and block_k % 16 == 0
            and runs >= 1 and runs & (runs - 1) == 0 and pairs & (pairs - 1) == 0)


def launch_2d_words(
    x2d: torch.Tensor, row_data: torch.Tensor, row_scale: torch.Tensor, col_data: torch.Tensor,
    col_scale: torch.Tensor, amax: torch.Tensor, rowwise: bool, columnwise: bool,
    block_m: int, block_k: int, num_warps: int, hw: bool, fp_fusion: bool,
) -> None:
    """Launch _nvfp4_2d_words_kernel on views of nvfp4.quantize_nvfp4's buffers (the empty
    dummy of an unrequested copy is passed as it is)."""
    m, k = x2d.shape
    row_words = row_data.view(torch.int32) if row_data.numel() else row_data
    col_words = col_data.view(torch.int64) if col_data.numel() else col_data
    launch(
        _nvfp4_2d_words_kernel, (cdiv(m, block_m), cdiv(k, block_k)),
        x2d.view(torch.int64), row_words, row_scale, col_words, col_scale, amax, m, k,
        ROWWISE=rowwise, COLUMNWISE=columnwise, BLOCK_M=block_m, BLOCK_K=block_k,
        MAX_U16X2=hw and _capability(x2d.device.index or 0) >= (9, 0), HW=hw,
        num_warps=num_warps, options={"enable_fp_fusion": fp_fusion},
    )
