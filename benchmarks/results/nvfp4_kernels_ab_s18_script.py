"""The eighteenth session's A/B of the NVFP4 1x16 quantize (row + column RHT) and decode kernels.

Usage: python nvfp4_kernels_ab_s18_script.py SRC_ROOT (a tree's `src` folder: the old one from
`git archive`, or the working tree's), run alternately per tree in one device call; prints one
JSON line of median milliseconds (triton's do_bench) and the copy bandwidth of the same call.
"""

import itertools
import json
import sys

sys.path.insert(0, sys.argv[1])

import torch  # noqa: E402
import triton.testing  # noqa: E402

from minifloat.kernels import dequantize, nvfp4  # noqa: E402


def bench(fn) -> float:
    return float(triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median"))


def rotating(items):
    """A function returning the next of `items` each call (inputs rotate: no cache reuse)."""
    cycle = itertools.cycle(items)
    return lambda: next(cycle)


def main() -> None:
    torch.manual_seed(0)
    out = {}
    src = torch.empty(8192 * 8192 * 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    out["copy_GBps"] = 2 * src.numel() * 2 / bench(lambda: dst.copy_(src)) / 1e6
    for m, k in ((8192, 2048), (8192, 8192), (8192, 6144)):
        xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
        for sr in (False, True):
            next_x = rotating(xs)
            out[f"quant {m}x{k} {'SR' if sr else 'RN'}"] = bench(
                lambda next_x=next_x, sr=sr: nvfp4.quantize_nvfp4(
                    next_x(), rowwise=True, columnwise=True, with_rht=True,
                    stochastic_rounding=sr))
        copies = [nvfp4.quantize_nvfp4(x, rowwise=True, columnwise=True, with_rht=True)
                  for x in xs]
        for copy in ("rowwise", "columnwise"):
            next_copy = rotating(copies)

            def decode(next_copy=next_copy, copy=copy):
                d = next_copy()
                return dequantize.dequantize_nvfp4_operand(
                    d[f"{copy}_data"], d[f"{copy}_scale"], d[f"amax_{copy}"])

            out[f"decode {copy} {m}x{k}"] = bench(decode)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
