"""general_gemm: the three GEMMs of a linear layer for every family and for mixed families,
against an independent composition of numerics functions (see _reference.py).

All comparisons are bit for bit: both sides decode the same operand values exactly and run one
fp32 torch.matmul of the same [rows, reduction] shapes on CPU, which is deterministic.
"""

from __future__ import annotations

import pytest
import torch

import minifloat as mf
from minifloat import general_gemm

from ._reference import (
    E4M3,
    E5M2,
    assert_bitwise_equal,
    gemm,
    mm_tn,
    op_block_1d,
    op_block_2d,
    op_current,
    op_delayed,
    op_mxfp8,
    op_nvfp4,
)

M, K, N = 64, 192, 96  # multiples of 32 (MXFP8) and 16 (NVFP4); 1.5 blocks of 128 (block FP8)
DELAYED_SCALE = 4.0


def _transposed(op):
    """Per-tensor FP8: the columnwise copy is the byte transpose of the rowwise one."""
    def column(t):
        values, alpha = op(t.t())
        return values.t(), alpha
    return column


class Family:
    """How one operand role is quantized (a minifloat quantizer) and its independent reference:
    `row(t)` quantizes t [rows, reduction] along the reduction dim; `col(t)` gives the columnwise
    copy of the tensor whose transpose is t, laid out [rows, reduction]."""

    def __init__(self, name, role):
        self.name, self.role = name, role
        grad = role == "grad"
        fp8 = E5M2 if grad else E4M3
        if name == "fp8cs":
            self.quantizer = lambda: mf.Float8CurrentScalingQuantizer(fp8)
            self.row = lambda t: op_current(t, fp8)
            self.col = _transposed(self.row)
        elif name == "fp8ds":
            self.quantizer = lambda: mf.Float8Quantizer(
                torch.tensor([DELAYED_SCALE]), torch.zeros(1), fp8)
            self.row = lambda t: op_delayed(t, DELAYED_SCALE, fp8)
            self.col = _transposed(self.row)
        elif name == "block":
            dim = 2 if role == "weight" else 1
            self.quantizer = lambda: mf.Float8BlockQuantizer(dim)
            self.row = self.col = op_block_2d if dim == 2 else op_block_1d
        elif name == "mxfp8":
            self.quantizer = lambda: mf.MXFP8Quantizer()
            self.row = self.col = op_mxfp8
        elif name in ("nvfp4", "nvfp4_norht"):
            if role == "weight":
                self.quantizer = lambda: mf.NVFP4Quantizer(with_2d_quantization=True)
                self.row = self.col = lambda t: op_nvfp4(t, two_dimensional=True)
            else:
                rht = name == "nvfp4"
                self.quantizer = lambda: mf.NVFP4Quantizer(with_rht=rht)
                self.row = op_nvfp4
                self.col = lambda t: op_nvfp4(t, rht=rht)
        elif name in ("identity", "plain"):
            self.quantizer = (lambda: mf.IdentityQuantizer()) if name == "identity" else None
            self.row = self.col = lambda t: (t.float(), None)
        else:
            raise ValueError(name)

    def quantize(self, t, internal):
        if self.quantizer is None:
            return t
        q = self.quantizer()
        q.set_usage(rowwise=True, columnwise=True)
        q.internal = internal
        return q(t)

    @property
    def rht(self):
        return self.name == "nvfp4" and self.role != "weight"


COMBOS = [
    # (input family, weight family, grad family)
    ("fp8cs", "fp8cs", "fp8cs"),
    ("fp8ds", "fp8ds", "fp8ds"),
    ("block", "block", "block"),
    ("mxfp8", "mxfp8", "mxfp8"),
    ("nvfp4", "nvfp4", "nvfp4"),
    ("identity", "identity", "identity"),
    ("mxfp8", "nvfp4", "mxfp8"),          # MXFP8 x NVFP4 fprop and dgrad
    ("nvfp4_norht", "mxfp8", "nvfp4_norht"),
    ("fp8cs", "plain", "fp8cs"),          # FP8 x a plain tensor
    ("plain", "fp8cs", "block"),
    ("identity", "nvfp4", "mxfp8"),
    ("fp8ds", "block", "mxfp8"),
    ("block", "mxfp8", "nvfp4_norht"),
]


@pytest.fixture(scope="module")
def tensors():
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(M, K, generator=g)
    w = torch.randn(N, K, generator=g) * 0.05
    dy = torch.randn(M, N, generator=g) * 1e-3
    bias = torch.randn(N, generator=g)
    return x, w, dy, bias


@pytest.mark.parametrize("internal", [False, True], ids=["tensor", "storage"])
@pytest.mark.parametrize("combo", COMBOS, ids=lambda c: "-".join(c))
def test_three_gemms_match_reference(tensors, combo, internal):
    x, w, dy, bias = tensors
    fx, fw, fg = Family(combo[0], "input"), Family(combo[1], "weight"), Family(combo[2], "grad")
    xq, wq, dyq = fx.quantize(x, internal), fw.quantize(w, internal), fg.quantize(dy, internal)

    y = general_gemm(xq, wq)
    assert_bitwise_equal(y, gemm(fx.row(x), fw.row(w)), "fprop")
    y = general_gemm(xq, wq, bias=bias)
    assert_bitwise_equal(y, gemm(fx.row(x), fw.row(w), bias=bias), "fprop+bias")
    assert y.shape == (M, N)

    dx = general_gemm(dyq, wq, b_columnwise=True)
    assert dx.shape == (M, K)
    assert_bitwise_equal(dx, gemm(fg.row(dy), fw.col(w.t())), "dgrad")

    if fg.rht == fx.rht:
        dw = general_gemm(dyq, xq, a_columnwise=True, b_columnwise=True)
        assert dw.shape == (N, K)
        assert_bitwise_equal(dw, gemm(fg.col(dy.t()), fx.col(x.t())), "wgrad")
    else:
        with pytest.raises(ValueError, match="Hadamard"):
            general_gemm(dyq, xq, a_columnwise=True, b_columnwise=True)


def test_gemm_is_close_to_the_exact_product(tensors):
    # sanity of the reference itself: MXFP8 fprop within 6% of the fp64 product (E4M3)
    x, w, _, _ = tensors
    y = general_gemm(mf.MXFP8Quantizer()(x), mf.MXFP8Quantizer()(w))
    exact = x.double() @ w.double().t()
    assert (torch.linalg.norm(y.double() - exact) / torch.linalg.norm(exact)).item() < 0.06


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_out_dtype_defaults_to_a_nominal_dtype(tensors, dtype):
    x, w, _, _ = tensors
    xq = mf.MXFP8Quantizer()(x.to(dtype))
    wq = mf.MXFP8Quantizer()(w.to(dtype))
    y = general_gemm(xq, wq)
    assert y.dtype == dtype
    assert_bitwise_equal(y, gemm(op_mxfp8(x.to(dtype)), op_mxfp8(w.to(dtype)), out_dtype=dtype))
    y16 = general_gemm(xq, wq, out_dtype=torch.float16)
    assert_bitwise_equal(
        y16, gemm(op_mxfp8(x.to(dtype)), op_mxfp8(w.to(dtype)), out_dtype=torch.float16))


def test_rht_on_one_operand_only_is_an_error(tensors):
    x, _, dy, _ = tensors
    dy_rht = mf.NVFP4Quantizer(with_rht=True)(dy)
    x_plain = mf.NVFP4Quantizer(with_rht=False)(x)
    x_mx = mf.MXFP8Quantizer()(x)
    for a, b in ((dy_rht, x_plain), (dy_rht, x_mx), (mf.MXFP8Quantizer()(dy),
                                                       mf.NVFP4Quantizer(with_rht=True)(x))):
        with pytest.raises(ValueError, match="Hadamard"):
            general_gemm(a, b, a_columnwise=True, b_columnwise=True)
    # the rowwise copies of RHT tensors carry no transform: fprop-like use is fine
    general_gemm(dy_rht, mf.NVFP4Quantizer(with_rht=True)(torch.randn(K, N)))


@pytest.mark.parametrize("plain_side", ["a", "b"])
@pytest.mark.parametrize("identity", [False, True])
def test_rht_against_a_high_precision_operand_cancels(tensors, plain_side, identity):
    """wgrad with one operand kept in high precision (a plain tensor or an IdentityQuantizer's
    copy: the advisor's `@hp=layer:grad_output` under NVFP4) and the other an NVFP4 copy with
    the RHT: the plain one gets the same transform (fp32), so the product is dY^T X with X's
    columnwise quantization error only. Reference: that copy's values with the transform undone
    (numerics.inverse_random_hadamard_transform), times the plain operand, in float64."""
    x, _, dy, _ = tensors
    x_rht = mf.NVFP4Quantizer(with_rht=True, stochastic_rounding=False)(x)
    plain = mf.IdentityQuantizer()(dy) if identity else dy
    if plain_side == "a":
        got = general_gemm(plain, x_rht, a_columnwise=True, b_columnwise=True,
                           out_dtype=torch.float32)
    else:
        got = general_gemm(x_rht, plain, a_columnwise=True, b_columnwise=True,
                           out_dtype=torch.float32).t()
    # the columnwise copy's values with the transform undone (numerics), [M, K]
    x_back = mf.numerics.inverse_random_hadamard_transform(numerics_rht_domain(x_rht).t()).t()
    want = dy.double().t() @ x_back.double()
    error = (torch.linalg.norm(got.double() - want) / torch.linalg.norm(want)).item()
    assert error < 1e-5, error
    # without the transform on the plain side the product is far off: the test can fail
    wrong = dy.double().t() @ numerics_rht_domain(x_rht).double()
    assert (torch.linalg.norm(wrong - want) / torch.linalg.norm(want)).item() > 0.1


def numerics_rht_domain(x_rht) -> torch.Tensor:
    """The columnwise copy's values as the GEMM reads them (in the transformed domain), [M, K]."""
    storage = x_rht._storage if hasattr(x_rht, "_storage") else x_rht.quantized_storage
    values, alpha = storage.gemm_operand(True)
    values = values if alpha is None else values * alpha
    return values.t()


@pytest.mark.parametrize("family", ["fp8cs", "block", "mxfp8", "nvfp4"])
def test_missing_copy_is_a_value_error(tensors, family):
    x, w, dy, _ = tensors
    fx, fw, fg = Family(family, "input"), Family(family, "weight"), Family(family, "grad")
    q = fx.quantizer()
    q.set_usage(rowwise=True, columnwise=False)
    x_row = q(x)
    dyq = fg.quantize(dy, False)
    with pytest.raises(ValueError, match="columnwise"):
        general_gemm(dyq, x_row, a_columnwise=True, b_columnwise=True)
    q = fw.quantizer()
    q.set_usage(rowwise=False, columnwise=True)
    w_col = q(w)
    with pytest.raises(ValueError, match="rowwise"):
        general_gemm(fx.quantize(x, False), w_col)


def test_reduction_dim_mismatch_is_a_value_error(tensors):
    x, w, _, _ = tensors
    with pytest.raises(ValueError, match="reduction"):
        general_gemm(mf.MXFP8Quantizer()(x), mf.MXFP8Quantizer()(w[:, :160]))


@pytest.mark.parametrize("family", ["fp8cs", "mxfp8", "nvfp4", "block"])
def test_accumulate_into_main_grad_in_place(tensors, family):
    x, _, dy, _ = tensors
    fx, fg = Family(family, "input"), Family(family, "grad")
    xq, dyq = fx.quantize(x, True), fg.quantize(dy, True)
    main_grad = torch.randn(N, K)
    before = main_grad.clone()
    pointer = main_grad.data_ptr()
    out = general_gemm(dyq, xq, a_columnwise=True, b_columnwise=True, accumulate_into=main_grad)
    assert out is main_grad and main_grad.data_ptr() == pointer
    product = gemm(fg.col(dy.t()), fx.col(x.t()))
    assert_bitwise_equal(main_grad, before + product, "main_grad after one accumulation")
    general_gemm(dyq, xq, a_columnwise=True, b_columnwise=True, accumulate_into=main_grad)
    assert_bitwise_equal(main_grad, before + product + product, "after two")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_non_fp32_main_grad_is_a_type_error(tensors, dtype):
    x, _, dy, _ = tensors
    main_grad = torch.zeros(N, K, dtype=dtype)
    with pytest.raises(TypeError, match="float32"):
        general_gemm(mf.MXFP8Quantizer()(dy), mf.MXFP8Quantizer()(x), a_columnwise=True,
                     b_columnwise=True, accumulate_into=main_grad)
    assert not main_grad.any()


def test_plain_operands_alone(tensors):
    x, w, _, bias = tensors
    y = general_gemm(x, w, bias=bias)
    assert_bitwise_equal(y, (mm_tn(x, w) + bias).to(torch.float32))
    xt = general_gemm(x.t().contiguous(), w.t().contiguous(), a_columnwise=True,
                      b_columnwise=True)
    assert_bitwise_equal(xt, mm_tn(x, w), "columnwise of plain tensors = their transposes")


def test_accumulate_into_wrong_shape_is_a_value_error(tensors):
    x, _, dy, _ = tensors
    main_grad = torch.zeros(K, N)  # transposed: same numel as the [N, K] product
    with pytest.raises(ValueError, match="shape"):
        general_gemm(mf.MXFP8Quantizer()(dy), mf.MXFP8Quantizer()(x), a_columnwise=True,
                     b_columnwise=True, accumulate_into=main_grad)
