"""Which tile rows the block formats' master-cast launch covers, checked on the CPU.

Why: the maxima kernel of block FP8 and MXFP8 casts every tile that lies wholly inside the
rank's range and the weight (master_cast._interior); the cast launch after the all-reduce covers
only the tile rows that master_cast_tiles.cut_tile_rows lists. A row left out would leave the
rank's elements of a cut tile unwritten, and only the shapes the GPU tests run would show it.
Here the list is compared, over random weights and flat ranges, with every tile classified one
by one by the kernel's rule.
"""

from __future__ import annotations

import random

import pytest

from minifloat.kernels.master_cast_tiles import (
    CAST_IN_MAXIMA,
    TILE_COLUMNS,
    TILE_ROWS,
    cut_tile_rows,
)


def _tile_is_whole(start, end, rows, columns, row0, col0, tile_rows, tile_columns):
    """master_cast._interior, restated: inside the weight and inside [start, end)."""
    origin = row0 * columns + col0
    return (start <= origin and origin + (tile_rows - 1) * columns + tile_columns <= end
            and row0 + tile_rows <= rows and col0 + tile_columns <= columns)


def _rows_with_cut_tiles(start, count, rows, columns, tile_rows, tile_columns):
    """Every tile row of the window (the rows the range touches) with a tile that is not
    whole, by looking at each tile."""
    if not count:
        return set()
    end = start + count
    first, last = start // columns // tile_rows, (end - 1) // columns // tile_rows
    return {t for t in range(first, last + 1)
            for col0 in range(0, columns, tile_columns)
            if not _tile_is_whole(start, end, rows, columns, t * tile_rows, col0, tile_rows,
                                  tile_columns)}


@pytest.mark.parametrize("kind", CAST_IN_MAXIMA)
def test_cut_rows_are_exactly_the_rows_with_a_cut_tile(kind):
    tile_rows, tile_columns = TILE_ROWS[kind], TILE_COLUMNS[kind]
    rng = random.Random(kind)
    cases = 0
    for _ in range(400):
        rows = rng.choice([tile_rows, 3 * tile_rows, 5 * tile_rows + 7, rng.randint(1, 700)])
        columns = rng.choice([tile_columns, 2 * tile_columns, 3 * tile_columns - 32,
                              rng.randint(1, 600)])
        total = rows * columns
        ranks = rng.randint(1, 8)
        cuts = sorted({0, total, *(rng.randint(0, total) for _ in range(ranks - 1))})
        if rng.random() < 0.3:  # ranges cut at tile-row boundaries: nothing may be listed
            band = tile_rows * columns
            cuts = sorted({0, total, *(min(total, band * rng.randint(0, rows)) for _ in range(3))})
        for start, end in zip(cuts, cuts[1:], strict=False):
            listed = cut_tile_rows(start, end - start, rows, columns, tile_rows, tile_columns)
            assert len(listed) == len(set(listed)), listed
            assert set(listed) == _rows_with_cut_tiles(start, end - start, rows, columns,
                                                        tile_rows, tile_columns), (
                kind, rows, columns, start, end, listed)
            if len(listed) > 2:  # the kernel maps band j >= 1 to listed[1] + j - 1
                assert listed == list(range(listed[0], listed[0] + len(listed)))
            cases += 1
    assert cases > 400


def test_an_empty_range_lists_nothing():
    assert cut_tile_rows(1000, 0, 64, 256, 32, 256) == []


def test_a_range_of_whole_tile_rows_lists_nothing_and_a_cut_one_its_two_ends():
    # 8 ranks over a 256 x 512 weight, cut at multiples of 32 rows: every tile row is whole
    band = 32 * 512
    assert all(cut_tile_rows(r * band, band, 256, 512, 32, 256) == [] for r in range(8))
    # a range from the middle of row 40 to the middle of row 100: its first and last tile rows
    assert cut_tile_rows(40 * 512 + 7, 60 * 512, 256, 512, 32, 256) == [1, 3]
