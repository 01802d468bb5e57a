"""The host side of the master-weight cast kernels (master_cast.py, master_cast_mx.py): a plan
per format, master dtype and quantizer configuration, holding the int64 table its launches
read.

A plan is built once and kept by its caller (distributed/master_cast_batched.py) while the
ranges and buffers repeat: building the table was most of a call's host time. `maxima` launches
the format's maxima kernel over the rank's window (delayed scaling casts in it too); `cast`
launches current scaling's cast, delayed scaling's fold of the reduced amax, or the block
formats' scale kernel and their window cast.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..numerics.formats import fp8_format
from .element_cast import E4M3_CONSTANTS, E5M2_CONSTANTS, kernel_view
from .fp8_common import cdiv, dtype_max_bits, hw_cast
from .launch import launch
from .master_cast import (
    _block_cast_kernel,
    _block_maxima_kernel,
    _block_scales_kernel,
    _delayed_cast_kernel,
    _delayed_fold_kernel,
    _per_tensor_cast_kernel,
    _per_tensor_maxima_kernel,
)
from .master_cast_mx import (
    _mxfp8_cast_kernel,
    _mxfp8_maxima_kernel,
    _mxfp8_scales_kernel,
    _nvfp4_cast_kernel,
    _nvfp4_maxima_kernel,
    _nvfp4_scales_kernel,
)
from .master_cast_tiles import CAST_IN_MAXIMA, TILE_COLUMNS, TILE_ROWS, cut_tile_rows
from .multi_tensor import _search_steps, _starts
from .mxfp8 import _reciprocal_bits
from .nvfp4 import FP_FUSION

SCALE_BLOCK = 2048  # scale entries per program of block FP8's scale kernel
MXFP8_SCALE_BLOCK = 8192  # exponents per program of MXFP8's scale kernel
NVFP4_SCALE_COLUMNS = 128  # NVFP4: scale columns per program (times the tile's 16 rows)
NVFP4_SCALE_TILE_ROWS = 32  # NVFP4: 16-row tile rows per program of the scale kernel
PER_TENSOR = ("current", "delayed")  # per-tensor FP8: flat runs of the range, no tiles
FLAT_BLOCK = 4096  # elements per program of the per-tensor kernels
BLOCK_CHUNK = 32  # block FP8 sweeps its 128-row tile in chunks of this many rows
FIELDS = 17  # int64 entries per weight in the table
# table fields
_MASTER, _START, _END, _M, _K, _MAXIMA, _BASE, _ROWS_HELD = range(8)
_ROW_DATA, _COL_DATA, _ROW_SCALE, _COL_SCALE, _ROW_AMAX = range(8, 13)
_CUT_FIRST, _WINDOW_ROW, _SCALE_SOURCE, _CUT_NEXT = 13, 14, 15, 16
# _SCALE_SOURCE: delayed scaling's recipe-state scale. _CUT_*: the tile rows the block formats'
# cast launch covers (cut_tile_rows).
NUM_WARPS = 4  # every launch (8 warps for the MXFP8 and NVFP4 casts measured no faster on an
#                H200: 0.527 / 0.666 ms against 0.477 / 0.670)


@dataclass
class PartialCast:
    """One weight's share of a step: this rank's master range of it (None: owns none), the
    element of the full weight where the storage starts and its rows, where its maxima go in
    the vector, and the tensors the cast writes (None where the storage keeps no such copy).
    Per-tensor FP8: row_data and row_scale are the bytes and scale_inv; delayed scaling reads
    its scale from scale_source and folds the reduced amax into row_amax (the recipe state's
    amax slot). NVFP4: row_amax receives the global amax. MXFP8 alone writes a columnwise copy
    (col_data, col_scale): the other formats derive theirs after the gather."""

    master: torch.Tensor | None
    start: int
    shape: tuple[int, int]
    maxima_offset: int
    base: int
    rows_held: int
    row_data: torch.Tensor | None
    row_scale: torch.Tensor | None
    col_data: torch.Tensor | None = None
    col_scale: torch.Tensor | None = None
    row_amax: torch.Tensor | None = None
    scale_source: torch.Tensor | None = None


def _offset(tensor: torch.Tensor | None, base: torch.Tensor) -> int:
    """Element offset of `tensor` from `base` (same element size, lower address), -1 for
    None."""
    if tensor is None:
        return -1
    delta = tensor.data_ptr() - base.data_ptr()
    if delta < 0 or delta % base.element_size():
        raise ValueError("master_cast: a destination is not aligned to its element size")
    return delta // base.element_size()


def _bytes(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.view(torch.uint8)


class PartialCastPlan:
    """The table of one format's casts (one master dtype, one quantizer configuration), built
    once and kept while it repeats: `maxima` and `cast` launch one or two kernels each over all
    of them."""

    def __init__(self, kind: str, casts: Sequence[PartialCast], device: torch.device, *,
                 power_2_scale: bool = True, amax_epsilon: float = 0.0,
                 fp8_dtype: torch.dtype = torch.float8_e4m3fn) -> None:
        if kind not in TILE_ROWS and kind not in PER_TENSOR:
            raise ValueError(f"master_cast: unknown format {kind!r} (current, delayed, block, "
                             "mxfp8 or nvfp4)")
        self.kind, self.device, self.count = kind, device, len(casts)
        self.power_2_scale, self.amax_epsilon = power_2_scale, float(amax_epsilon)
        self.fp8_dtype = fp8_dtype
        masters = [c.master for c in casts if c.master is not None and c.master.numel()]
        dtypes = {m.dtype for m in masters}
        if len(dtypes) > 1 or not dtypes <= {torch.float32, torch.bfloat16}:
            raise ValueError(f"master_cast: masters of one plan share fp32 or bf16, got {dtypes}")
        self.master_base, self.bf16_bits = (
            kernel_view(min(masters, key=torch.Tensor.data_ptr)) if masters
            else (torch.zeros(1, device=device), False))
        # the lowest address of each kind is the base, so every offset is >= 0 (-1: none)
        tensors = [t for c in casts for t in (c.row_data, c.col_data, c.row_scale, c.col_scale,
                                              c.row_amax, c.scale_source) if t is not None]
        codes = [_bytes(t) for t in tensors if t.dtype != torch.float32]
        floats = [t for t in tensors if t.dtype == torch.float32]
        self.bytes_base = (min(codes, key=torch.Tensor.data_ptr) if codes
                           else torch.zeros(1, dtype=torch.uint8, device=device))
        self.floats_base = (min(floats, key=torch.Tensor.data_ptr) if floats
                            else torch.zeros(1, device=device))
        table, window_counts, cast_counts, scale_counts = [], [], [], []
        # the hints hold for base + offset only where the bases themselves are 16-byte aligned
        bases_aligned = (self.master_base.data_ptr() % 16 == 0
                         and self.bytes_base.data_ptr() % 16 == 0)
        self.aligned = self.scales_aligned = bases_aligned
        for cast in casts:
            entry, window, cast_programs, scale_programs = self._entry(cast)
            self.aligned = self.aligned and self._aligned(entry)
            self.scales_aligned = self.scales_aligned and self._scales_aligned(entry)
            table.extend(entry)
            window_counts.append(window)
            cast_counts.append(cast_programs)
            scale_counts.append(scale_programs)
        self.window_programs, self.cast_programs, self.scale_programs = (
            sum(window_counts), sum(cast_counts), sum(scale_counts))
        self.table = torch.tensor(table + _starts(window_counts) + _starts(cast_counts)
                                  + _starts(scale_counts), dtype=torch.int64).to(device)
        n = len(casts)
        self.window_starts, self.cast_starts, self.scale_starts = (
            self.table[len(table) + k * n:len(table) + (k + 1) * n] for k in range(3))
        self.steps = _search_steps(n)

    def _entry(self, cast: PartialCast) -> tuple[list[int], int, int, int]:
        """(the weight's table row, its programs in the maxima launch, in the cast launch and
        in the scale launch)."""
        rows, columns = cast.shape
        count = 0 if cast.master is None else cast.master.numel()
        # fp32 scales (per-tensor and block scale_inv) or code bytes (E8M0, UE4M3)
        scale_base = self.floats_base if self.kind in ("block", *PER_TENSOR) else self.bytes_base
        scale_view = _bytes if scale_base is self.bytes_base else (lambda t: t)
        entry = [0] * FIELDS
        entry[_MASTER] = _offset(cast.master, self.master_base) if count else 0
        entry[_START], entry[_END], entry[_M], entry[_K] = (
            cast.start, cast.start + count, rows, columns)
        entry[_MAXIMA], entry[_BASE], entry[_ROWS_HELD] = (
            cast.maxima_offset, cast.base, cast.rows_held)
        entry[_ROW_DATA] = _offset(_bytes(cast.row_data), self.bytes_base)
        entry[_COL_DATA] = _offset(_bytes(cast.col_data), self.bytes_base)
        entry[_ROW_SCALE] = _offset(
            None if cast.row_scale is None else scale_view(cast.row_scale), scale_base)
        entry[_COL_SCALE] = _offset(
            None if cast.col_scale is None else scale_view(cast.col_scale), scale_base)
        entry[_ROW_AMAX] = _offset(cast.row_amax, self.floats_base)
        entry[_SCALE_SOURCE] = _offset(cast.scale_source, self.floats_base)
        if self.kind in PER_TENSOR:  # runs of the range; one run writes the scale at least
            runs = cdiv(count, FLAT_BLOCK)
            return entry, runs, max(runs, 1), 0
        tile_rows = TILE_ROWS[self.kind]
        tiles_k = cdiv(columns, TILE_COLUMNS[self.kind])
        first_tile = cast.start // columns // tile_rows
        end_tile = cdiv(cdiv(cast.start + count, columns), tile_rows)
        entry[_WINDOW_ROW] = first_tile
        window = (end_tile - first_tile) * tiles_k if count else 0
        if self.kind not in CAST_IN_MAXIMA:  # NVFP4 casts its whole window after the all-reduce
            return entry, window, window, self._scale_programs(cast)
        cut = cut_tile_rows(cast.start, count, rows, columns, tile_rows, TILE_COLUMNS[self.kind])
        if cut:
            entry[_CUT_FIRST] = cut[0]
            entry[_CUT_NEXT] = cut[1] if len(cut) > 1 else cut[0]
        return entry, window, len(cut) * tiles_k, self._scale_programs(cast)

    def _aligned(self, entry: list[int]) -> bool:
        """Whether this weight's masters and bytes start on 16-element boundaries where the
        kernels address them (per-tensor: each run; tiles: each tile's element (0, 0), rows of
        K % 16 == 0), so that the ALIGNED hints hold and loads and stores may be 16 bytes."""
        owned = entry[_END] > entry[_START]
        if self.kind in PER_TENSOR:
            master = not owned or entry[_MASTER] % 16 == 0
            data = entry[_ROW_DATA] < 0 or (entry[_ROW_DATA] + entry[_START]
                                             - entry[_BASE]) % 16 == 0
            return master and data
        master = not owned or (entry[_MASTER] - entry[_START]) % 16 == 0
        if self.kind == "nvfp4":  # packed bytes: each tile row's first byte 8-byte aligned
            data = entry[_ROW_DATA] < 0 or (entry[_ROW_DATA] % 8 == 0 and entry[_BASE] % 16 == 0)
        else:
            data = all(entry[field] < 0 or (entry[field] - entry[_BASE]) % 16 == 0
                       for field in (_ROW_DATA, _COL_DATA))
        return entry[_K] % 16 == 0 and master and data

    def _scales_aligned(self, entry: list[int]) -> bool:
        """Whether the scale kernel's whole runs (MXFP8: the exponent vector's runs into the
        scale tensors) and tile rows (NVFP4: rows of K/16 codes) start on 16-byte boundaries,
        so that their SCALES_ALIGNED hints hold (the exponent vector's own address is checked
        at launch)."""
        scales = [entry[field] for field in (_ROW_SCALE, _COL_SCALE) if entry[field] >= 0]
        if self.kind == "nvfp4":
            return entry[_K] % 256 == 0 and all(offset % 16 == 0 for offset in scales)
        if self.kind == "mxfp8":
            rows, columns = entry[_M], entry[_K]
            sources = (entry[_MAXIMA], entry[_BASE] // 32, rows * (columns // 32))
            return all(offset % 16 == 0 for offset in (*sources, *scales))
        return False

    def _scale_programs(self, cast: PartialCast) -> int:
        """Programs of the scale launch for this weight (as the scale kernels divide it)."""
        rows, columns = cast.shape
        if self.kind == "block":
            return cdiv(cdiv(rows, 128) * cdiv(columns, 128), SCALE_BLOCK)
        if self.kind == "nvfp4":  # 16-row tile rows the held rows touch x column runs
            first_row = cast.base // columns
            tile_rows = cdiv(first_row + cast.rows_held, 16) - first_row // 16
            return (cdiv(tile_rows, NVFP4_SCALE_TILE_ROWS)
                    * cdiv(columns // 16, NVFP4_SCALE_COLUMNS))
        rowwise = cast.rows_held * (columns // 32) if cast.row_scale is not None else 0
        columnwise = (rows // 32) * columns if cast.col_scale is not None else 0
        return cdiv(rowwise, MXFP8_SCALE_BLOCK) + cdiv(columnwise, MXFP8_SCALE_BLOCK)

    def maxima(self, maxima: torch.Tensor) -> None:
        """Write this rank's maxima into `maxima` (fp32, zeros where the range touches no
        block; per-tensor amaxes and NVFP4's global amax by atomic max: they start at zero;
        MXFP8: the uint8 vector of the blocks' E8M0 exponents).
        Delayed scaling casts in the same pass (its scale is the recipe state's, known before
        the all-reduce): one read of the masters instead of two. So do block FP8 and MXFP8
        for every tile that the rank's range covers whole (its scales are final before the
        all-reduce); `cast` then casts only the tiles that a boundary cuts."""
        hw = hw_cast(maxima)
        if self.kind == "delayed":
            launch(_delayed_cast_kernel, (self.cast_programs,), self.master_base,
                   self.bytes_base, self.floats_base, maxima.view(torch.int32), self.table,
                   self.cast_starts, self.count, BF16_BITS=self.bf16_bits, STEPS=self.steps,
                   FIELDS=FIELDS, BLOCK=FLAT_BLOCK, E5M2=self.fp8_dtype == torch.float8_e5m2,
                   HW_CAST=hw, ALIGNED=self.aligned, num_warps=NUM_WARPS)
            return
        if not self.window_programs:
            return
        kernel = {"current": _per_tensor_maxima_kernel, "block": _block_maxima_kernel,
                  "mxfp8": _mxfp8_maxima_kernel, "nvfp4": _nvfp4_maxima_kernel}[self.kind]
        extra = ({"CHUNK": BLOCK_CHUNK} if self.kind == "block"
                 else {"BLOCK": FLAT_BLOCK} if self.kind in PER_TENSOR
                 else {"COLUMNS": TILE_COLUMNS[self.kind]})
        if self.kind == "mxfp8":  # E8M0 exponents (uint8) of the maxima
            extra["RECIPROCAL_BITS"] = _reciprocal_bits(fp8_format(self.fp8_dtype).max_value)
        vector = maxima if self.kind == "mxfp8" else maxima.view(torch.int32)
        # block FP8 and MXFP8 also write the codes of the tiles inside the range
        codes = (self.bytes_base,) if self.kind in ("block", "mxfp8") else ()
        epsilon = (self.amax_epsilon,) if self.kind == "block" else ()
        launch(kernel, (self.window_programs,), self.master_base, vector, *codes, self.table,
               self.window_starts, self.count, *epsilon, BF16_BITS=self.bf16_bits,
               STEPS=self.steps, FIELDS=FIELDS, ALIGNED=self.aligned, num_warps=NUM_WARPS,
               **extra, **self._code_constexprs(hw))

    def _code_constexprs(self, hw: bool) -> dict:
        """The constexprs of the kernels that write a block format's codes: the maxima kernel
        (tiles inside the range) and the cast kernel (the others) take the same ones, so they
        write the same bytes. Empty for the other formats."""
        if self.kind == "block":
            return {"POW2": self.power_2_scale, "OVERFLOW_BITS": dtype_max_bits(torch.float32),
                    "HW_CAST": hw}
        if self.kind == "mxfp8":
            mantissa_bits, min_exponent, max_code = (
                E4M3_CONSTANTS if self.fp8_dtype == torch.float8_e4m3fn else E5M2_CONSTANTS)
            return {"MANTISSA_BITS": mantissa_bits, "MIN_EXPONENT": min_exponent,
                    "MAX_CODE": max_code, "E5M2": self.fp8_dtype == torch.float8_e5m2,
                    "HW_CAST": hw}
        return {}

    def cast(self, reduced: torch.Tensor) -> None:
        """Every scale of every weight, and this rank's elements, from the reduced maxima:
        current scaling in one launch; delayed scaling (cast already) folds the reduced amaxes
        into the recipe state; the block formats write their scales in flat runs of the scale
        tensors (one launch), then cast the window tiles (one launch)."""
        hw = hw_cast(reduced)
        power_2_scale, amax_epsilon, fp8_dtype = (
            self.power_2_scale, self.amax_epsilon, self.fp8_dtype)
        if self.kind == "delayed":
            launch(_delayed_fold_kernel, (self.count,), self.floats_base, reduced, self.table,
                   FIELDS=FIELDS, num_warps=1)
            return
        rest = {"BF16_BITS": self.bf16_bits, "STEPS": self.steps, "FIELDS": FIELDS,
                "ALIGNED": self.aligned, "num_warps": NUM_WARPS}
        window = (self.table, self.window_starts, self.count)
        cut = (self.table, self.cast_starts, self.count)
        scales = (self.table, self.scale_starts, self.count)
        if self.kind == "current":
            launch(_per_tensor_cast_kernel, (self.cast_programs,), self.master_base,
                   self.bytes_base, self.floats_base, reduced, self.table, self.cast_starts,
                   self.count, amax_epsilon, BLOCK=FLAT_BLOCK,
                   E5M2=fp8_dtype == torch.float8_e5m2, POW2=power_2_scale, HW_CAST=hw,
                   **rest)
        elif self.kind == "block":
            codes = self._code_constexprs(hw)
            launch(_block_scales_kernel, (self.scale_programs,), self.floats_base,
                   reduced.view(torch.int32), *scales, amax_epsilon, STEPS=self.steps,
                   FIELDS=FIELDS, BLOCK=SCALE_BLOCK, POW2=codes["POW2"],
                   OVERFLOW_BITS=codes["OVERFLOW_BITS"], num_warps=NUM_WARPS)
            if self.cast_programs:
                launch(_block_cast_kernel, (self.cast_programs,), self.master_base,
                       self.bytes_base, reduced.view(torch.int32), *cut,
                       amax_epsilon, CHUNK=BLOCK_CHUNK, **codes, **rest)
        elif self.kind == "mxfp8":
            launch(_mxfp8_scales_kernel, (self.scale_programs,), self.bytes_base, reduced,
                   *scales, STEPS=self.steps, FIELDS=FIELDS, BLOCK=MXFP8_SCALE_BLOCK,
                   SCALES_ALIGNED=self.scales_aligned and reduced.data_ptr() % 16 == 0,
                   num_warps=NUM_WARPS)
            if self.cast_programs:
                launch(_mxfp8_cast_kernel, (self.cast_programs,), self.master_base,
                       self.bytes_base, reduced, *cut, COLUMNS=TILE_COLUMNS["mxfp8"],
                       **self._code_constexprs(hw), **rest)
        else:
            launch(_nvfp4_scales_kernel, (self.scale_programs,), self.bytes_base,
                   self.floats_base, reduced, *scales, STEPS=self.steps, FIELDS=FIELDS,
                   BLOCK=NVFP4_SCALE_COLUMNS, TILE_ROWS=NVFP4_SCALE_TILE_ROWS,
                   SCALES_ALIGNED=self.scales_aligned,
                   num_warps=NUM_WARPS)
            if self.window_programs:
                # no fp contraction (nvfp4.FP_FUSION): an FMA fusing |x| * scale into the
                # rounding add skips the reference's rounding of the product (bf16 masters
                # whose products fall near an E2M1 tie gave other codes)
                launch(_nvfp4_cast_kernel, (self.window_programs,), self.master_base,
                       self.bytes_base, reduced, *window, COLUMNS=TILE_COLUMNS["nvfp4"],
                       options={"enable_fp_fusion": FP_FUSION}, **rest)
