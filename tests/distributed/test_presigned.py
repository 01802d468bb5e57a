"""distributed/presigned.py: FSDP2 reads the hook's signature through inspect at every gather."""

from __future__ import annotations

import inspect

import torch

import minifloat as mf
from minifloat.distributed.fsdp import LowPrecisionGatherWeight
from minifloat.distributed.presigned import presigned


class Hooked:
    @presigned
    def hook(self, mesh, outer_size, outer_stride, module, mp_policy):
        """What FSDP2 calls."""
        return self, mesh, mp_policy


def test_the_bound_hook_calls_the_method_and_carries_its_bound_signature():
    hooked = Hooked()
    signature = inspect.signature(hooked.hook)
    assert list(signature.parameters) == ["mesh", "outer_size", "outer_stride", "module",
                                          "mp_policy"]
    assert hooked.hook(1, 2, 3, 4, mp_policy=5) == (hooked, 1, 5)
    assert Hooked.hook.__doc__ == "What FSDP2 calls."
    assert inspect.signature(Hooked.hook).parameters.keys() >= {"self", "mesh"}


def test_fsdp2_sees_five_parameters_on_the_gather_weight():
    """FSDPParam.all_gather_inputs passes all five arguments when it counts five parameters
    (fewer: the old signature, mesh only)."""
    weight = LowPrecisionGatherWeight(
        torch.zeros(32, 16), mf.Float8CurrentScalingQuantizer(torch.float8_e4m3fn), None)
    assert len(inspect.signature(weight.fsdp_pre_all_gather).parameters) == 5
