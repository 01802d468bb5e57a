"""Run every benchmark that exists, writing JSON under --out (scripts/gpu-check calls this)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpt_step  # noqa: E402
import linear_step  # noqa: E402
import quantize_bandwidth  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    failures = 0
    failures += quantize_bandwidth.main(["--out", str(args.out)]) != 0
    failures += linear_step.main(["--out", str(args.out), "--torchao", "--rounds", "3",
                                  "--cuda-graph", "fp8-current,fp8-delayed"]) != 0
    failures += gpt_step.main(["--out", str(args.out), "--single-thread-backward", "both"]) != 0
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
