"""The host decisions of the per-tensor FP8 casts, checked on the CPU (no Triton needed).

Why: one tile function serves every per-tensor cast, in load and store modes the host picks
(per_tensor_fp8.tile_modes for one tensor, multi_tensor._cast_plan for a group). A wrong mode
reads or writes the wrong layout (a words store into a row that does not start on a word, a
missing mask on a partial tile); the GPU tests catch that only for the shapes they run. Here the
group plan, which derives its facts from bitwise ORs of the shapes and offsets, is compared with
the facts stated tensor by tensor, over random groups (odd, empty and misaligned members).
"""

from __future__ import annotations

import random

import pytest
import torch

from minifloat.kernels import multi_tensor, per_tensor_fp8


def _plan_by_tensor(shapes, offsets, base):
    """The plan as a statement per tensor (the independent reading of the rules)."""
    words = all(m % 4 == 0 and k % 4 == 0 for m, k in shapes)
    tile_m, tile_k = ((multi_tensor.TILE_M, multi_tensor.TILE_K) if words
                      else (per_tensor_fp8.BYTES_TILE_M, per_tensor_fp8.BYTES_TILE_K))
    element = base.element_size()
    divisor = 16 // element
    expected = {
        "BLOCK_M": tile_m, "BLOCK_K": tile_k,
        # every tensor read as int64 words: bf16, rows of whole words, 8-byte aligned address
        "HALVES": all(base.dtype == torch.bfloat16 and k % 4 == 0
                      and (base.data_ptr() + offset * element) % 8 == 0
                      for (_, k), offset in zip(shapes, offsets, strict=True)),
        "ROW_WORDS": all(k % 4 == 0 for _, k in shapes),
        "COL_WORDS": all(m % 4 == 0 for m, _ in shapes),
        "MASK_M": any(m % tile_m != 0 or m * k == 0 for m, k in shapes),
        "MASK_K": any(k % tile_k != 0 or m * k == 0 for m, k in shapes),
        "X_DIVISOR": divisor if all(offset % divisor == 0 for offset in offsets) else 1,
        "M_ALIGNED": all(m % 16 == 0 for m, _ in shapes),
        "K_ALIGNED": all(k % 16 == 0 for _, k in shapes),
    }
    counts = [max(1, -(-m // tile_m) * -(-k // tile_k)) for m, k in shapes]
    return expected, counts


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("seed", range(40))
def test_group_plan_equals_the_per_tensor_rules(seed, dtype):
    rng = random.Random(seed)
    n = rng.randint(1, 12)
    dims = [0, 1, 2, 3, 4, 12, 16, 36, 64, 96, 128, 130, 256, 4100]
    if seed % 4 == 0:  # groups of aligned weights, the common case
        dims = [64, 128, 256, 512, 2048]
    shapes = [(rng.choice(dims), rng.choice(dims)) for _ in range(n)]
    step = rng.choice([1, 2, 4, 8])  # offsets in elements, negative ones included
    offsets = [0] + [step * rng.randint(-4096, 4096) for _ in range(n - 1)]
    base = torch.empty(64, dtype=dtype)
    constexprs, counts = multi_tensor._cast_plan(shapes, base, offsets)
    expected, expected_counts = _plan_by_tensor(shapes, offsets, base)
    assert {name: constexprs[name] for name in expected} == expected, (shapes, offsets)
    assert counts == expected_counts
    assert not constexprs["WIDE"]
    # a group of one plans as that tensor alone would be cast
    m, k = shapes[0]
    alone = per_tensor_fp8.tile_modes(base, m, k, constexprs["BLOCK_M"], constexprs["BLOCK_K"])
    single, _ = multi_tensor._cast_plan(shapes[:1], base, [0])
    for name in ("HALVES", "ROW_WORDS", "COL_WORDS"):
        assert single[name] == alone[name], name


def test_wide_offsets_for_huge_tensors():
    """In-tile offsets of a tensor with 64 * max(M, K) >= 2^31 need 64 bits."""
    base = torch.empty(64, dtype=torch.bfloat16)
    constexprs, _ = multi_tensor._cast_plan([(16, 2**25 + 16), (64, 64)], base, [0, 0])
    assert constexprs["WIDE"]


def test_tile_views_match_the_modes():
    """Words modes hand the kernel int64 / int32 views of the same storage; byte modes and the
    dummy for an absent copy are passed as they are."""
    x = torch.zeros(8, 40, dtype=torch.bfloat16)
    rows = torch.empty(8, 40, dtype=torch.uint8)
    dummy = torch.empty(1, dtype=torch.float32)
    modes = per_tensor_fp8.tile_modes(x, 8, 40, 64, 128)
    x_view, rows_view, cols_view = per_tensor_fp8.tile_views(x, rows, dummy, modes)
    assert x_view.dtype == torch.int64 and x_view.data_ptr() == x.data_ptr()
    assert rows_view.dtype == torch.int32 and rows_view.shape == (8, 10)
    assert cols_view is dummy
    odd = torch.zeros(6, 38, dtype=torch.bfloat16)
    modes = per_tensor_fp8.tile_modes(odd, 6, 38, 64, 128)
    assert not (modes["HALVES"] or modes["ROW_WORDS"] or modes["COL_WORDS"])
    out = torch.empty(6, 38, dtype=torch.uint8)
    views = per_tensor_fp8.tile_views(odd, out, out, modes)
    assert all(view is given for view, given in zip(views, (odd, out, out), strict=True))
