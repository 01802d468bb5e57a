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

Per-tensor FP8 is cast by `per_tensor_copy`: current scaling's amax and a saturating cast in
torch ops, the scale in one small op (delayed scaling: the cast with forward's scale, which the
forward op hands over); they equal the reference (NUMERICS.md §2) bit for bit
(tests/modules/test_memory_options.py on special values, tests/gpu/test_memory_options_cuda.py
against the kernel as inductor compiles it). The other formats keep their copies under
torch.compile (`recasts`); eagerly every format honours save_original_input.
"""

from __future__ import annotations

import torch

from .. import kernels, numerics
from ..quantizers import (
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
    Float8Storage,
    Quantizer,
)
from ..quantizers.base import kernel_module
from .linear_function import keep_for_backward
from .op_define import define_op


def fp8_dtype_of(e5m2: bool) -> torch.dtype:
    """The FP8 dtype an op's `e5m2` flag names (ops take flags, not dtypes, in their schema)."""
    return torch.float8_e5m2 if e5m2 else torch.float8_e4m3fn


def _per_tensor_scales_impl(amax: torch.Tensor, e5m2: bool, amax_epsilon: float,
                            power_2_scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, scale_inv) of per-tensor current scaling for `amax` (0-d, or one per tensor: a
    MoE's experts): the reference's arithmetic, in one kernel launch where the kernels run.

    An op of its own, opaque to inductor, because inductor's code for a division or a
    reciprocal need not be correctly rounded (Triton's fp32 `/` is approximate), and a scale
    one ulp off changes every byte of the copy. A Library op (op_define), not a custom_op:
    custom_op's per-call output check cost the compiled FSDP2 step ~20 ms of host time in its
    160 calls (BENCHMARKS.md, twentieth session)."""
    if kernels.available(amax):
        return kernel_module("amax").scales_from_amax(amax, e5m2, amax_epsilon, power_2_scale)
    fp8_max = numerics.fp8_format(fp8_dtype_of(e5m2)).max_value
    scale = numerics.scale_from_amax(amax, fp8_max, amax_epsilon=amax_epsilon,
                                     power_2_scale=power_2_scale)
    return scale, torch.reciprocal(scale)


def _per_tensor_scales_fake(amax, e5m2, amax_epsilon, power_2_scale):
    return (amax.new_empty(amax.shape, dtype=torch.float32),
            amax.new_empty(amax.shape, dtype=torch.float32))


per_tensor_scales = define_op("per_tensor_scales", _per_tensor_scales_impl,
                              _per_tensor_scales_fake)


# the integer view of each float dtype, and the mask that clears its sign bit
_MAGNITUDE_BITS = {torch.bfloat16: (torch.int16, 0x7FFF), torch.float16: (torch.int16, 0x7FFF),
                   torch.float32: (torch.int32, 0x7FFFFFFF)}


def magnitude_bits(x: torch.Tensor) -> torch.Tensor | None:
    """|x|'s bits as integers (x's integer view, sign cleared), or None for another dtype.

    Why: the integer order of magnitudes is their float order, NaN above inf, so a maximum over
    them is torch.amax(x.abs())'s, NaN propagating. And it is the maximum of x's own values:
    when a compiled graph fuses the maximum into x's producer, inductor takes `x.abs().amax()`
    from the producer's fp32 values before their rounding to x's dtype (measured on an H200:
    per-tile maxima of a fused bf16 activation gradient differed from the stored tensor's);
    a bit view cannot be taken before the rounding. It also ran 5% faster there."""
    view = _MAGNITUDE_BITS.get(x.dtype)
    return None if view is None else x.view(view[0]) & view[1]


def maximum_of_bits(bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 values of maxima taken over magnitude_bits (back through the float view)."""
    return bits.view(dtype).float()


def tensor_maximum(x2d: torch.Tensor) -> torch.Tensor:
    """max|x2d| as a 0-d fp32 tensor in torch ops (0 for an empty tensor).

    Plain abs().amax(), not over magnitude_bits: inductor's whole-tensor maximum fused into a
    bf16 producer equalled the stored tensor's on an H200 (BENCHMARKS.md, twenty-fifth
    session), and the bit view's ops are ones the min-cut partitioner does not recompute, so a
    low-memory compiled step kept the inputs' FP8 copies for backward instead
    (tests/compile/test_compile_memory.py)."""
    if x2d.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x2d.device)
    return torch.amax(x2d.abs()).float()


def per_tensor_cast(x2d: torch.Tensor, fp8_dtype: torch.dtype, amax_epsilon: float = 0.0,
                    power_2_scale: bool = False, *, rowwise: bool, columnwise: bool,
                    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                    amax: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """(data [M, K] or None, data_t [K, M] or None, scale_inv [1]) of per-tensor FP8 scaling,
    as the quantizer makes them, in fusible torch ops (the scale in one small op). `scales`:
    (scale, scale_inv) to cast with (delayed scaling: forward's, carried by the forward op; no
    amax is taken or recorded), else current scaling's from this tensor's amax: `amax` where
    the graph took it already (max|x| of the same x), else taken here.

    The reference rounds on the format's grid in fp32 arithmetic, then encodes; torch's
    conversion to an FP8 dtype rounds to nearest even itself, so after clamping to +-max
    (saturation; NaN passes through) one conversion gives the same bytes. A maximum is exact
    however it is computed; the scale comes from per_tensor_scales."""
    fmt = numerics.fp8_format(fp8_dtype)
    if scales is not None:
        scale, scale_inv = scales
    else:
        amax = tensor_maximum(x2d) if amax is None else amax.reshape(())
        scale, scale_inv = per_tensor_scales(amax, fp8_dtype == torch.float8_e5m2, amax_epsilon,
                                             power_2_scale)
    data = torch.clamp(x2d.float() * scale, -fmt.max_value, fmt.max_value).to(fp8_dtype)
    return (data if rowwise else None, data.t().contiguous() if columnwise else None,
            scale_inv.reshape(1))


def per_tensor_copy(x2d: torch.Tensor, quantizer: Float8CurrentScalingQuantizer | Float8Quantizer,
                    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                    amax: torch.Tensor | None = None) -> Float8Storage:
    """The columnwise copy of per-tensor scaling as the quantizer makes it (data_transpose
    [K, M] and scale_inv), by per_tensor_cast: with `scales` under delayed scaling, with
    forward's max|x| where its graph took one (saves backward a pass over the recomputed
    input)."""
    _, data_t, scale_inv = per_tensor_cast(
        x2d, quantizer.fp8_dtype, quantizer.amax_epsilon if scales is None else 0.0,
        quantizer.power_2_scale if scales is None else False, rowwise=False, columnwise=True,
        scales=scales, amax=amax)
    return Float8Storage(shape=x2d.shape, dtype=x2d.dtype, quantizer=quantizer, data=None,
                         data_transpose=data_t, scale_inv=scale_inv,
                         fp8_dtype=quantizer.fp8_dtype)


def recasts(quantizers: list[Quantizer]) -> bool:
    """Whether the compiled backward makes this GEMM input's copy itself (per_tensor_copy): one
    GEMM of per-tensor scaling, current (without an amax reduction group) or delayed. Other
    inputs keep their copies under torch.compile: made in backward by their quantizers' torch
    reference path, they would be slow code and, on the GPU, not the kernels' bytes for every
    format."""
    if len(quantizers) != 1:
        return False
    kind = type(quantizers[0])
    return kind is Float8Quantizer or (kind is Float8CurrentScalingQuantizer
                                       and quantizers[0].amax_reduction_group is None)


def input_copy_buffers(x: torch.Tensor, quantizers: list[Quantizer],
                       scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                       amax: torch.Tensor | None = None) -> list[torch.Tensor]:
    """The buffers of the input copy that a forward keeping it would have handed to backward,
    in that order (keep_for_backward's); for quantizers that `recasts`, with forward's scales
    under delayed scaling, and with forward's max|x| under current scaling where its graph
    took one (lean_ops.compiled_amax)."""
    x_qs = [per_tensor_copy(x.reshape(-1, x.shape[-1]), quantizers[0], scales, amax)]
    kept = keep_for_backward(x_qs, [], need_dgrad=False, need_wgrad=True)
    return [t.contiguous() for t in kept.tensors if t is not None]
