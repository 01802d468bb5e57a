"""The numerics reference: pure torch, device-agnostic, bit-exact spec of every format.

This package imports nothing else from minifloat. Kernels must reproduce its bytes; quantizers use
it wherever no kernel applies (CPU tensors, or formats without a fast path).
"""

from .block_fp8 import (
    block_scale_inv,
    dequantize_block_1d,
    dequantize_block_2d,
    quantize_block_1d,
    quantize_block_1d_columnwise,
    quantize_block_2d,
    transpose_block_2d,
)
from .formats import (
    E2M1,
    E4M3,
    E5M2,
    FLT_MAX,
    UE4M3,
    ElementFormat,
    cast_to_e2m1,
    cast_to_fp8,
    clear_mantissa,
    decode_e2m1,
    e2m1_to_float,
    e8m0_to_float,
    encode_e2m1,
    exp2_exact,
    fp8_format,
    pack_nibbles,
    round_to_format,
    unpack_nibbles,
)
from .gemm import emulated_gemm_tn
from .hadamard import (
    RHT_SIGNS,
    inverse_random_hadamard_transform,
    random_hadamard_transform,
    sylvester_hadamard,
)
from .mxfp8 import dequantize_mxfp8, e8m0_exponent, quantize_mxfp8
from .nvfp4 import (
    dequantize_nvfp4,
    dequantize_nvfp4_blocks,
    global_decode_scale,
    global_encode_scale,
    quantize_nvfp4,
    transpose_nvfp4_2d,
)
from .per_tensor import (
    compute_amax,
    delayed_scaling_update,
    dequantize_per_tensor,
    quantize_current_scaling,
    quantize_with_scale,
    scale_from_amax,
)

__all__ = [
    "E2M1", "E4M3", "E5M2", "FLT_MAX", "RHT_SIGNS", "UE4M3", "ElementFormat",
    "cast_to_e2m1", "cast_to_fp8", "clear_mantissa", "compute_amax", "decode_e2m1",
    "block_scale_inv", "delayed_scaling_update", "dequantize_block_1d", "dequantize_block_2d",
    "dequantize_mxfp8",
    "dequantize_nvfp4", "dequantize_nvfp4_blocks", "dequantize_per_tensor", "e2m1_to_float",
    "e8m0_exponent", "e8m0_to_float", "emulated_gemm_tn", "encode_e2m1", "exp2_exact",
    "fp8_format", "global_decode_scale", "global_encode_scale",
    "inverse_random_hadamard_transform", "pack_nibbles", "quantize_block_1d",
    "quantize_block_1d_columnwise", "quantize_block_2d", "quantize_current_scaling",
    "quantize_mxfp8", "quantize_nvfp4", "quantize_with_scale", "random_hadamard_transform",
    "round_to_format", "scale_from_amax", "sylvester_hadamard", "transpose_block_2d",
    "transpose_nvfp4_2d", "unpack_nibbles",
]
