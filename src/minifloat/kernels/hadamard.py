"""The 16-point random Hadamard transform (NUMERICS.md §6) as a Triton device function.

Bit-exact against numerics.hadamard.random_hadamard_transform, so it follows the reference's
order of operations: signs (exact), four fp32 butterfly stages with strides 1, 2, 4, 8 (a + b,
a - b, a the lower index), times 1/4 (exact), round to bf16. A matrix product would sum in a
different order and differ in the last bit.

The butterflies run in registers: each run of 16 is viewed as a 2x2x2x2 tensor whose axes are
the bits of the index (b3 b2 b1 b0). A stage splits the last axis (the pair it combines), joins
(a + b, a - b) back as the last axis and rotates the four bit axes by one, so the next stage's
bit comes last; after four stages the rotation is back to the start.
"""

import triton
import triton.language as tl

from ..numerics.hadamard import RHT_SIGNS, RHT_SIZE
from .element_cast import round_to_bf16

# Bit i set where the sign s_i of the transform is -1.
RHT_NEGATIVE_MASK = tl.constexpr(sum(1 << i for i, s in enumerate(RHT_SIGNS) if s < 0))
RUN = tl.constexpr(RHT_SIZE)


@triton.jit
def rht16_rows(v, ROWS: tl.constexpr, COLS: tl.constexpr):
    """RHT of every run of 16 along the last dim of fp32 v [ROWS, COLS]; bf16 values as fp32."""
    index = tl.arange(0, RUN)
    negative = (tl.full([RUN], RHT_NEGATIVE_MASK, tl.int32) >> index) & 1
    signs = tl.where(negative == 1, -1.0, 1.0)
    runs = tl.reshape(v, [ROWS * COLS // RUN, RUN]) * signs[None, :]
    runs = tl.reshape(runs, [ROWS * COLS // RUN, 2, 2, 2, 2])
    for _ in tl.static_range(4):
        low, high = tl.split(runs)
        runs = tl.permute(tl.join(low + high, low - high), [0, 4, 1, 2, 3])
    return round_to_bf16(tl.reshape(runs, [ROWS, COLS]) * 0.25)
