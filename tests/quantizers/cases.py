"""Shared cases for the quantizer tests: the family table, independent plain-torch
references written from NUMERICS.md, and byte-comparison helpers."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

import minifloat as mf
from minifloat import numerics

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
DELAYED_SCALE = 32.0  # gaussian inputs (|x| < ~5) times 32 stay well inside E4M3's 448

REQUANTIZE_MESSAGE = re.compile(r"re-?quantiz|quantize again", re.IGNORECASE)


# --------------------------------------------------------------------------------------------
# byte comparison
# --------------------------------------------------------------------------------------------


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """Raw bytes, last dim widened by the element size. A fresh row-major copy first: a
    "contiguous" tensor may still have a non-unit stride on a size-1 last dim, which view()
    across element sizes refuses."""
    dense = torch.empty_like(t, memory_format=torch.contiguous_format).copy_(t)
    return dense.view(torch.uint8)


def assert_same_bytes(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    assert actual is not None, f"{what}: buffer is None"
    assert tuple(actual.shape) == tuple(expected.shape), (
        f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    )
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    a, e = as_bytes(actual), as_bytes(expected)
    mismatch = (a != e).sum().item()
    assert mismatch == 0, f"{what}: {mismatch} of {a.numel()} bytes differ"


# --------------------------------------------------------------------------------------------
# independent plain-torch references (no minifloat.numerics inside)
# --------------------------------------------------------------------------------------------


def torch_fp8(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Saturating RNE cast through torch's own conversion of clamped fp32 values."""
    limit = torch.finfo(dtype).max
    return v.float().clamp(-limit, limit).to(dtype)


def pow2_floor(v: torch.Tensor) -> torch.Tensor:
    """Largest power of two <= v (v > 0, finite), through frexp: v = m 2^e, 0.5 <= m < 1."""
    _, e = torch.frexp(v)
    return torch.ldexp(torch.ones_like(v), e - 1)


def _tile_absmax(x2d: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    m, k = x2d.shape
    pm, pk = -(-m // rows) * rows, -(-k // cols) * cols
    padded = torch.zeros(pm, pk, dtype=torch.float32)
    padded[:m, :k] = x2d.float().abs()
    return padded.reshape(pm // rows, rows, pk // cols, cols).amax(dim=(1, 3))


def _spread(values: torch.Tensor, rows: int, cols: int, shape) -> torch.Tensor:
    return values.repeat_interleave(rows, 0).repeat_interleave(cols, 1)[: shape[0], : shape[1]]


def plain_per_tensor(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None = None):
    """(data [M, K], scale_inv) with scale = fp8_max / amax unless a scale is given."""
    x2d = x.reshape(-1, x.shape[-1]).float()
    if scale is None:
        scale = torch.tensor(torch.finfo(dtype).max, dtype=torch.float32) / x2d.abs().max()
    scale = scale.float().reshape(())
    return torch_fp8(x2d * scale, dtype), (1.0 / scale).reshape(1)


def plain_block_fp8(x2d: torch.Tensor, rows: int, cols: int = 128):
    """Block FP8 (power-of-2 scales, E4M3) of a 2D tensor with rows x cols tiles; no zero tiles."""
    amax = _tile_absmax(x2d, rows, cols)
    scale = pow2_floor(torch.tensor(448.0) / amax)
    data = torch_fp8(x2d.float() * _spread(scale, rows, cols, x2d.shape), E4M3)
    return data, 1.0 / scale


def plain_mxfp8(x2d: torch.Tensor, rows: int, cols: int, dtype=E4M3):
    """MXFP8 of a 2D tensor in rows x cols blocks: (data, biased E8M0 exponents as uint8)."""
    amax = _tile_absmax(x2d, rows, cols)
    v = amax * torch.tensor(1.0 / torch.finfo(dtype).max, dtype=torch.float32)
    mant, e = torch.frexp(v)  # v = mant 2^e; the smallest power of two >= v is 2^(e-1) or 2^e
    unbiased = torch.where(mant == 0.5, e - 1, e)
    element_scale = torch.ldexp(torch.ones_like(v), -unbiased)
    data = torch_fp8(x2d.float() * _spread(element_scale, rows, cols, x2d.shape), dtype)
    return data, (unbiased + 127).to(torch.uint8)


def plain_e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """E2M1 RNE with saturation through explicit midpoints (ties go to the even code)."""
    a = v.abs()
    code = torch.full(v.shape, 7, dtype=torch.uint8)
    # from the top down so that the lowest matching threshold wins
    for threshold, value, inclusive in (
        (5.0, 6, True), (3.5, 5, False), (2.5, 4, True), (1.75, 3, False),
        (1.25, 2, True), (0.75, 1, False), (0.25, 0, True),
    ):
        hit = a <= threshold if inclusive else a < threshold
        code = torch.where(hit, torch.full_like(code, value), code)
    return code | (torch.signbit(v).to(torch.uint8) << 3)


def plain_nvfp4(x2d: torch.Tensor, amax: torch.Tensor | None = None, tile_rows: int = 1):
    """NVFP4 of a 2D tensor along its last dim: (packed data, UE4M3 scale per row/16 cols, A)."""
    x2d = x2d.float()
    a = x2d.abs().max() if amax is None else amax.float().reshape(())
    s_enc = torch.tensor(2688.0) / a
    s_dec = 1.0 / s_enc
    block_amax = _tile_absmax(x2d, tile_rows, 16)
    s_b = torch_fp8(block_amax * (s_enc * torch.tensor(1.0 / 6.0, dtype=torch.float32)), E4M3)
    element_scale = 1.0 / (s_b.float() * s_dec)
    codes = plain_e2m1_codes(x2d * _spread(element_scale, tile_rows, 16, x2d.shape))
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    scale = s_b.repeat_interleave(tile_rows, 0)[: x2d.shape[0]]
    return packed, scale.contiguous(), a.reshape(1)


E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def plain_e2m1_decode(packed: torch.Tensor) -> torch.Tensor:
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(packed.shape[0], -1)
    magnitude = E2M1_GRID[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -magnitude, magnitude)


# --------------------------------------------------------------------------------------------
# the family table
# --------------------------------------------------------------------------------------------


def _m_k(x: torch.Tensor) -> tuple[int, int]:
    return x.numel() // x.shape[-1], x.shape[-1]


def _ref_per_tensor(dtype, delayed):
    def reference(x, rowwise, columnwise):
        if delayed:
            data, scale_inv = numerics.quantize_with_scale(
                x, torch.tensor([DELAYED_SCALE]), dtype
            )
        else:
            data, scale_inv = numerics.quantize_current_scaling(x, dtype)
        data = data.reshape(-1, x.shape[-1])
        out = {"scale_inv": scale_inv.reshape(1)}
        if rowwise:
            out["data"] = data
        if columnwise:
            out["data_transpose"] = data.t().contiguous()
        return out

    return reference


def _ref_block(dim):
    def reference(x, rowwise, columnwise):
        out = {}
        if dim == 2:
            data, scale_inv = numerics.quantize_block_2d(x)
            if rowwise:
                out["rowwise_data"], out["rowwise_scale_inv"] = data, scale_inv
            if columnwise:
                out["columnwise_data"], out["columnwise_scale_inv"] = (
                    numerics.transpose_block_2d(data, scale_inv)
                )
        else:
            if rowwise:
                out["rowwise_data"], out["rowwise_scale_inv"] = numerics.quantize_block_1d(x)
            if columnwise:
                out["columnwise_data"], out["columnwise_scale_inv"] = (
                    numerics.quantize_block_1d_columnwise(x)
                )
        return out

    return reference


def _ref_mxfp8(dtype):
    def reference(x, rowwise, columnwise):
        out = {}
        # each direction from its own call: the joint quantizer call must not couple them
        if rowwise:
            out.update(numerics.quantize_mxfp8(x, rowwise=True, columnwise=False, dtype=dtype))
        if columnwise:
            out.update(numerics.quantize_mxfp8(x, rowwise=False, columnwise=True, dtype=dtype))
        return out

    return reference


def _ref_nvfp4(**options):
    def reference(x, rowwise, columnwise):
        if options.get("stochastic_rounding"):
            # one joint call: both directions draw from the same generator in this order
            return numerics.quantize_nvfp4(x, rowwise=rowwise, columnwise=columnwise, **options)
        out = {}
        if rowwise:
            out.update(numerics.quantize_nvfp4(x, rowwise=True, columnwise=False, **options))
        if columnwise:
            out.update(numerics.quantize_nvfp4(x, rowwise=False, columnwise=True, **options))
        return out

    return reference


def _ref_identity(x, rowwise, columnwise):
    x2d = x.reshape(-1, x.shape[-1])
    out = {}
    if rowwise:
        out["rowwise_data"] = x2d
    if columnwise:
        out["columnwise_data"] = x2d
    return out


def _cdiv(a, b):
    return -(-a // b)


def _shapes_per_tensor(dtype):
    def shapes(m, k, in_dtype):
        return {
            "data": ((m, k), dtype),
            "data_transpose": ((k, m), dtype),
            "scale_inv": ((1,), torch.float32),
        }

    return shapes


def _shapes_block(dim):
    def shapes(m, k, in_dtype):
        if dim == 1:
            row_scale, col_scale = (m, _cdiv(k, 128)), (k, _cdiv(m, 128))
        else:
            row_scale, col_scale = (_cdiv(m, 128), _cdiv(k, 128)), (_cdiv(k, 128), _cdiv(m, 128))
        return {
            "rowwise_data": ((m, k), E4M3),
            "rowwise_scale_inv": (row_scale, torch.float32),
            "columnwise_data": ((k, m), E4M3),
            "columnwise_scale_inv": (col_scale, torch.float32),
        }

    return shapes


def _shapes_mxfp8(dtype):
    def shapes(m, k, in_dtype):
        return {
            "rowwise_data": ((m, k), dtype),
            "rowwise_scale": ((m, k // 32), torch.uint8),
            "columnwise_data": ((m, k), dtype),
            "columnwise_scale": ((m // 32, k), torch.uint8),
        }

    return shapes


def _shapes_nvfp4(m, k, in_dtype):
    return {
        "rowwise_data": ((m, k // 2), torch.uint8),
        "rowwise_scale": ((m, k // 16), E4M3),
        "amax_rowwise": ((1,), torch.float32),
        "columnwise_data": ((k, m // 2), torch.uint8),
        "columnwise_scale": ((k, m // 16), E4M3),
        "amax_columnwise": ((1,), torch.float32),
    }


def _shapes_identity(m, k, in_dtype):
    return {"rowwise_data": ((m, k), in_dtype), "columnwise_data": ((m, k), in_dtype)}


@dataclass
class Family:
    name: str
    make_quantizer: Callable[..., mf.Quantizer]  # make_quantizer(rowwise=, columnwise=, internal=)
    reference: Callable  # reference(x, rowwise, columnwise) -> {field: tensor}
    storage_class: type
    row_fields: tuple[str, ...]
    col_fields: tuple[str, ...]
    shared_fields: tuple[str, ...]
    expected_shapes: Callable  # (M, K, input dtype) -> {field: (shape, dtype)}
    shape: tuple[int, ...] = (64, 128)
    leading_shape: tuple[int, ...] = (2, 16, 64)
    derivable: bool = False  # NUMERICS.md §9: one copy derives the other exactly
    same_values: bool = False  # both copies dequantize to identical values
    stochastic: bool = False
    block: int | None = None  # M and K must be multiples of this
    tags: set = field(default_factory=set)

    def quantizer(self, rowwise=True, columnwise=True, internal=False) -> mf.Quantizer:
        return self.make_quantizer(rowwise=rowwise, columnwise=columnwise, internal=internal)

    def quantize(self, x, rowwise=True, columnwise=True, internal=False, seed=1234):
        if self.stochastic:
            torch.manual_seed(seed)
        return self.quantizer(rowwise, columnwise, internal)(x)

    def expected(self, x, rowwise=True, columnwise=True, seed=1234):
        if self.stochastic:
            torch.manual_seed(seed)
        return self.reference(x, rowwise, columnwise)


def _delayed(dtype):
    def make(**usage):
        return mf.Float8Quantizer(
            torch.tensor([DELAYED_SCALE]), torch.zeros(1), dtype, **usage
        )

    return make


_PT = dict(
    storage_class=mf.Float8Storage,
    row_fields=("data",),
    col_fields=("data_transpose",),
    shared_fields=("scale_inv",),
    leading_shape=(2, 3, 64),
    derivable=True,
    same_values=True,
)
_BLOCK = dict(
    storage_class=mf.Float8BlockStorage,
    row_fields=("rowwise_data", "rowwise_scale_inv"),
    col_fields=("columnwise_data", "columnwise_scale_inv"),
    shared_fields=(),
    shape=(256, 384),
    leading_shape=(2, 3, 64),
)
_MX = dict(
    storage_class=mf.MXFP8Storage,
    row_fields=("rowwise_data", "rowwise_scale"),
    col_fields=("columnwise_data", "columnwise_scale"),
    shared_fields=(),
    leading_shape=(2, 16, 64),
    block=32,
)
_NV = dict(
    storage_class=mf.NVFP4Storage,
    row_fields=("rowwise_data", "rowwise_scale", "amax_rowwise"),
    col_fields=("columnwise_data", "columnwise_scale", "amax_columnwise"),
    shared_fields=(),
    expected_shapes=_shapes_nvfp4,
    leading_shape=(2, 8, 32),
    block=16,
)

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in [
        Family("delayed_e4m3", _delayed(E4M3), _ref_per_tensor(E4M3, True),
               expected_shapes=_shapes_per_tensor(E4M3), tags={"fp8", "per_tensor"}, **_PT),
        Family("current_e4m3", lambda **u: mf.Float8CurrentScalingQuantizer(E4M3, **u),
               _ref_per_tensor(E4M3, False), expected_shapes=_shapes_per_tensor(E4M3),
               tags={"fp8", "per_tensor"}, **_PT),
        Family("current_e5m2", lambda **u: mf.Float8CurrentScalingQuantizer(E5M2, **u),
               _ref_per_tensor(E5M2, False), expected_shapes=_shapes_per_tensor(E5M2),
               tags={"fp8", "per_tensor"}, **_PT),
        Family("block_1d", lambda **u: mf.Float8BlockQuantizer(1, **u), _ref_block(1),
               expected_shapes=_shapes_block(1), tags={"fp8", "block"}, **_BLOCK),
        Family("block_2d", lambda **u: mf.Float8BlockQuantizer(2, **u), _ref_block(2),
               expected_shapes=_shapes_block(2), derivable=True, same_values=True,
               tags={"fp8", "block"}, **_BLOCK),
        Family("mxfp8", lambda **u: mf.MXFP8Quantizer(**u), _ref_mxfp8(E4M3),
               expected_shapes=_shapes_mxfp8(E4M3), tags={"fp8", "mxfp8"}, **_MX),
        Family("mxfp8_e5m2", lambda **u: mf.MXFP8Quantizer(E5M2, **u), _ref_mxfp8(E5M2),
               expected_shapes=_shapes_mxfp8(E5M2), tags={"fp8", "mxfp8"}, **_MX),
        Family("nvfp4", lambda **u: mf.NVFP4Quantizer(**u), _ref_nvfp4(),
               tags={"nvfp4"}, **_NV),
        Family("nvfp4_rht", lambda **u: mf.NVFP4Quantizer(with_rht=True, **u),
               _ref_nvfp4(with_rht=True), tags={"nvfp4", "rht"}, **_NV),
        Family("nvfp4_sr", lambda **u: mf.NVFP4Quantizer(stochastic_rounding=True, **u),
               _ref_nvfp4(stochastic_rounding=True), stochastic=True, tags={"nvfp4"}, **_NV),
        Family("nvfp4_2d", lambda **u: mf.NVFP4Quantizer(with_2d_quantization=True, **u),
               _ref_nvfp4(two_dimensional=True), derivable=True, same_values=True,
               tags={"nvfp4"}, **_NV),
        Family("identity", lambda **u: mf.IdentityQuantizer(**u), _ref_identity,
               storage_class=mf.IdentityStorage, row_fields=("rowwise_data",),
               col_fields=("columnwise_data",), shared_fields=(),
               expected_shapes=_shapes_identity, leading_shape=(2, 3, 64), derivable=True,
               same_values=True, tags={"identity"}),
    ]
}

ALL = list(FAMILIES)
DETERMINISTIC = [n for n, f in FAMILIES.items() if not f.stochastic]
USAGES = [(True, False), (False, True), (True, True)]
USAGE_IDS = ["rowwise", "columnwise", "both"]


def family_input(family: Family, shape=None, seed=0, dtype=torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape or family.shape, generator=gen).to(dtype)


def check_buffers(storage, family: Family, x, rowwise, columnwise, expected=None):
    """Exactly the requested buffers exist, with hand-derived shapes/dtypes and reference bytes."""
    assert isinstance(storage, family.storage_class)
    m, k = _m_k(x)
    shapes = family.expected_shapes(m, k, x.dtype)
    for name in family.row_fields + family.col_fields + family.shared_fields:
        present = (
            name in family.shared_fields
            or (name in family.row_fields and rowwise)
            or (name in family.col_fields and columnwise)
        )
        buffer = getattr(storage, name)
        if not present:
            assert buffer is None, f"{family.name}: {name} exists but was not asked for"
            continue
        assert buffer is not None, f"{family.name}: {name} is missing"
        shape, dtype = shapes[name]
        assert tuple(buffer.shape) == shape, f"{family.name}.{name}: {tuple(buffer.shape)}"
        assert buffer.dtype == dtype, f"{family.name}.{name}: {buffer.dtype}"
        if expected is not None:
            assert_same_bytes(buffer, expected[name], f"{family.name}.{name}")


# --------------------------------------------------------------------------------------------
# tests: usages and buffers
# --------------------------------------------------------------------------------------------


