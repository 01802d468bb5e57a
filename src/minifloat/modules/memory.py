"""What a model's minifloat modules keep from forward to backward: the memory options.

By default a module keeps, for backward, the columnwise copies its backward GEMMs read: the
input's (wgrad) and the weight's (dgrad), quantized in forward together with the rowwise copies
(one cast each). Two options trade a cast in backward for memory:

- `save_original_inputs`: keep the high-precision input instead of its copy (TransformerEngine's
  `save_original_input`). Under torch.compile this is the one that saves memory: the input of
  most GEMMs is a norm's or an activation's output, which inductor's partitioner recomputes in
  backward from what the norm or activation keeps anyway, so nothing input-sized is kept for
  the GEMM at all (torchao's float8 gets its activation memory this way). Eagerly the input is
  kept in 2 bytes where its FP8 copy takes 1: a win only where the input is kept anyway (the
  attention output, which SDPA keeps for its own backward).
- `rebuild_weight_copies_in_backward`: keep no weight copy (torchao's
  force_recompute_fp8_weight_in_bwd); saves a weight-sized FP8 buffer per layer (about 1 GiB a
  billion parameters), and keeps FSDP2's weights sharded between forward and backward.

Both make bit for bit the copies forward would have kept (tests/modules/test_memory_options.py).
Under torch.compile the input option applies to per-tensor FP8 (current and delayed scaling;
input_recast.recasts says why the other formats keep their input copies there) and the weight
option to stateless recipes and plain delayed scaling (the forward op hands forward's scales to
backward: gemm_plans.rebuild_applies).
"""

from __future__ import annotations

from torch import nn

from .base import QuantizedModule


def save_original_inputs(model: nn.Module, enabled: bool = True) -> nn.Module:
    """Set `save_original_input` on every minifloat module of `model` (see the module
    docstring for when it saves memory). Returns the model."""
    for module in model.modules():
        if isinstance(module, QuantizedModule):
            module.save_original_input = enabled
    return model


def rebuild_weight_copies_in_backward(model: nn.Module, enabled: bool = True) -> nn.Module:
    """Make model's minifloat modules keep no weight copy from forward to backward: backward
    quantizes the (FSDP2 re-gathered) weight again for its data gradient, with the bytes the kept
    copy would have had. Why: the copy is a weight-sized buffer per layer alive from forward to
    backward; under FSDP2 it undoes the sharding of the weights (torchao's
    force_recompute_fp8_weight_in_bwd). Costs one columnwise cast per weight in backward.
    distributed.enable_low_precision_all_gather sets it for the weights it wraps."""
    for module in model.modules():
        if isinstance(module, QuantizedModule):
            module.rebuild_weight_copy_in_backward = enabled
    return model
