"""Host time of one minifloat Linear forward+backward, eager against torch.compile.

Why: without CUDA graphs (FSDP2's hooks rule them out) a compiled FP8 step is bound by the host,
and most of it is the Python inside the GEMM ops (modules/gemm_op.py, lean_ops.py,
quantized_weight_ops.py) and around them (AOTAutograd's runtime wrappers). This prints, for a
Linear of --features (FP8 current scaling) at each of --tokens, with a plain bf16 weight and
with an FP8 weight (quantized_model_init), eager and compiled (fullgraph, default mode): the
median host microseconds of forward+backward (synchronize, perf_counter around the call, no
synchronization inside), and a cProfile of the compiled call at the smallest token count, to
--out/compiled_host.txt.

Usage: python benchmarks/compiled_host.py [--tokens 16,8192] [--features 2048] [--repeats 30]
       [--out DIR]   (CUDA only)
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

import minifloat as mf


def _layer(features: int, fp8_weight: bool, recipe) -> torch.nn.Module:
    torch.manual_seed(0)
    if fp8_weight:
        with mf.quantized_model_init(recipe=recipe):
            return mf.Linear(features, features, params_dtype=torch.bfloat16, device="cuda")
    return mf.Linear(features, features, params_dtype=torch.bfloat16, device="cuda")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="16,8192")
    parser.add_argument("--features", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("compiled_host: needs CUDA; skipped", file=sys.stderr)
        return 0
    recipe = mf.Float8CurrentScaling()
    tokens = [int(t) for t in args.tokens.split(",")]
    report = [f"compiled_host on {torch.cuda.get_device_name()}, torch {torch.__version__}"]
    for m in tokens:
        for fp8_weight in (False, True):
            for compiled in (False, True):
                layer = _layer(args.features, fp8_weight, recipe)
                run = torch.compile(layer, fullgraph=True) if compiled else layer
                x = torch.randn(m, args.features, device="cuda", dtype=torch.bfloat16,
                                requires_grad=True)
                dy = torch.randn(m, args.features, device="cuda", dtype=torch.bfloat16)

                def call() -> None:
                    with mf.autocast(recipe=recipe):
                        y = run(x)  # noqa: B023 - used within this iteration only
                    y.backward(dy)  # noqa: B023

                for _ in range(5):
                    call()
                times = []
                for _ in range(args.repeats):
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    call()
                    times.append((time.perf_counter() - start) * 1e6)
                torch.cuda.synchronize()
                line = (f"M={m} weight={'fp8' if fp8_weight else 'bf16'} "
                        f"{'compiled' if compiled else 'eager'}: host us fwd+bwd median "
                        f"{statistics.median(times):.0f}")
                print(line, flush=True)
                report.append(line)
                if compiled and m == min(tokens):
                    torch.autograd.set_multithreading_enabled(False)  # cProfile sees one thread
                    profile = cProfile.Profile()
                    profile.enable()
                    for _ in range(100):
                        call()
                    profile.disable()
                    torch.cuda.synchronize()
                    torch.autograd.set_multithreading_enabled(True)
                    text = io.StringIO()
                    stats = pstats.Stats(profile, stream=text)
                    stats.sort_stats("tottime").print_stats(40)
                    stats.sort_stats("cumulative").print_stats(50)
                    report.append(text.getvalue())
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "compiled_host.txt").write_text("\n".join(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
