"""A/B of NVFP4 quantize (1x16, row + column RHT) and decode kernels: python ab_nvfp4.py ROOT."""
import sys, json
sys.path.insert(0, sys.argv[1])
import torch, triton.testing
from minifloat.kernels import nvfp4, dequantize

def bench(fn):
    return float(triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median"))

torch.manual_seed(0)
out = {}
src = torch.empty(8192 * 8192 * 2, dtype=torch.bfloat16, device="cuda")
dst = torch.empty_like(src)
out["copy_GBps"] = 2 * src.numel() * 2 / bench(lambda: dst.copy_(src)) / 1e6
for m, k in ((8192, 2048), (8192, 8192), (8192, 6144)):
    xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    it = iter(range(10**9))
    for sr in (False, True):
        def f():
            x = xs[next(it) % 3]
            return nvfp4.quantize_nvfp4(x, rowwise=True, columnwise=True, with_rht=True,
                                        stochastic_rounding=sr)
        out[f"quant {m}x{k} {'SR' if sr else 'RN'}"] = bench(f)
    q = [nvfp4.quantize_nvfp4(x, rowwise=True, columnwise=True, with_rht=True) for x in xs]
    for copy in ("rowwise", "columnwise"):
        def g():
            d = q[next(it) % 3]
            return dequantize.dequantize_nvfp4_operand(d[f"{copy}_data"], d[f"{copy}_scale"], d[f"amax_{copy}"])
        out[f"decode {copy} {m}x{k}"] = bench(g)
print(json.dumps(out))
