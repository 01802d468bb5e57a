"""LayerNormMLP: y = fc2(act(fc1(norm(x)))), the norm and activation in high precision.

Two GEMM layers in one module (num_gemms = 2): GEMM 0 is fc1 (`fc1_weight` [F1, H], `fc1_bias`)
and GEMM 1 is fc2 (`fc2_weight` [H, F], `fc2_bias`), where F = ffn_hidden_size and F1 = F, or 2F
for the gated activations. Each GEMM runs through run_gemms on its own slots, exactly as a Linear
would: its input quantized once (rowwise for fprop, columnwise kept for wgrad), its gradient
quantized in backward in the directions dgrad and wgrad need.

Roles (seed 001): QuantizerRole has a single `name`, so the module carries two, `fc1_name` and
`fc2_name` (default "<name>.fc1" / "<name>.fc2", or "fc1" / "fc2" without a name), and each
GEMM's slots use its own. The boundary inside the module is labelled by its consumer, like every
output: fc1's output slot carries fc2's input role, and fc2's grad_input slot fc1's grad_output
role. Only the module's outer edges (fc2's output, fc1's grad_input) follow set_consumer_roles.

Gated activations (swiglu, geglu): fc1's output is split in two halves along the last dim,
[a, g] = chunk(fc1(x), 2), and the activation is act(a) * g: the FIRST half goes through the
nonlinearity (SiLU for swiglu, GELU for geglu), the second is the linear gate. This is Transformer
Engine's convention, so its checkpoints map row for row onto fc1_weight.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ..distributed.tensor_parallel import TensorParallelConfig
from ..recipes import QuantizerRole
from .base import QuantizedModule
from .layernorm_linear import apply_norm, check_normalization, new_norm_parameters, rows_of
from .parallel_gemm import parallel_gemm, sequence_parallel_norm_params


def gelu(x: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation (GPT-2's and Transformer Engine's "gelu")."""
    return F.gelu(x, approximate="tanh")


# name -> (nonlinearity, gated)
ACTIVATIONS: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], bool]] = {
    "gelu": (gelu, False),
    "relu": (F.relu, False),
    "swiglu": (F.silu, True),
    "geglu": (gelu, True),
}


def apply_activation(h: torch.Tensor, activation: str) -> torch.Tensor:
    """act(h), or act(first half) * second half for a gated activation (module docstring)."""
    function, gated = ACTIVATIONS[activation]
    if not gated:
        return function(h)
    first, second = h.chunk(2, dim=-1)
    return function(first) * second


class LayerNormMLP(QuantizedModule):
    """norm -> fc1 -> activation -> fc2, with both linears' GEMMs in the autocast recipe's
    formats and the norm and activation in high precision.

    Parameters: `layer_norm_weight`, `layer_norm_bias` (LayerNorm only), `fc1_weight`,
    `fc1_bias`, `fc2_weight`, `fc2_bias`. Outside autocast it is the same computation in plain
    torch ops (quantized weights dequantized). Under quantized_model_init both weights are
    QuantizedTensors, each in the format of its own GEMM's weight slot.
    """

    num_gemms = 2

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        bias: bool = True,
        normalization: str = "LayerNorm",
        activation: str = "gelu",
        eps: float = 1e-5,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        name: str | None = None,
        fc1_name: str | None = None,
        fc2_name: str | None = None,
        zero_centered_gamma: bool = False,
        tp_group: Any = None,
        tp_size: int = 1,
        set_parallel_mode: bool = False,
        sequence_parallel: bool = False,
        tp_amax_reduction: bool = True,
    ) -> None:
        check_normalization(normalization)
        if activation not in ACTIVATIONS:
            raise ValueError(
                f"activation must be one of {tuple(ACTIVATIONS)}, got {activation!r}")
        super().__init__(name)
        # TE's set_parallel_mode: fc1 column-parallel, fc2 row-parallel over the group
        self.tp = TensorParallelConfig(tp_group, tp_size,
                                       "column" if set_parallel_mode else None,
                                       sequence_parallel, tp_amax_reduction)
        local_ffn = (self.tp.shard(ffn_hidden_size, "ffn_hidden_size") if self.tp.active
                     else ffn_hidden_size)
        prefix = f"{self.name}." if self.name else ""
        # set before any weight: quantized_model_init builds quantizers from the roles
        self.fc1_name = fc1_name if fc1_name is not None else f"{prefix}fc1"
        self.fc2_name = fc2_name if fc2_name is not None else f"{prefix}fc2"
        self.hidden_size, self.ffn_hidden_size = hidden_size, ffn_hidden_size
        self.normalization, self.activation, self.eps = normalization, activation, eps
        self.zero_centered_gamma = zero_centered_gamma
        self.use_bias = bias
        gated = ACTIVATIONS[activation][1]
        fc1_out = 2 * local_ffn if gated else local_ffn
        dtype = params_dtype or torch.get_default_dtype()
        new_norm_parameters(self, hidden_size, normalization, zero_centered_gamma, dtype, device)
        self.fc1_weight = self.new_weight(fc1_out, hidden_size, dtype, device, gemm=0)
        self.fc1_bias = self.new_bias(fc1_out, hidden_size, dtype, device) if bias else None
        self.fc2_weight = self.new_weight(hidden_size, local_ffn, dtype, device, gemm=1)
        self.fc2_bias = (self.new_bias(hidden_size, ffn_hidden_size, dtype, device)
                         if bias else None)
        # keep_high_precision_copy: base names the copies by GEMM index; name them by parameter
        for gemm, layer in enumerate(("fc1", "fc2")):
            copy = self.__dict__.pop(f"weight{gemm}_hp_init", None)
            if copy is not None:
                setattr(self, f"{layer}_weight_hp_init", copy)

    def set_tensor_parallel_group(self, tp_group: Any) -> None:
        """Set (or set again, after unpickling) the tensor-parallel process group."""
        self.tp.set_group(tp_group)

    # ---- roles ----

    def gemm_name(self, gemm: int) -> str:
        return self.fc1_name if gemm == 0 else self.fc2_name

    def output_role(self, gemm: int) -> QuantizerRole:
        """fc1's output is fc2's input; fc2's output goes to the module's consumer."""
        if gemm == 0:
            return QuantizerRole(self.module_type, "input", self.fc2_name)
        return super().output_role(gemm)

    def grad_input_role(self, gemm: int) -> QuantizerRole:
        """fc2's grad_input is fc1's grad_output; fc1's goes to the module's producer."""
        if gemm == 1:
            return QuantizerRole(self.module_type, "grad_output", self.fc1_name)
        return super().grad_input_role(gemm)

    # ---- forward ----

    def _state_device(self) -> torch.device:
        return self.layer_norm_weight.device

    def forward(self, x: torch.Tensor, is_first_microbatch: bool | None = None) -> torch.Tensor:
        """Norm, fc1, activation, fc2; `is_first_microbatch` as in TransformerEngine."""
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"LayerNormMLP expects inputs with last dim {self.hidden_size}, "
                             f"got shape {tuple(x.shape)}")
        if self.tp.active:
            return self._forward_tensor_parallel(x, is_first_microbatch)
        normed = apply_norm(x, self.layer_norm_weight, self.layer_norm_bias, self.normalization,
                            self.eps, self.zero_centered_gamma)
        rows = rows_of(normed)
        h = self.run_gemms(normed, [rows], [self.fc1_weight], [self.fc1_bias], gemms=[0],
                           is_first_microbatch=is_first_microbatch)
        a = apply_activation(h, self.activation)
        return self.run_gemms(a, [rows], [self.fc2_weight], [self.fc2_bias], gemms=[1],
                              is_first_microbatch=is_first_microbatch)

    def _forward_tensor_parallel(self, x: torch.Tensor, is_first_microbatch: bool | None
                                 ) -> torch.Tensor:
        """fc1 column-parallel (a gated fc1 holds this rank's slice of each half), the
        activation on the local features, fc2 row-parallel (distributed/tensor_parallel.py)."""
        norm_weight, norm_bias = sequence_parallel_norm_params(
            self.tp, self.layer_norm_weight, self.layer_norm_bias)
        normed = apply_norm(x, norm_weight, norm_bias, self.normalization, self.eps,
                            self.zero_centered_gamma)
        h = parallel_gemm(self, self.tp, "column", normed, self.fc1_weight, self.fc1_bias, 0,
                          is_first_microbatch)
        a = apply_activation(h, self.activation)
        return parallel_gemm(self, self.tp, "row", a, self.fc2_weight, self.fc2_bias, 1,
                             is_first_microbatch)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, "
                f"bias={self.use_bias}, normalization={self.normalization}, "
                f"activation={self.activation}, eps={self.eps}, "
                f"zero_centered_gamma={self.zero_centered_gamma}, name={self.name!r}, "
                f"fc1_name={self.fc1_name!r}, fc2_name={self.fc2_name!r}")
