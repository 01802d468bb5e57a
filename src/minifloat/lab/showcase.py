"""A short tour of the formats: quantize one tensor in every format, report bytes and error.

Run it with `python -m minifloat formats`; `scripts/demo` runs the recipe comparison.
"""

from __future__ import annotations

import torch

from ..quantizers import (
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
    QuantizedStorage,
    Quantizer,
)


def showcase_quantizers() -> list[tuple[str, Quantizer]]:
    """(label, quantizer) for every format, rowwise copy only (what one GEMM operand needs)."""
    return [
        ("FP8 E4M3, per-tensor current scaling", Float8CurrentScalingQuantizer()),
        ("FP8 E5M2, per-tensor current scaling",
         Float8CurrentScalingQuantizer(torch.float8_e5m2)),
        ("FP8 block 1x128 (DeepSeek)", Float8BlockQuantizer(1)),
        ("FP8 block 128x128 (weights)", Float8BlockQuantizer(2)),
        ("MXFP8 (E4M3 + E8M0 per 32)", MXFP8Quantizer()),
        ("NVFP4 1x16 (E2M1 + UE4M3 + fp32)", NVFP4Quantizer()),
        ("NVFP4 16x16 (weights)", NVFP4Quantizer(with_2d_quantization=True)),
    ]


def storage_bytes(storage: QuantizedStorage) -> int:
    """Bytes held by all present buffers of a storage."""
    total = 0
    for name in storage.tensor_fields():
        buffer = getattr(storage, name)
        if buffer is not None:
            total += buffer.numel() * buffer.element_size()
    return total


def run_showcase(rows: int = 1024, cols: int = 1024, seed: int = 0) -> list[dict[str, float]]:
    """Quantize one bf16 tensor (gaussian with a few outliers) in every format."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=generator)
    outliers = torch.randint(0, x.numel(), (rows // 64,), generator=generator)
    x.view(-1)[outliers] *= 20.0
    x = x.to(torch.bfloat16)
    reference = x.float()
    results = []
    for label, quantizer in showcase_quantizers():
        quantizer.set_usage(rowwise=True, columnwise=False)
        quantizer.internal = True
        storage = quantizer(x)
        error = storage.dequantize(torch.float32) - reference
        sqnr = 10 * torch.log10(reference.pow(2).sum() / error.pow(2).sum())
        results.append(
            {
                "format": label,
                "bytes": storage_bytes(storage),
                "bits_per_value": 8 * storage_bytes(storage) / x.numel(),
                "relative_error": (error.norm() / reference.norm()).item(),
                "sqnr_db": sqnr.item(),
            }
        )
    return results


def print_showcase(rows: int = 1024, cols: int = 1024) -> None:
    baseline = rows * cols * 2
    print(f"One {rows}x{cols} bf16 tensor ({baseline / 2**20:.2f} MiB), gaussian with outliers:\n")
    header = (f"{'format':38s} {'bytes':>10s} {'bits/value':>10s} {'rel. error':>10s} "
              f"{'SQNR dB':>8s}")
    print(header)
    print("-" * len(header))
    print(f"{'bf16 (original)':38s} {baseline:>10d} {16.0:>10.2f} {0.0:>10.4f} {'inf':>8s}")
    for row in run_showcase(rows, cols):
        print(
            f"{row['format']:38s} {row['bytes']:>10d} {row['bits_per_value']:>10.2f} "
            f"{row['relative_error']:>10.4f} {row['sqnr_db']:>8.1f}"
        )
