"""bf16 GEMM-operand decodes (kernels/dequantize.py): bandwidth, tiles, the old path, GEMM layouts,
and the Linear step with the old (numerics fp32) operands against the new ones, with a profile.

Usage: python benchmarks/dequantize_bench.py [--shape MxK] [--step MxKxN] [--profile] [--no-step]
Prints a table last; times are medians of device-event timings (triton do_bench).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))

from minifloat.kernels.element_cast import round_to_bf16  # noqa: E402


def bench(fn) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))


def legacy_operands():
    """Patch the storages back to the numerics fp32 operands (the code before the kernels)."""
    from minifloat import numerics
    from minifloat.quantizers import MXFP8Storage, NVFP4Storage

    def mx(self, columnwise):
        if columnwise:
            values = numerics.dequantize_mxfp8(self.columnwise_data, self.columnwise_scale,
                                               columnwise=True)
            return values.t(), None
        return numerics.dequantize_mxfp8(self.rowwise_data, self.rowwise_scale), None

    def nv(self, columnwise):
        if columnwise:
            values = numerics.dequantize_nvfp4_blocks(self.columnwise_data, self.columnwise_scale)
            return values, numerics.global_decode_scale(self.amax_columnwise)
        values = numerics.dequantize_nvfp4_blocks(self.rowwise_data, self.rowwise_scale)
        return values, numerics.global_decode_scale(self.amax_rowwise)

    saved = (MXFP8Storage.gemm_operand, NVFP4Storage.gemm_operand)
    MXFP8Storage.gemm_operand, NVFP4Storage.gemm_operand = mx, nv
    return saved


def restore(saved):
    from minifloat.quantizers import MXFP8Storage, NVFP4Storage

    MXFP8Storage.gemm_operand, NVFP4Storage.gemm_operand = saved


def kernels_table(m: int, k: int, rows: list) -> None:
    from minifloat import numerics
    from minifloat.kernels import dequantize as dq
    from minifloat.kernels.mxfp8 import quantize_mxfp8
    from minifloat.kernels.nvfp4 import quantize_nvfp4

    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    n = m * k
    copy_src = torch.empty_like(x)
    ms = bench(lambda x=x: copy_src.copy_(x))
    rows.append(("bf16 copy (ceiling)", ms, 4 * n / ms / 1e6))

    mx = quantize_mxfp8(x, rowwise=True, columnwise=True)
    mx_bytes = n * (1 + 2) + n // 32
    checks = []
    for columnwise in (False, True):
        prefix = "columnwise" if columnwise else "rowwise"
        data, scale = mx[f"{prefix}_data"], mx[f"{prefix}_scale"]
        got = dq.dequantize_mxfp8_bf16(data, scale, columnwise=columnwise)
        ref = numerics.dequantize_mxfp8(data, scale, columnwise=columnwise)
        ref = (ref.t() if columnwise else ref).to(torch.bfloat16)
        checks.append(torch.equal(got.view(torch.int16), ref.contiguous().view(torch.int16)))
        del got, ref
        variants = ([("rowwise", (16, 256), 8), ("rowwise", (32, 128), 8),
                     ("rowwise", (8, 512), 8)] if not columnwise else
                    [("T", (32, 128), 8), ("T", (64, 64), 8), ("T", (32, 64), 4),
                     ("NT", (32, 128), 8), ("NT", (32, 64), 4), ("NT", (64, 64), 8)])
        for kind, tile, warps in variants:
            transpose = kind != "NT"
            warps_name = ("MX_ROW_WARPS" if not columnwise else
                          "MX_COL_WARPS" if transpose else "MX_COLNT_WARPS")
            saved_warps = getattr(dq, warps_name)
            setattr(dq, warps_name, warps)
            shape = (k, m) if columnwise and transpose else (m, k)
            out = torch.empty(shape, dtype=torch.bfloat16, device="cuda")
            ms = bench(lambda data=data, scale=scale, tile=tile, out=out, c=columnwise,
                       t=transpose: dq.dequantize_mxfp8_bf16(data, scale, columnwise=c,
                                                             transpose=t, out=out,
                                                             block_shape=tile))
            setattr(dq, warps_name, saved_warps)
            rows.append((f"mxfp8 {prefix} {kind} tile {tile} w{warps}", ms,
                         mx_bytes / ms / 1e6))

        def old(data=data, scale=scale, c=columnwise):
            values = numerics.dequantize_mxfp8(data, scale, columnwise=c)
            return (values.t() if c else values).to(torch.bfloat16)

        ms = bench(old)
        rows.append((f"mxfp8 {prefix} OLD numerics+to(bf16)", ms, mx_bytes / ms / 1e6))
    # general path only: random scale bytes in every block
    data = mx["rowwise_data"]
    wild = torch.randint(0, 256, mx["rowwise_scale"].shape, device="cuda", dtype=torch.uint8)
    ms = bench(lambda data=data, wild=wild: dq.dequantize_mxfp8_bf16(data, wild))
    rows.append(("mxfp8 rowwise, general path (random scales)", ms, mx_bytes / ms / 1e6))
    del mx, data, wild

    nv = quantize_nvfp4(x, rowwise=True, columnwise=True)
    nv_bytes = n // 2 + n // 16 + 2 * n
    for prefix in ("rowwise", "columnwise"):
        data, scale = nv[f"{prefix}_data"], nv[f"{prefix}_scale"]
        got = dq.dequantize_nvfp4_blocks_bf16(data, scale)
        ref = numerics.dequantize_nvfp4_blocks(data, scale).to(torch.bfloat16)
        checks.append(torch.equal(got.view(torch.int16), ref.view(torch.int16)))
        del got, ref
        if prefix == "columnwise":
            continue
        for tile in [(16, 128), (32, 128), (8, 256)]:
            for warps in (4, 8):
                dq.NV_WARPS = warps
                out = torch.empty((data.shape[0], 2 * data.shape[1]), dtype=torch.bfloat16,
                                  device="cuda")
                ms = bench(lambda data=data, scale=scale, tile=tile, out=out:
                           dq.dequantize_nvfp4_blocks_bf16(data, scale, out=out,
                                                           block_shape=tile))
                rows.append((f"nvfp4 tile {tile} w{warps}", ms, nv_bytes / ms / 1e6))
        dq.NV_WARPS = 4
        ms = bench(lambda data=data, scale=scale:
                   numerics.dequantize_nvfp4_blocks(data, scale).to(torch.bfloat16))
        rows.append(("nvfp4 OLD numerics+to(bf16)", ms, nv_bytes / ms / 1e6))
    print(f"bit-exact on the benchmark tensors: {checks}")
    del nv, x


def gemm_layouts(m: int, k: int, n: int, rows: list) -> None:
    """wgrad dW [N, K] = dY^T X with bf16 operands as contiguous [N, M], [K, M] copies or as
    transposed views of [M, N], [M, K] (what the old columnwise operands were)."""
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    dy_t, x_t = dy.t().contiguous(), x.t().contiguous()
    flops = 2 * m * n * k
    for name, a, b in (("contiguous [N,M] x [K,M]", dy_t, x_t),
                       ("views dY.t() x X.t()", dy.t(), x.t()),
                       ("fprop X [M,K] x W [N,K]", x, dy_t[:, :k].contiguous())):
        if a.shape[1] != b.shape[1]:
            continue
        ms = bench(lambda a=a, b=b: torch.mm(a, b.t(), out_dtype=torch.float32))
        rows.append((f"mm {name}", ms, flops / ms / 1e9))


@triton.jit
def _alpha_cast_kernel(x_ptr, alpha_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """Prototype epilogue: bf16(x * alpha), one pass (x fp32, alpha a device scalar)."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    alpha = tl.load(alpha_ptr)
    x = tl.load(x_ptr + offsets, mask=mask)
    tl.store(out_ptr + offsets, round_to_bf16(x * alpha).to(tl.bfloat16), mask=mask)


def alpha_cast(product: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    out = torch.empty(product.shape, dtype=torch.bfloat16, device=product.device)
    n = product.numel()
    _alpha_cast_kernel[(triton.cdiv(n, 4096),)](product, alpha.float().reshape(1), out, n,
                                               BLOCK=4096, num_warps=8)
    return out


def patch_gemm(epilogue: bool):
    """bf16_gemm prototypes for the lead: bf16 output straight from torch.mm when there is no
    alpha and no bias; with `epilogue`, alpha (NVFP4) applied by one fused multiply-and-cast."""
    from minifloat import gemm_paths

    original = gemm_paths.bf16_gemm

    def bf16_gemm(a_values, b_values, *, alpha, bias, out_dtype):
        a, b = a_values.to(torch.bfloat16), b_values.to(torch.bfloat16)
        if bias is None and out_dtype == torch.bfloat16:
            if alpha is None:
                return torch.mm(a, b.t())
            if epilogue:
                return alpha_cast(torch.mm(a, b.t(), out_dtype=torch.float32), alpha)
        return original(a, b, alpha=alpha, bias=bias, out_dtype=out_dtype)

    gemm_paths.bf16_gemm = bf16_gemm
    return original


def patch_views():
    """MXFP8 columnwise operands as .t() views of an untransposed bf16 decode."""
    from minifloat.kernels.dequantize import dequantize_mxfp8_bf16
    from minifloat.quantizers import MXFP8Storage

    original = MXFP8Storage.gemm_operand

    def gemm_operand(self, columnwise):
        if columnwise:
            return dequantize_mxfp8_bf16(self.columnwise_data, self.columnwise_scale,
                                         columnwise=True, transpose=False).t(), None
        return original(self, columnwise)

    MXFP8Storage.gemm_operand = gemm_operand
    return original


def step_table(m: int, k: int, n: int, rows: list, legacy: bool) -> None:
    try:
        _step_table(m, k, n, rows, legacy)
    except Exception as error:  # noqa: BLE001 - keep the rows measured so far
        import traceback

        traceback.print_exc()
        rows.append((f"step table stopped: {error!r}"[:52], 0.0, 0.0))


def _step_table(m: int, k: int, n: int, rows: list, legacy: bool) -> None:
    import linear_step

    import minifloat as mf
    from minifloat import gemm_paths
    from minifloat.quantizers import MXFP8Storage

    rows.append(("step bf16", linear_step.bf16_step_ms(m, k, n), 0.0))
    for name, recipe in (("mxfp8", mf.MXFP8BlockScaling()), ("nvfp4", mf.NVFP4BlockScaling())):
        if legacy:
            saved = legacy_operands()
            try:
                rows.append((f"step {name} OLD operands", linear_step.minifloat_step_ms(
                    m, k, n, recipe), 0.0))
            finally:
                restore(saved)
        rows.append((f"step {name} NEW operands", linear_step.minifloat_step_ms(
            m, k, n, recipe), 0.0))
        if name == "mxfp8":
            saved_op = patch_views()
            rows.append(("step mxfp8 NEW, columnwise as views", linear_step.minifloat_step_ms(
                m, k, n, recipe), 0.0))
            MXFP8Storage.gemm_operand = saved_op
        saved_gemm = patch_gemm(epilogue=name == "nvfp4")
        what = "bf16-out mm" if name == "mxfp8" else "fused alpha*acc->bf16 epilogue"
        rows.append((f"step {name} NEW + {what}", linear_step.minifloat_step_ms(
            m, k, n, recipe), 0.0))
        if name == "mxfp8":
            saved_op = patch_views()
            rows.append(("step mxfp8 NEW + bf16-out mm + views", linear_step.minifloat_step_ms(
                m, k, n, recipe), 0.0))
            MXFP8Storage.gemm_operand = saved_op
        gemm_paths.bf16_gemm = saved_gemm
        torch.cuda.empty_cache()


def profile(m: int, k: int, n: int) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    import minifloat as mf

    for name, recipe in (("mxfp8", mf.MXFP8BlockScaling()), ("nvfp4", mf.NVFP4BlockScaling())):
        layer = mf.Linear(k, n, bias=False, params_dtype=torch.bfloat16, device="cuda")
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)

        def step(layer=layer, x=x, dy=dy, recipe=recipe):
            layer._weight_cache.clear()
            with mf.autocast(recipe=recipe):
                y = layer(x)
            y.backward(dy)

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        steps = 5
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                step()
            torch.cuda.synchronize()
        events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
        total = sum(e.self_device_time_total for e in events) / steps / 1000
        events.sort(key=lambda e: e.self_device_time_total, reverse=True)
        print(f"\nprofile {name} {m}x{k}x{n}: {total:.3f} ms of CUDA kernels a step")
        for e in events[:14]:
            print(f"  {e.self_device_time_total / steps / 1000:8.3f} ms  x{e.count // steps:<3d} "
                  f"{e.key[:110]}")
        del layer, x, dy
        torch.cuda.empty_cache()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="16384x8192")
    parser.add_argument("--step", default="16384x8192x8192")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--no-kernels", action="store_true")
    parser.add_argument("--no-step", action="store_true")
    parser.add_argument("--legacy", action="store_true", help="also time the old fp32 operands")
    args = parser.parse_args()
    m, k = (int(v) for v in args.shape.split("x"))
    sm, sk, sn = (int(v) for v in args.step.split("x"))
    rows: list = []
    if not args.no_kernels:
        kernels_table(m, k, rows)
        torch.cuda.empty_cache()
        gemm_layouts(sm, sk, sn, rows)
        torch.cuda.empty_cache()
    if not args.no_step:
        step_table(sm, sk, sn, rows, args.legacy)
    if args.profile:
        profile(sm, sk, sn)
    print(f"\n{torch.cuda.get_device_name()}  decode shape {m}x{k}, step {args.step}")
    print(f"{'what':<52s} {'ms':>8s} {'GB/s|TFLOP/s':>13s}")
    for name, ms, rate in rows:
        print(f"{name:<52s} {ms:8.3f} {rate:13.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
