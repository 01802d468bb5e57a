"""On CUDA, repeated quantizations launch their kernels through kernels/launch.py's direct path.

The direct path skips Triton's per-launch Python (binding, specialisation, cache-key hashing);
it had been silently off on Triton 3.6, whose launch-hook slots are chain objects rather than
None. Here every launch after the first of a key must bypass JITFunction.run (counted by
wrapping it), and the bytes must equal those of a launch through Triton's own path.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_second_quantization_bypasses_triton_run(monkeypatch):
    from triton.runtime import jit

    from minifloat.kernels import launch as launch_module
    from minifloat.kernels import per_tensor_fp8

    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    first = per_tensor_fp8.quantize_current_scaling(x, torch.float8_e4m3fn)  # compiles
    calls = []
    original = jit.JITFunction.run

    def counting_run(self, *args, **kwargs):
        calls.append(self.fn.__name__)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(jit.JITFunction, "run", counting_run)
    again = per_tensor_fp8.quantize_current_scaling(x, torch.float8_e4m3fn)
    torch.cuda.synchronize()
    assert calls == [], f"launches went through Triton's run: {calls}"
    assert launch_module._DIRECT
    for a, b in zip(first, again, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
