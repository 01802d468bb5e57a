"""The byte transpose (kernels/transpose.py) equals torch's `x.t().contiguous()` bit for bit,
the nibble transpose equals numerics' unpack-transpose-pack, and per-tensor FP8, 2D block FP8
and 2D NVFP4 storages derive their other copy with them: full and partial 64 x 64 tiles, one
row or column, an empty matrix, both FP8 formats and uint8. Runs on CUDA, or on CPU tensors
under TRITON_INTERPRET=1 (small shapes); skipped otherwise.
"""

from __future__ import annotations

import pytest
import torch

from minifloat import kernels

DEVICE = kernels.kernel_device()
if DEVICE is None:
    pytest.skip(
        "needs CUDA with Triton, or TRITON_INTERPRET=1 with Triton", allow_module_level=True
    )

import minifloat as mf  # noqa: E402
from minifloat.kernels.transpose import transpose_bytes  # noqa: E402

pytestmark = pytest.mark.gpu

SHAPES = [(64, 64), (128, 192), (65, 130), (1, 100), (100, 1), (3, 5), (0, 16)]
if DEVICE.type == "cuda":
    SHAPES += [(2048, 6144), (8192, 2048), (1000, 4099)]


def random_bytes(shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(shape[0] * 7919 + shape[1])
    values = torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator)
    return values.view(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8])
@pytest.mark.parametrize("shape", SHAPES)
def test_equals_torch_transpose(shape, dtype):
    x = random_bytes(shape, dtype)
    out = transpose_bytes(x)
    expected = x.t().contiguous()
    assert out.shape == expected.shape and out.dtype == dtype and out.is_contiguous()
    assert torch.equal(out.view(torch.uint8), expected.view(torch.uint8))


def test_refuses_what_it_cannot_transpose():
    with pytest.raises(ValueError, match="contiguous 2D tensor of one-byte elements"):
        transpose_bytes(torch.zeros(4, 4, dtype=torch.bfloat16, device=DEVICE))
    with pytest.raises(ValueError, match="contiguous 2D tensor"):
        transpose_bytes(random_bytes((8, 4), torch.uint8).t())


STORAGES = {  # quantizer, (rowwise field, columnwise field) of the bytes
    "current": (lambda: mf.Float8CurrentScalingQuantizer(torch.float8_e4m3fn),
                ("data", "data_transpose")),
    "block-2d": (lambda: mf.Float8BlockQuantizer(2), ("rowwise_data", "columnwise_data")),
    "nvfp4-2d": (lambda: mf.NVFP4Quantizer(with_2d_quantization=True),
                 ("rowwise_data", "columnwise_data")),
}


@pytest.mark.parametrize("name", list(STORAGES))
@pytest.mark.parametrize("shape", [(128, 256), (256, 128)])
def test_a_storage_derives_its_other_copy_through_it(name, shape):
    """A rowwise-only storage asked for its columnwise copy, and the reverse, hold the bytes
    of quantizing both copies at once."""
    make, (rowwise_field, columnwise_field) = STORAGES[name]
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    quantizer = make()
    both = quantizer(x).quantized_storage
    quantizer.set_usage(rowwise=True, columnwise=False)
    rowwise_only = quantizer(x).quantized_storage
    rowwise_only.update_usage(columnwise=True)
    assert torch.equal(getattr(rowwise_only, columnwise_field).view(torch.uint8),
                       getattr(both, columnwise_field).view(torch.uint8))
    quantizer.set_usage(rowwise=False, columnwise=True)
    columnwise_only = quantizer(x).quantized_storage
    columnwise_only.update_usage(rowwise=True)
    assert torch.equal(getattr(columnwise_only, rowwise_field).view(torch.uint8),
                       getattr(both, rowwise_field).view(torch.uint8))


@pytest.mark.parametrize("shape", [(64, 128), (130, 96), (2, 2), (16, 34), (0, 8)]
                         + ([(8192, 2048), (2048, 6144)] if DEVICE.type == "cuda" else []))
def test_nibbles_equal_the_reference_transpose(shape):
    from minifloat import numerics
    from minifloat.kernels.transpose import transpose_nibbles

    rows, cols = shape
    packed = random_bytes((rows, cols // 2), torch.uint8)
    expected = (numerics.pack_nibbles(numerics.unpack_nibbles(packed).t().contiguous())
                if rows else packed.new_empty((cols, 0)))  # the reference cannot unpack none
    assert torch.equal(transpose_nibbles(packed), expected)


def test_nibbles_refuse_odd_rows():
    from minifloat.kernels.transpose import transpose_nibbles

    with pytest.raises(ValueError, match="rows cannot pack"):
        transpose_nibbles(random_bytes((3, 4), torch.uint8))
