"""save_original_input under torch.compile: the input's copies for wgrad, made in the backward
formula of the compiled GEMM op in plain torch ops.

Why plain torch ops: inductor's partitioner keeps for backward what backward reads, unless it
can recompute it there from what is kept anyway. A GEMM input is usually a norm's or an
activation's output, recomputable from the norm's input and statistics or the activation's
input, which their own backward keeps. The partitioner recomputes only what backward reads
through fusible torch ops; read by a custom op (the backward GEMM op), the input would count as
materialized and be kept in high precision, 2 bytes an element where its FP8 copy costs 1. Made
here, inductor fuses the recomputation with the cast, and nothing input-sized is kept for the
GEMM at all (torchao's float8 gets its activation memory this way).

Per-tensor FP8 current scaling, the case that matters for speed, is cast by `per_tensor_copy`:
amax, scale and a saturating cast, which equal the reference (NUMERICS.md §2) bit for bit
(tests/modules/test_memory_options.py checks it on special values). The other formats take
their quantizer's reference path, which is pure torch on traced tensors (same bytes, slower
code than the kernels).
"""

from __future__ import annotations

import torch

from .. import numerics
from ..quantizers import Float8CurrentScalingQuantizer, Float8Storage, Quantizer
from .linear_function import keep_for_backward, rebuild_input_copies


def per_tensor_copy(x2d: torch.Tensor, quantizer: Float8CurrentScalingQuantizer
                    ) -> Float8Storage:
    """The columnwise copy of per-tensor current scaling: data_transpose [K, M] and scale_inv,
    as the quantizer makes them, in fusible torch ops.

    The reference rounds on the format's grid in fp32 arithmetic, then encodes; torch's
    conversion to an FP8 dtype rounds to nearest even itself, so after clamping to +-max
    (saturation; NaN passes through) one conversion gives the same bytes."""
    fmt = numerics.fp8_format(quantizer.fp8_dtype)
    if x2d.numel() == 0:
        amax = torch.zeros((), dtype=torch.float32, device=x2d.device)
    else:
        amax = torch.amax(x2d.abs()).float()
    scale = numerics.scale_from_amax(amax, fmt.max_value, amax_epsilon=quantizer.amax_epsilon,
                                     power_2_scale=quantizer.power_2_scale)
    data = torch.clamp(x2d.float() * scale, -fmt.max_value, fmt.max_value).to(
        quantizer.fp8_dtype)
    return Float8Storage(shape=x2d.shape, dtype=x2d.dtype, quantizer=quantizer, data=None,
                         data_transpose=data.t().contiguous(),
                         scale_inv=torch.reciprocal(scale).reshape(1),
                         fp8_dtype=quantizer.fp8_dtype)


def input_copy_buffers(x: torch.Tensor, splits: list[int], quantizers: list[Quantizer]
                       ) -> list[torch.Tensor]:
    """The buffers of the input copies that a forward keeping them would have handed to
    backward, in that order (keep_for_backward's), for stateless quantizers."""
    if len(quantizers) == 1 and type(quantizers[0]) is Float8CurrentScalingQuantizer:
        x_qs = [per_tensor_copy(x.reshape(-1, x.shape[-1]), quantizers[0])]
    else:
        x_qs = rebuild_input_copies(x, splits, quantizers, [None] * len(quantizers))
    kept = keep_for_backward(x_qs, [], need_dgrad=False, need_wgrad=True)
    return [t.contiguous() for t in kept.tensors if t is not None]
