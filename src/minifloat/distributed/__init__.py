"""minifloat on torch.distributed: FSDP2 low-precision all-gather and master-weight casts for
ZeRO-style distributed optimizers.

FSDP2 (`torch.distributed.fsdp.fully_shard`) with high-precision sharded parameters needs
nothing from here: FSDP2 gathers the weights and minifloat quantizes after the gather
(tests/distributed/test_fsdp2.py); `rebuild_weight_copies_in_backward(model)` keeps the
weights sharded between forward and backward (no full-size weight copy kept for dgrad).
Delayed scaling reduces its amaxes over `minifloat.autocast(amax_reduction_group=...)`.
"""

from ..modules.memory import rebuild_weight_copies_in_backward
from .collective_bytes import count_collective_bytes
from .fsdp import LowPrecisionGatherWeight, enable_low_precision_all_gather
from .master_weights import (
    cast_master_weights_to_nvfp4,
    post_all_gather_processing,
    quantize_master_weights,
)
from .process_group import destroy_process_group
from .shard_state_dict import high_precision_state_dict

__all__ = [
    "LowPrecisionGatherWeight",
    "cast_master_weights_to_nvfp4",
    "count_collective_bytes",
    "destroy_process_group",
    "enable_low_precision_all_gather",
    "high_precision_state_dict",
    "post_all_gather_processing",
    "quantize_master_weights",
    "rebuild_weight_copies_in_backward",
]
