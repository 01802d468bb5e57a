"""The tile geometry of the partial master-weight casts (master_cast_plan.py), in host code
that imports without Triton, so that the CPU suite checks it (tests/numerics).
"""

from __future__ import annotations

from .fp8_common import cdiv

# tiles: rows = the format's block rows; columns per program
TILE_ROWS = {"block": 128, "mxfp8": 32, "nvfp4": 16}
TILE_COLUMNS = {"block": 128, "mxfp8": 256, "nvfp4": 256}
CAST_IN_MAXIMA = ("block", "mxfp8")  # formats whose maxima kernel casts the uncut tiles


def cut_tile_rows(start: int, count: int, rows: int, columns: int, tile_rows: int,
                  tile_columns: int) -> list[int]:
    """The tile rows of a rank's window (range [start, start + count) of a rows x columns
    weight) that hold a tile the range or the weight's edge cuts: the block formats' cast
    launch covers only these, since their maxima kernel casts every other tile.

    Why a list of at most two: a tile row between the window's first and last lies wholly
    inside the range, so only the first (the range may start inside it) and the last (the range
    may end inside it, or the weight's rows) can be cut; where K leaves a narrow last tile in
    every row, every window row is listed. Programs that found their tile uncut and exited had
    been most of the cast launch (8 ranks: about 0.06 ms of an MXFP8 step's 0.49 on an H100)."""
    if not count:
        return []
    end = start + count
    first = start // columns // tile_rows
    last = cdiv(cdiv(end, columns), tile_rows) - 1
    if columns % tile_columns:
        return list(range(first, last + 1))
    band = tile_rows * columns

    def whole(tile_row: int) -> bool:
        return (start <= tile_row * band and (tile_row + 1) * band <= end
                and (tile_row + 1) * tile_rows <= rows)

    return [t for t in dict.fromkeys((first, last)) if not whole(t)]
