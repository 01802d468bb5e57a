"""QuantizedTensor: the torch.Tensor wrapper (nominal metadata, detach/clone/copy_, device and
dtype moves, views, high-precision fallback for other ops, use as a module parameter)."""

from __future__ import annotations

import io

import pytest
import torch

import minifloat as mf

from .cases import (
    ALL,
    E4M3,
    E5M2,
    FAMILIES,
    as_bytes,
    assert_same_bytes,
    check_buffers,
    family_input,
    torch_fp8,
)

# --------------------------------------------------------------------------------------------
# inputs every family represents exactly (hand-derived)
# --------------------------------------------------------------------------------------------


def _diagonal(shape, period):
    i = torch.arange(shape[0])[:, None]
    j = torch.arange(shape[1])[None, :]
    return (i % period) == (j % period)


def exact_input(name: str, shape=None, seed=0) -> torch.Tensor:
    """Values each family reproduces bit for bit (dequantize(quantize(x)) == x).

    - per-tensor E4M3/E5M2 current scaling: values on the element grid with amax = fp8_max, so
      scale = 1; delayed scaling (scale 32): E4M3 grid values divided by 32.
    - block FP8: E4M3 grid values with 448 in every 1x128 run, 128x1 run and tile (a
      diagonal), so every power-of-two scale is 1.
    - MXFP8: grid values with 256 (E4M3) / 32768 (E5M2) on a diagonal of period 32: every
      block amax * fp32(1/max) is in (0.5, 1], so every scale is 2^0.
    - NVFP4: E2M1 grid values times 448 with 6 * 448 = 2688 on a diagonal of period 16: A = 2688
      gives S_enc = 1, every block scale is 448 and elements land on the grid.
    """
    family = FAMILIES[name]
    shape = shape or family.shape
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(shape, generator=gen)
    if name in ("delayed_e4m3", "current_e4m3"):
        x = torch_fp8(base * 100, E4M3).float()
        x.view(-1)[0] = 448.0
        return x / 32 if name == "delayed_e4m3" else x
    if name == "current_e5m2":
        x = torch_fp8(base * 5000, E5M2).float()
        x.view(-1)[0] = -57344.0
        return x
    if name == "identity":
        return base
    m, k = shape[0], shape[-1]
    if name.startswith("block"):
        x = torch_fp8(base * 100, E4M3).float()
        return torch.where(_diagonal((m, k), 128), torch.full_like(x, 448.0), x)
    if name == "mxfp8":
        x = torch_fp8(base * 50, E4M3).float().clamp(-256, 256)
        return torch.where(_diagonal((m, k), 32), torch.full_like(x, 256.0), x)
    if name == "mxfp8_e5m2":
        x = torch_fp8(base * 5000, E5M2).float().clamp(-32768, 32768)
        return torch.where(_diagonal((m, k), 32), torch.full_like(x, -32768.0), x)
    if name.startswith("nvfp4"):
        grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.5, -1.0, -3.0, -6.0])
        picks = torch.randint(0, len(grid), shape, generator=gen)
        x = grid[picks] * 448.0
        return torch.where(_diagonal((m, k), 16), torch.full_like(x, 2688.0), x)
    raise AssertionError(name)


@pytest.mark.parametrize("usage", [(True, False), (False, True)], ids=["rowwise", "columnwise"])
@pytest.mark.parametrize("name", ALL)
def test_exact_inputs_round_trip_bit_for_bit(name, usage):
    x = exact_input(name)
    values = FAMILIES[name].quantize(x, *usage).dequantize()
    if name == "nvfp4_rht" and usage == (False, True):
        # the transform moves the values off the grid: close, not exact
        assert not torch.equal(values, x)
        assert ((values - x).norm() / x.norm()).item() < 0.12
        return
    assert torch.equal(values.view(torch.int32), x.view(torch.int32))


# --------------------------------------------------------------------------------------------
# nominal metadata, detach, clone
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ALL)
def test_nominal_metadata(name, dtype):
    family = FAMILIES[name]
    x = family_input(family, family.leading_shape, dtype=dtype)
    qt = family.quantize(x)
    assert isinstance(qt, torch.Tensor) and isinstance(qt, mf.QuantizedTensor)
    assert qt.dtype == dtype and qt.shape == x.shape and qt.device == x.device
    assert qt.dim() == x.dim() and qt.numel() == x.numel() and qt.size(-1) == x.shape[-1]
    assert qt.requires_grad is False and qt.is_floating_point()
    assert "QuantizedTensor" in repr(qt)


def _pointers(storage):
    return {
        n: getattr(storage, n).data_ptr()
        for n in storage.tensor_fields()
        if getattr(storage, n) is not None
    }


@pytest.mark.parametrize("name", ALL)
def test_detach_shares_buffers(name):
    family = FAMILIES[name]
    qt = family.quantize(family_input(family))
    d = qt.detach()
    assert isinstance(d, mf.QuantizedTensor) and d is not qt
    assert d.quantized_storage is not qt.quantized_storage
    assert _pointers(d.quantized_storage) == _pointers(qt.quantized_storage)
    assert d.shape == qt.shape and d.dtype == qt.dtype


@pytest.mark.parametrize("name", ALL)
def test_clone_has_new_buffers_with_the_same_bytes(name):
    family = FAMILIES[name]
    qt = family.quantize(family_input(family))
    c = qt.clone()
    assert isinstance(c, mf.QuantizedTensor)
    src, dst = qt.quantized_storage, c.quantized_storage
    for n, ptr in _pointers(src).items():
        assert getattr(dst, n).data_ptr() != ptr, n
        assert_same_bytes(getattr(dst, n), getattr(src, n), n)
    assert torch.equal(c.dequantize(), qt.dequantize())


# --------------------------------------------------------------------------------------------
# copy_
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
def test_copy_between_quantized_tensors_of_one_family(name):
    family = FAMILIES[name]
    src = family.quantize(family_input(family, seed=1), seed=1)
    dst = family.quantize(family_input(family, seed=2) * 3, seed=2)
    pointers = _pointers(dst.quantized_storage)
    returned = dst.copy_(src)
    assert returned is dst
    assert _pointers(dst.quantized_storage) == pointers
    for n in pointers:
        assert_same_bytes(getattr(dst.quantized_storage, n), getattr(src.quantized_storage, n), n)


@pytest.mark.parametrize("name", ALL)
def test_copy_from_a_plain_tensor_requantizes(name):
    family = FAMILIES[name]
    dst = family.quantize(family_input(family, seed=3))
    pointers = _pointers(dst.quantized_storage)
    x = family_input(family, seed=4) * 0.3
    if family.stochastic:
        torch.manual_seed(5)
    with torch.no_grad():
        dst.copy_(x)
    assert _pointers(dst.quantized_storage) == pointers
    check_buffers(dst.quantized_storage, family, x, True, True, family.expected(x, seed=5))


@pytest.mark.parametrize("name", ["current_e4m3", "mxfp8", "nvfp4_2d", "block_1d"])
def test_copy_from_a_broadcast_row(name):
    family = FAMILIES[name]
    dst = family.quantize(family_input(family))
    row = torch.randn(family.shape[-1])
    dst.copy_(row)
    full = row.expand(family.shape).contiguous()
    check_buffers(dst.quantized_storage, family, full, True, True, family.expected(full))


@pytest.mark.parametrize(
    "src_name, dst_name",
    [
        ("mxfp8", "nvfp4_2d"),  # another storage class
        ("nvfp4", "nvfp4_2d"),  # one class, 1D vs 2D
        ("nvfp4_rht", "nvfp4"),  # one class, RHT vs none
        ("block_1d", "block_2d"),
        ("block_2d", "block_1d"),
        ("current_e5m2", "current_e4m3"),
        ("mxfp8_e5m2", "mxfp8"),
        ("identity", "current_e4m3"),
    ],
)
def test_copy_from_another_format_requantizes_its_values(src_name, dst_name):
    """Bytes only copy over between identical formats; otherwise the destination requantizes
    the source's values with its own quantizer (and keeps its buffers)."""
    src_family, dst_family = FAMILIES[src_name], FAMILIES[dst_name]
    x = family_input(src_family, seed=6)
    src = src_family.quantize(x)
    dst = dst_family.quantize(torch.zeros_like(x))
    pointers = _pointers(dst.quantized_storage)
    dst.copy_(src)
    assert _pointers(dst.quantized_storage) == pointers
    source_values = src.dequantize()
    expected = dst_family.expected(source_values)
    check_buffers(dst.quantized_storage, dst_family, x, True, True, expected)
    for n in dst.quantized_storage.metadata_fields:
        assert getattr(dst.quantized_storage, n) == getattr(
            dst_family.quantize(x, internal=True), n
        ), n


@pytest.mark.parametrize(
    "make_pair",
    [
        pytest.param(lambda: (mf.Float8CurrentScalingQuantizer(E5M2),
                              mf.Float8CurrentScalingQuantizer(E4M3)), id="per_tensor"),
        pytest.param(lambda: (mf.MXFP8Quantizer(E5M2), mf.MXFP8Quantizer(E4M3)), id="mxfp8"),
    ],
)
def test_copy_between_fp8_element_dtypes_keeps_the_values(make_pair):
    """Regression: same storage class, different element dtype once copied E5M2 codes into the
    E4M3 buffer (value-converted, clipping at 448) and relabelled it E5M2. It must requantize."""
    src_q, dst_q = make_pair()
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(7))
    src, dst = src_q(x), dst_q(torch.zeros(64, 64))
    dst.copy_(src)
    storage = dst.quantized_storage
    for n in storage.tensor_fields():
        buffer = getattr(storage, n)
        if buffer is not None and buffer.dtype in (E4M3, E5M2):
            assert buffer.dtype == storage.fp8_dtype, f"{n} is {buffer.dtype}"
    values = dst.dequantize()
    assert not torch.isnan(values).any()
    # requantized into E4M3: within E4M3's error of the source values
    torch.testing.assert_close(values, src.dequantize(), rtol=2**-4, atol=2**-4)


@pytest.mark.parametrize("name", ALL)
def test_copy_into_a_plain_tensor_dequantizes(name):
    family = FAMILIES[name]
    x = exact_input(name)
    qt = family.quantize(x)
    target = torch.empty(x.shape)
    target.copy_(qt)
    assert torch.equal(target, x)
    target_bf16 = torch.empty(x.shape, dtype=torch.bfloat16)
    target_bf16.copy_(qt)
    assert torch.equal(target_bf16, x.to(torch.bfloat16))


# --------------------------------------------------------------------------------------------
# device and dtype moves
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
def test_to_same_device_stays_quantized(name):
    family = FAMILIES[name]
    qt = family.quantize(family_input(family))
    moved = qt.to("cpu")
    assert isinstance(moved, mf.QuantizedTensor)
    copied = qt.to("cpu", copy=True)
    assert isinstance(copied, mf.QuantizedTensor)
    for n, ptr in _pointers(qt.quantized_storage).items():
        assert getattr(copied.quantized_storage, n).data_ptr() != ptr
        assert_same_bytes(getattr(copied.quantized_storage, n), getattr(qt.quantized_storage, n))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("name", ALL)
def test_to_another_dtype_returns_a_plain_dequantized_tensor(name, dtype):
    x = exact_input(name)
    qt = FAMILIES[name].quantize(x)
    for out in (qt.to(dtype), torch.ops.aten._to_copy(qt, dtype=dtype), qt.to("cpu", dtype)):
        assert type(out) is torch.Tensor
        assert out.dtype == dtype and out.shape == x.shape
        assert torch.equal(out, x.to(dtype))


# --------------------------------------------------------------------------------------------
# views
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
def test_view_and_reshape_keeping_the_last_dim_stay_quantized(name):
    family = FAMILIES[name]
    x = family_input(family, family.leading_shape, seed=8)
    qt = family.quantize(x)
    expected = qt.dequantize()
    k = x.shape[-1]
    m = x.numel() // k
    for new_shape, result in (
        ((m, k), qt.view(m, k)),
        ((m, k), qt.view(-1, k)),
        ((m, k), qt.reshape(m, k)),
        ((1, m, k), qt.reshape(1, -1, k)),
        ((m // 2, 2, k), qt.view(m // 2, 2, k)),
    ):
        assert isinstance(result, mf.QuantizedTensor), new_shape
        assert result.shape == torch.Size(new_shape)
        assert _pointers(result.quantized_storage) == _pointers(qt.quantized_storage)
        assert torch.equal(result.dequantize(), expected.reshape(new_shape))
    assert qt.shape == x.shape  # the original keeps its shape


@pytest.mark.parametrize("name", ALL)
def test_view_changing_the_last_dim_falls_back_to_high_precision(name):
    family = FAMILIES[name]
    x = exact_input(name, seed=9)
    qt = family.quantize(x)
    for shape in ((-1, x.shape[-1] // 2), (x.numel(),), (x.shape[-1], -1)):
        out = qt.view(*shape)
        assert type(out) is torch.Tensor
        assert torch.equal(out, x.view(*shape))
        out = qt.reshape(*shape)
        assert type(out) is torch.Tensor and torch.equal(out, x.reshape(*shape))


# --------------------------------------------------------------------------------------------
# other ops run in high precision
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
def test_other_ops_dequantize(name):
    family = FAMILIES[name]
    x = exact_input(name, seed=10)
    qt = family.quantize(x)
    w = torch.randn(x.shape[-1], 8)
    y = torch.randn(5, x.shape[-1])
    results = {
        "add": (qt + 1.5, x + 1.5),
        "radd": (2.0 + qt, 2.0 + x),
        "mul_tensor": (qt * x, x * x),
        "matmul": (qt @ w, x @ w),
        "linear": (torch.nn.functional.linear(y, qt), torch.nn.functional.linear(y, x)),
        "sum": (qt.sum(), x.sum()),
        "sum_dim": (qt.sum(dim=0), x.sum(dim=0)),
        "neg": (-qt, -x),
        "index": (qt[1], x[1]),
        "transpose": (qt.t().contiguous(), x.t().contiguous()),
    }
    for op, (got, want) in results.items():
        assert type(got) is torch.Tensor, op
        assert got.dtype == want.dtype and got.shape == want.shape, op
        assert torch.equal(got, want), op


def test_other_ops_on_inexact_values_use_the_dequantized_values():
    x = torch.randn(64, 128)
    qt = mf.NVFP4Quantizer()(x)
    d = qt.dequantize()
    assert not torch.equal(d, x)
    w = torch.randn(128, 4)
    assert torch.equal(qt @ w, d @ w)
    assert torch.equal(qt + x, d + x)


# --------------------------------------------------------------------------------------------
# as a parameter in a state_dict
# --------------------------------------------------------------------------------------------


class _Holder(torch.nn.Module):
    def __init__(self, weight):
        super().__init__()
        self.weight = torch.nn.Parameter(weight)


@pytest.mark.parametrize("name", ALL)
def test_parameter_in_state_dict(name):
    family = FAMILIES[name]
    x = exact_input(name, seed=11)
    module = _Holder(family.quantize(x))
    assert isinstance(module.weight, mf.QuantizedTensor)
    assert module.weight.requires_grad
    state = module.state_dict()
    assert isinstance(state["weight"], mf.QuantizedTensor)

    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert isinstance(loaded["weight"], mf.QuantizedTensor)

    # into a module whose parameter is quantized the same way: bytes are copied in place
    other = _Holder(family.quantize(torch.zeros_like(x)))
    pointers = _pointers(other.weight.quantized_storage)
    other.load_state_dict(loaded)
    assert isinstance(other.weight, mf.QuantizedTensor)
    assert _pointers(other.weight.quantized_storage) == pointers
    for n in pointers:
        assert_same_bytes(
            getattr(other.weight.quantized_storage, n),
            getattr(module.weight.quantized_storage, n),
            n,
        )

    # into a plain module: the values arrive dequantized
    plain = _Holder(torch.zeros_like(x))
    plain.load_state_dict(loaded)
    assert type(plain.weight.data) is torch.Tensor
    assert torch.equal(plain.weight.data, x)


def test_parameter_forward_and_backward_run_in_high_precision():
    x = exact_input("mxfp8", seed=12)
    weight = torch.nn.Parameter(mf.MXFP8Quantizer()(x))
    inputs = torch.randn(4, x.shape[-1], requires_grad=True)
    out = torch.nn.functional.linear(inputs, weight)
    assert torch.equal(out, torch.nn.functional.linear(inputs.detach(), x))
    out.sum().backward()
    assert torch.equal(inputs.grad, x.sum(0).expand(4, -1))
    assert as_bytes(weight.quantized_storage.rowwise_data).numel() == x.numel()
