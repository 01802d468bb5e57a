"""The random Hadamard transform (RHT) of NVFP4 columnwise copies (NUMERICS.md §6).

Each run of 16 elements r (a row vector) becomes r @ (diag(s) H16 / 4), H16 the Sylvester
Hadamard matrix and s a fixed sign vector. The matrix is orthogonal ((diag(s) H16 / 4) times
(H16 diag(s) / 4) is the identity), so both wgrad operands can carry it and it cancels in
dW = dY^T X.

Order of operations, fixed so that kernels can match it bit for bit: multiply by the signs
(exact), four butterfly stages of a fast Walsh-Hadamard transform (strides 1, 2, 4, 8, each
a + b / a - b in fp32), multiply by 1/4 (exact), round to bf16.
"""

from __future__ import annotations

import torch

RHT_SIZE = 16
RHT_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)
# RHT_SIGNS as bits (bit i set: sign i is -1), so that the signs are made on the device
_NEGATIVE_BITS = sum(1 << i for i, sign in enumerate(RHT_SIGNS) if sign < 0)


def rht_signs(device: torch.device) -> torch.Tensor:
    """RHT_SIGNS as fp32 [16] on `device`, computed there: a tensor from a Python list would be
    a host-to-device copy, which makes the caller wait for the GPU."""
    bits = torch.full((RHT_SIZE,), _NEGATIVE_BITS, dtype=torch.int32, device=device)
    negative = (bits >> torch.arange(RHT_SIZE, dtype=torch.int32, device=device)) & 1
    return 1.0 - 2.0 * negative.float()


def sylvester_hadamard(n: int = RHT_SIZE) -> torch.Tensor:
    """The n x n Sylvester Hadamard matrix (entries +-1), n a power of two."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h


def _fwht16(runs: torch.Tensor) -> torch.Tensor:
    """Fast Walsh-Hadamard transform over the last dim (16) in fp32 butterflies."""
    shape = runs.shape
    for stride in (1, 2, 4, 8):
        pairs = runs.reshape(*shape[:-1], RHT_SIZE // (2 * stride), 2, stride)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        runs = torch.stack((a + b, a - b), dim=-2).reshape(shape)
    return runs


def random_hadamard_transform(x2d: torch.Tensor, *, round_to_bf16: bool = True
                              ) -> torch.Tensor:
    """Apply the RHT to every run of 16 along the last dim of a 2D tensor; returns bf16 (the
    quantizers' input), or fp32 without that rounding (`round_to_bf16=False`: a high-precision
    GEMM operand given the transform its partner carries, so that it cancels).

    The caller passes x^T ([K, M]) so that the runs lie along M, as the columnwise copy needs.
    """
    rows, cols = x2d.shape
    if cols % RHT_SIZE:
        raise ValueError(
            f"the random Hadamard transform needs runs of {RHT_SIZE}: {cols} elements per row "
            f"is not a multiple of {RHT_SIZE}"
        )
    signs = rht_signs(x2d.device)
    runs = x2d.float().reshape(rows, cols // RHT_SIZE, RHT_SIZE) * signs
    transformed = (_fwht16(runs) * 0.25).reshape(rows, cols)
    return transformed.to(torch.bfloat16) if round_to_bf16 else transformed


def inverse_random_hadamard_transform(y2d: torch.Tensor) -> torch.Tensor:
    """Undo the RHT in fp32 (y @ H16 / 4, then the signs); approximate to fp32 rounding."""
    rows, cols = y2d.shape
    signs = rht_signs(y2d.device)
    runs = y2d.float().reshape(rows, cols // RHT_SIZE, RHT_SIZE)
    return (_fwht16(runs) * 0.25 * signs).reshape(rows, cols)
