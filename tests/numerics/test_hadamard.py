"""The random Hadamard transform of NVFP4 columnwise copies (NUMERICS.md §6) against an
explicit float64 matrix."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from minifloat.numerics import (
    RHT_SIGNS,
    inverse_random_hadamard_transform,
    random_hadamard_transform,
    sylvester_hadamard,
)

F32 = np.float32
R6 = F32(1.0) / F32(6.0)  # fp32(1/6) = 0.16666667163...
E2M1_TABLE = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
SPEC_SIGNS = [1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1]



# ---------------------------------------------------------------- random Hadamard transform


def h16() -> np.ndarray:
    h = np.array([[1.0]])
    for _ in range(4):
        h = np.kron(h, np.array([[1.0, 1.0], [1.0, -1.0]]))
    return h


def rht_matrix() -> np.ndarray:
    return np.diag(np.array(SPEC_SIGNS, dtype=np.float64)) @ h16() / 4.0


def bf16_rne(y: np.ndarray) -> torch.Tensor:
    """Round float64 to bf16 (8 significant bits) with ties to even, in one rounding."""
    _, e = np.frexp(y)
    q = np.ldexp(1.0, e - 8)
    return torch.from_numpy(np.round(y / q) * q).float().to(torch.bfloat16)  # exact now


def ref_rht(x2d: torch.Tensor) -> np.ndarray:
    r, c = x2d.shape
    return (x2d.double().numpy().reshape(r, c // 16, 16) @ rht_matrix()).reshape(r, c)


def test_hadamard_matrix_and_signs():
    h = sylvester_hadamard(16)
    assert torch.equal(h.double(), torch.from_numpy(h16()))
    assert np.array_equal(h16() @ h16().T, 16 * np.eye(16))
    q = rht_matrix()
    assert np.array_equal(q @ q.T, np.eye(16))  # exact: entries are +-1/4
    assert list(RHT_SIGNS) == SPEC_SIGNS


def test_rht_vs_explicit_matrix():
    x = torch.randn(256, 512, generator=torch.Generator().manual_seed(11))
    y = random_hadamard_transform(x)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    ref = bf16_rne(ref_rht(x))
    diff = (y.view(torch.int16).int() - ref.view(torch.int16).int()).abs()
    # fp32 butterflies vs exact float64: each output's fp32 error is a few 2^-24 relative, so a
    # bf16 rounding (spacing 2^-8) flips only when the exact value lies that close to a bf16
    # midpoint: probability ~1e-4. Nearly all must be equal, none more than one ulp apart.
    assert (diff == 0).double().mean().item() >= 0.999
    assert diff.max().item() <= 1
    assert torch.equal(torch.signbit(y[diff > 0]), torch.signbit(ref[diff > 0]))


def test_rht_exact_on_integers():
    # integer inputs: every fp32 sum is exact, so the result is the single RNE of the exact value
    g = torch.Generator().manual_seed(12)
    x = torch.randint(-300, 301, (64, 128), generator=g).float()
    assert torch.equal(random_hadamard_transform(x).view(torch.int16),
                       bf16_rne(ref_rht(x)).view(torch.int16))
    # runs of 16 along the last dim only: a spike at column 16 touches columns 16..31 only
    e = torch.zeros(1, 48)
    e[0, 16] = 4.0
    y = random_hadamard_transform(e).float()
    assert (y[0, :16] == 0).all() and (y[0, 32:] == 0).all()
    assert y[0, 16:32].tolist() == [1.0] * 16  # (4 e_0) diag(s) H / 4 = s_0 H[0, :] = all 1


def test_rht_cancels_in_wgrad_products():
    g = torch.Generator().manual_seed(13)
    a = torch.randn(8, 256, generator=g)  # e.g. dY^T: runs along M (256)
    b = torch.randn(24, 256, generator=g)  # X^T
    ya, yb = random_hadamard_transform(a).double(), random_hadamard_transform(b).double()
    exact = a.double() @ b.double().t()
    got = ya @ yb.t()
    # Q is orthogonal, so (a Q)(b Q)^T = a b^T exactly; the only errors are the bf16 roundings
    # (relative <= 2^-8 each, so <= 2^-7 + 2^-16 per product) and fp32 butterflies (~2^-21)
    bound = (2.0**-7 + 2.0**-15) * (ya.abs() @ yb.abs().t()) + 1e-5
    assert ((got - exact).abs() <= bound).all()
    # the check has teeth: transforming only one side is nowhere near a b^T
    wrong = ya @ b.double().t()
    assert ((wrong - exact).abs() > bound).any()


def test_inverse_rht():
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(14))
    back = inverse_random_hadamard_transform(random_hadamard_transform(x))
    # per run of 16: |Q^T e|_2 = |e|_2 <= 2^-8 |Q x|_2 = 2^-8 |x|_2 (plus fp32 slack)
    err = (back.double() - x.double()).reshape(32, 4, 16).norm(dim=-1)
    norm = x.double().reshape(32, 4, 16).norm(dim=-1)
    assert (err <= norm * (2.0**-8 + 2.0**-18)).all()


def test_rht_shape_error():
    with pytest.raises(ValueError, match="16"):
        random_hadamard_transform(torch.ones(4, 24))


