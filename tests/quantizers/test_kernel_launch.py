"""kernels/launch.py: which launches take the direct path, and what they pass (CPU, no Triton).

The direct path reuses a CompiledKernel per specialization. Its risk is a wrong reuse, so the
tests pin the key (tensor dtype and alignment, integer value classes, constexprs, options,
warps) and the call it makes (runtime arguments, then the trailing constexprs in signature
order, the grid padded to three), with a fake kernel standing in for Triton's.
"""

from __future__ import annotations

import pytest
import torch

from minifloat.kernels import launch as launch_module


class FakeCompiled:
    function = "function-handle"
    packed_metadata = "packed"

    def __init__(self, log: list, fail: bool = False) -> None:
        self.log, self.fail = log, fail

    def run(self, *call):
        if self.fail:
            raise TypeError("launcher signature changed")
        self.log.append(("direct", call))


class FakeKernel:
    """Stands in for a JITFunction: `kernel[grid](...)` records the call, returns a compiled."""

    arg_names = ["x_ptr", "n", "BLOCK", "FLAG"]

    def __init__(self, fail_direct: bool = False) -> None:
        self.log: list = []
        self.fail_direct = fail_direct

    def __getitem__(self, grid):
        def standard(*args, **kwargs):
            self.log.append(("standard", grid, args, kwargs))
            return FakeCompiled(self.log, self.fail_direct)
        return standard


@pytest.fixture
def direct(monkeypatch):
    """Pretend the arguments are CUDA tensors on device 0 with no launch hooks."""
    monkeypatch.setattr(launch_module, "_direct_allowed", lambda kernel, args: True)
    monkeypatch.setattr(launch_module, "_DIRECT", True)
    monkeypatch.setattr(launch_module, "_COMPILED", {})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 1234,
                        raising=False)


def test_argument_key_separates_what_triton_specialises_on():
    base = torch.zeros(64, dtype=torch.uint8)
    key = launch_module._argument_key
    assert key(base) != key(base[1:])  # 16-byte alignment
    assert key(base) != key(base.view(torch.int8))  # dtype
    assert key(1) != key(2) and key(16) != key(17) and key(32) == key(48)
    assert key(2**31 - 16) != key(2**31 + 16)  # 32- vs 64-bit integers
    assert key(True) != key(1) and key(0.5) == key(2.5)


def test_first_launch_compiles_then_later_launches_go_direct(direct):
    kernel = FakeKernel()
    x = torch.zeros(32)
    for _ in range(3):
        launch_module.launch(kernel, (5,), x, 32, BLOCK=128, FLAG=True, num_warps=4,
                             options={"enable_fp_fusion": False})
    kinds = [entry[0] for entry in kernel.log]
    assert kinds == ["standard", "direct", "direct"]
    _, grid, args, kwargs = kernel.log[0]
    assert grid == (5,) and args[1] == 32
    assert kwargs == {"num_warps": 4, "enable_fp_fusion": False, "BLOCK": 128, "FLAG": True}
    call = kernel.log[1][1]
    assert call[:7] == (5, 1, 1, 1234, "function-handle", "packed", None)
    assert call[9] is x and call[10:] == (32, 128, True)  # runtime args, then constexprs


def test_a_new_specialisation_compiles_again(direct):
    kernel = FakeKernel()
    x = torch.zeros(64, dtype=torch.uint8)
    launch_module.launch(kernel, (1,), x, 32, BLOCK=128, FLAG=True)
    launch_module.launch(kernel, (1,), x[1:], 32, BLOCK=128, FLAG=True)  # misaligned
    launch_module.launch(kernel, (1,), x, 33, BLOCK=128, FLAG=True)  # not divisible by 16
    launch_module.launch(kernel, (1,), x, 32, BLOCK=64, FLAG=True)  # another constexpr
    launch_module.launch(kernel, (1,), x, 32, BLOCK=128, FLAG=True, num_warps=8)
    assert [entry[0] for entry in kernel.log] == ["standard"] * 5
    launch_module.launch(kernel, (1,), x, 48, BLOCK=128, FLAG=True)  # same class as 32
    assert kernel.log[-1][0] == "direct"


def test_a_parameter_left_to_its_default_never_goes_direct(direct):
    """The direct call passes every parameter; one the caller left to the kernel's default
    would be missing, so such launches stay on Triton's path."""
    kernel = FakeKernel()
    x = torch.zeros(8)
    for _ in range(2):
        launch_module.launch(kernel, (1,), x, 32, BLOCK=128)  # FLAG left to its default
    assert [entry[0] for entry in kernel.log] == ["standard", "standard"]


def test_positional_constexprs_are_passed_in_order(direct):
    kernel = FakeKernel()
    x = torch.zeros(8)
    for _ in range(2):
        launch_module.launch(kernel, (1,), x, 32, 128, FLAG=True)  # BLOCK given positionally
    assert [entry[0] for entry in kernel.log] == ["standard", "direct"]
    assert kernel.log[1][1][10:] == (32, 128, True)


def test_a_failing_direct_call_falls_back_and_turns_the_path_off(direct):
    kernel = FakeKernel(fail_direct=True)
    x = torch.zeros(8)
    launch_module.launch(kernel, (1,), x, 32, BLOCK=128, FLAG=True)
    launch_module.launch(kernel, (1,), x, 32, BLOCK=128, FLAG=True)
    assert [entry[0] for entry in kernel.log] == ["standard", "standard"]
    assert launch_module._DIRECT is False


def test_cpu_tensors_take_tritons_own_path(monkeypatch):
    monkeypatch.setattr(launch_module, "_COMPILED", {})
    kernel = FakeKernel()
    x = torch.zeros(8)
    for _ in range(2):
        launch_module.launch(kernel, (2, 3), x, 32, BLOCK=128, FLAG=False, num_warps=2)
    assert [entry[0] for entry in kernel.log] == ["standard", "standard"]
    assert not launch_module._COMPILED


class HookChainLike:
    """Triton >= 3.6 keeps launch hooks in a chain object that is never None."""

    def __init__(self, calls: list) -> None:
        self.calls = calls


def test_empty_hook_chain_counts_as_no_hook():
    # an `is None` test alone took every launch off the direct path on Triton 3.6
    assert launch_module._no_hook(None)
    assert launch_module._no_hook(HookChainLike([]))
    assert not launch_module._no_hook(HookChainLike([print]))
    assert not launch_module._no_hook(print)
