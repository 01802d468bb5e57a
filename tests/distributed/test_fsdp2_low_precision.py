"""FSDP2 low-precision all-gather (enable_low_precision_all_gather): FP8 current and delayed
scaling, 128x128 block FP8, MXFP8 (rowwise copy gathered for forward, columnwise for backward)
and 2D NVFP4 weights.

Each rank quantizes its rows of a weight (per-tensor and NVFP4 global amaxes all-reduced over
the shard group; shards hold whole scale tiles) and FSDP2 gathers the low-precision bytes. The
gathered weight must be the full weight's quantization, so training must equal the
high-precision all-gather (mode a) bit for bit; the all-gather must move at most 0.55x the
bytes of a bf16 one for FP8 and 0.3x for NVFP4; no process group may stay on a quantizer.
"""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.distributed as dist
from torch import nn

import minifloat as mf
from minifloat.distributed import count_collective_bytes, enable_low_precision_all_gather

from .launch import cpu_randn, device_mesh, run_ranks

WORLD = 2
HIDDEN = 256
RECIPES = {
    "current": lambda: mf.Float8CurrentScaling(),
    "delayed": lambda: mf.DelayedScaling(amax_history_len=1),  # the scale follows each step
    "block": lambda: mf.Float8BlockScaling(),
    "mxfp8": lambda: mf.MXFP8BlockScaling(),
    "nvfp4": lambda: mf.NVFP4BlockScaling(disable_stochastic_rounding=True),
    # hybrid weights (seed 000): the rowwise copy in the fprop format, the columnwise copy in
    # the dgrad format, each gathered in its own (hybrid_gather.py)
    "hybrid-mxfp8-nvfp4": lambda: mf.HybridRecipe(
        fprop=mf.MXFP8BlockScaling(),
        dgrad=mf.NVFP4BlockScaling(disable_stochastic_rounding=True),
        wgrad=mf.NVFP4BlockScaling(disable_stochastic_rounding=True)),
    "hybrid-current-block": lambda: mf.HybridRecipe(
        fprop=mf.Float8CurrentScaling(), dgrad=mf.Float8BlockScaling(),
        wgrad=mf.Float8CurrentScaling()),
}
BYTE_BOUND = {"current": 0.55, "delayed": 0.55, "block": 0.55, "mxfp8": 0.55, "nvfp4": 0.3,
              "hybrid-mxfp8-nvfp4": 0.55, "hybrid-current-block": 0.55}


class Stack(nn.Sequential):
    """Every module kind whose weights can be gathered quantized; the experts take halves."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for child in self:
            if isinstance(child, mf.GroupedLinear):
                x = child(x, [x.shape[0] // 2, x.shape[0] - x.shape[0] // 2])
            else:
                x = child(x)
        return x


def build(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return Stack(
        mf.LayerNormLinear(HIDDEN, HIDDEN, normalization="RMSNorm", name="qkv",
                           params_dtype=dtype),
        mf.Linear(HIDDEN, HIDDEN, name="proj", params_dtype=dtype),
        mf.LayerNormMLP(HIDDEN, HIDDEN, normalization="RMSNorm", name="mlp",
                        params_dtype=dtype),
        mf.GroupedLinear(2, HIDDEN, HIDDEN, name="experts", params_dtype=dtype))


def shard(model: nn.Module, world_size: int, sharding: str = "each") -> None:
    """each: every child a unit, resharded after forward; kept: every child a unit that keeps
    its gathered weights for backward (reshard_after_forward=False); root: the model as the
    only unit (FSDP2 does not reshard a root after forward)."""
    from torch.distributed.fsdp import fully_shard

    mesh = device_mesh((world_size,))
    if sharding != "root":
        for child in model:
            fully_shard(child, mesh=mesh, reshard_after_forward=sharding == "each")
    fully_shard(model, mesh=mesh)


def train_worker(rank: int, world_size: int, name: str, low_precision: bool,
                 sharding: str = "each") -> dict:
    recipe = RECIPES[name]()
    model = build()
    if low_precision:
        enable_low_precision_all_gather(model, recipe)
    shard(model, world_size, sharding)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(3):
        x = cpu_randn(world_size * 64, HIDDEN, generator=generator).chunk(world_size)[rank]
        # delayed scaling: both modes reduce their amax histories over the ranks, so the
        # gathered weight's scale comes from the whole weight's amax, as it does in mode a
        with mf.autocast(recipe=recipe, amax_reduction_group=dist.group.WORLD):
            loss = model(x).float().pow(2).mean()
        loss.backward()
        # what forward slots hold between steps: a backward re-gather must not record there
        pending = [state.amax_history[0].clone() for module in model
                   for state in module.recipe_states(recipe)[:1] if name == "delayed"]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach().clone())
    mf.update_delayed_backward_scales()
    params = {}
    for key, value in model.state_dict().items():
        if not isinstance(value, torch.Tensor):
            continue  # a module's _extra_state (recipe state)
        full = value.full_tensor()
        params[key] = getattr(full, "_inner", full).clone()
    kept = [parameter.to_local()._quantizer for parameter in model.parameters()
            if low_precision and parameter.dim() == 2]
    return {"losses": losses, "params": params, "pending": pending,
            "groups": [q.amax_reduction_group for q in kept],
            "pickled": pickle.dumps(kept)}


def modes_worker(rank: int, world_size: int, name: str) -> dict:
    """Both gathers (high and low precision) of one recipe in one launch of the ranks
    (spawning is the slow part of these tests): training, and the bytes of one step."""
    return {"train": {low: train_worker(rank, world_size, name, low) for low in (False, True)},
            "bytes": {low: bytes_worker(rank, world_size, name, low) for low in (False, True)}}


@pytest.mark.parametrize("name", list(RECIPES))
def test_low_precision_gather_trains_like_high_precision_and_moves_fewer_bytes(name):
    results = run_ranks(modes_worker, WORLD, name, timeout=240)
    for rank in range(WORLD):
        high, low = results[rank]["train"][False], results[rank]["train"][True]
        for step, (a, b) in enumerate(zip(low["losses"], high["losses"], strict=True)):
            assert torch.equal(a, b), f"rank {rank} step {step}"
        for key, value in high["params"].items():
            assert torch.equal(low["params"][key], value), f"rank {rank} {key}"
        for a, b in zip(low["pending"], high["pending"], strict=True):
            assert torch.equal(a, b), f"rank {rank}: amaxes recorded between steps"
        assert low["groups"] == [None] * 6  # seed 003: no group kept
        assert len(pickle.loads(low["pickled"])) == 6
    high_bytes, low_bytes = results[0]["bytes"][False], results[0]["bytes"][True]
    assert high_bytes > 0
    assert low_bytes <= BYTE_BOUND[name] * high_bytes, (low_bytes, high_bytes)


def one_rank_worker(rank: int, world_size: int, names: list[str]) -> dict:
    return {name: {low: train_worker(rank, world_size, name, low) for low in (False, True)}
            for name in names}


def test_one_rank_gathers_the_scales_too():
    """At world size 1 FSDP2 copies only the first all-gather input (no all-gather runs), so
    the formats with scales pack theirs with the bytes (fsdp.packed_for_one_rank). Found on one
    GPU under NCCL; gloo takes the same FSDP2 path."""
    names = ["block", "mxfp8", "nvfp4"]
    results = run_ranks(one_rank_worker, 1, names, timeout=240)[0]
    for name in names:
        high, low = results[name][False], results[name][True]
        for step, (a, b) in enumerate(zip(low["losses"], high["losses"], strict=True)):
            assert torch.equal(a, b), f"{name} step {step}"
        for key, value in high["params"].items():
            assert torch.equal(low["params"][key], value), f"{name} {key}"


def bytes_worker(rank: int, world_size: int, name: str, low_precision: bool) -> int:
    """Bytes this rank feeds into FSDP2's all-gathers over one step, bf16 parameters."""
    recipe = RECIPES[name]()
    model = build(torch.bfloat16)
    if low_precision:
        enable_low_precision_all_gather(model, recipe)
    shard(model, world_size)
    with count_collective_bytes() as moved:
        x = torch.randn(64, HIDDEN, dtype=torch.bfloat16)
        with mf.autocast(recipe=recipe):
            model(x).float().pow(2).mean().backward()
    return moved["all_gather_input_bytes"]


CUT_TILE_CASES = {  # out_features over 2 ranks: each shard ends inside a scale tile
    "block": (mf.Float8BlockScaling, 128, 192),  # 96 rows a rank, 128-row tiles
    "nvfp4": (lambda: mf.NVFP4BlockScaling(disable_stochastic_rounding=True), 64, 48),  # 24 / 16
}


def cut_tile_worker(rank: int, world_size: int, name: str) -> list[bool]:
    """Shards that cut scale tiles: the gathered weight (bytes and scales) must equal the full
    weight's quantization on one rank, over two training steps. The largest values sit in the
    cut tile's rows that the second rank holds, so a tile maximum taken without the reduction
    would give the first rank another scale."""
    recipe_factory, in_features, out_features = CUT_TILE_CASES[name]
    recipe = recipe_factory()
    torch.manual_seed(0)
    layer = mf.Linear(in_features, out_features, name="cut")
    rows = out_features // world_size
    with torch.no_grad():
        layer.weight[rows:rows + 8] *= 50
    model = nn.Sequential(layer)
    enable_low_precision_all_gather(model, recipe)
    shard(model, world_size)
    gathered = []

    def keep(module, args):  # clone now: FSDP2 frees the gathered buffers after use
        storage = module.weight.quantized_storage
        gathered.append({name: getattr(storage, name).clone() for name in storage.tensor_fields()
                         if getattr(storage, name) is not None})

    layer.register_forward_pre_hook(keep)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    same = []
    for step in range(2):
        with mf.autocast(recipe=recipe):
            model(cpu_randn(32, in_features, generator=torch.Generator().manual_seed(step))
                  ).float().pow(2).mean().backward()
        fields = gathered[-1]
        optimizer.zero_grad(set_to_none=True)
        layer.reshard()
        full = layer.weight.full_tensor()
        quantizer = layer.quantizers(recipe)[0][1].copy()
        quantizer.set_usage(rowwise=True, columnwise=False)
        quantizer.internal = True
        reference = quantizer(getattr(full, "_inner", full).detach())
        for field, value in fields.items():
            if field.startswith("rowwise") or field.startswith("amax_rowwise"):
                expected = getattr(reference, field)
                same.append(torch.equal(value.view(torch.uint8) if value.element_size() == 1
                                        else value,
                                        expected.view(torch.uint8) if expected.element_size() == 1
                                        else expected))
        optimizer.step()
    return same


@pytest.mark.parametrize("name", list(CUT_TILE_CASES))
def test_shards_that_cut_scale_tiles_gather_the_full_quantization(name):
    for rank, same in enumerate(run_ranks(cut_tile_worker, WORLD, name, timeout=120)):
        assert same and all(same), f"rank {rank}: {same}"


def kept_worker(rank: int, world_size: int, name: str) -> dict:
    """Weights FSDP2 keeps gathered from forward to backward (no re-gather), both ways."""
    return {sharding: {low: train_worker(rank, world_size, name, low, sharding)["params"]
                       for low in (False, True)} for sharding in ("kept", "root")}


@pytest.mark.parametrize("name", ["mxfp8", "hybrid-mxfp8-nvfp4", "hybrid-current-block"])
def test_weights_kept_gathered_after_forward_train_like_high_precision(name):
    """MXFP8 and hybrid weights gather one direction a gather; kept gathered, they gather both
    at once (kept_gathered.py), else backward finds no columnwise copy."""
    results = run_ranks(kept_worker, WORLD, name, timeout=240)
    for rank in range(WORLD):
        for sharding, modes in results[rank].items():
            for key, value in modes[False].items():
                assert torch.equal(modes[True][key], value), f"rank {rank} {sharding} {key}"


def switch_worker(rank: int, world_size: int) -> str:
    recipe = RECIPES["mxfp8"]()
    model = build()
    enable_low_precision_all_gather(model, recipe)
    shard(model, world_size)
    x = cpu_randn(64, HIDDEN, generator=torch.Generator().manual_seed(rank))
    with mf.autocast(recipe=recipe):
        model(x).float().pow(2).mean().backward()
    model.set_reshard_after_forward(False)
    try:
        with mf.autocast(recipe=recipe):
            model(x)
    except RuntimeError as error:
        return str(error)
    return "no error"


def test_keeping_mxfp8_weights_gathered_after_their_first_gather_is_refused_clearly():
    """FSDP2 keeps the all-gather buffers of a weight's first gather: one direction's."""
    for message in run_ranks(switch_worker, WORLD, timeout=120):
        assert "before the first forward" in message, message


def cut_mxfp8_worker(rank: int, world_size: int, low_precision: bool) -> list[torch.Tensor]:
    """MXFP8 weights of 96 rows over 2 ranks: 48 rows each, so the backward gather's columnwise
    blocks (32 rows) are cut. Two steps; what dgrad computes from that copy (the input
    gradient) and the updated weights must equal the high-precision gather's bit for bit."""
    recipe = mf.MXFP8BlockScaling()
    torch.manual_seed(0)
    layer = mf.Linear(64, 96, name="cut")
    with torch.no_grad():  # the largest values in the far rows of the cut block
        layer.weight[48:56] *= 50
    model = nn.Sequential(layer, mf.Linear(96, 64, name="next"))
    if low_precision:
        enable_low_precision_all_gather(model, recipe)
    shard(model, world_size)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    results = []
    for step in range(2):
        x = cpu_randn(32, 64, generator=torch.Generator().manual_seed(step)).requires_grad_()
        with mf.autocast(recipe=recipe):
            model(x).float().pow(2).mean().backward()
        results.append(x.grad.clone())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    for value in model.state_dict().values():
        if not isinstance(value, torch.Tensor):
            continue  # a module's _extra_state (recipe state)
        full = value.full_tensor()
        results.append(getattr(full, "_inner", full).clone())
    return results


def test_mxfp8_columnwise_blocks_cut_by_shards_train_like_high_precision():
    high = run_ranks(cut_mxfp8_worker, WORLD, False, timeout=120)
    low = run_ranks(cut_mxfp8_worker, WORLD, True, timeout=120)
    for rank in range(WORLD):
        for index, (a, b) in enumerate(zip(low[rank], high[rank], strict=True)):
            assert torch.equal(a, b), f"rank {rank}, result {index}"


def uneven_worker(rank: int, world_size: int) -> None:
    model = nn.Sequential(mf.Linear(64, 33, name="uneven"))  # 33 rows over 2 ranks
    enable_low_precision_all_gather(model, mf.Float8CurrentScaling())
    shard(model, world_size)
    with mf.autocast(recipe=mf.Float8CurrentScaling()):
        model(torch.randn(16, 64))


def test_uneven_shards_are_refused_clearly():
    with pytest.raises(RuntimeError, match="shard a weight evenly"):
        run_ranks(uneven_worker, WORLD, timeout=120)


def nvfp4_1d(role):
    return mf.NVFP4Quantizer(with_2d_quantization=False)


def test_other_weight_formats_are_refused_clearly():
    with pytest.raises(NotImplementedError, match="NVFP4Quantizer"):  # 1D (activation) NVFP4
        enable_low_precision_all_gather(build(), mf.CustomRecipe(nvfp4_1d))
    with pytest.raises(NotImplementedError, match="delayed-scaling direction"):
        enable_low_precision_all_gather(build(), mf.HybridRecipe(
            fprop=mf.Float8CurrentScaling(), dgrad=mf.DelayedScaling(),
            wgrad=mf.Float8CurrentScaling()))
    model = build()
    enable_low_precision_all_gather(model, mf.Float8CurrentScaling())
    with pytest.raises(TypeError, match="already"):
        enable_low_precision_all_gather(model, mf.Float8CurrentScaling())


def two_groups_worker(rank: int, world_size: int) -> list[bool]:
    """Two modules sharded over two different groups of a 2x2 mesh (as two TP groups would be):
    each one's gathered weight must be its full weight's quantization, with its own amax."""
    from torch.distributed.fsdp import fully_shard

    mesh = device_mesh((2, 2), names=("a", "b"))
    torch.manual_seed(0)
    first, second = mf.Linear(HIDDEN, HIDDEN, name="a"), mf.Linear(HIDDEN, HIDDEN, name="b")
    with torch.no_grad():  # the amax sits in the second shard's rows, 3x apart between them
        first.weight[HIDDEN // 2:] *= 10
        second.weight[HIDDEN // 2:] *= 30
    model = nn.Sequential(first, second)
    recipe = mf.Float8CurrentScaling()
    enable_low_precision_all_gather(model, recipe)
    fully_shard(first, mesh=mesh["a"])
    fully_shard(second, mesh=mesh["b"])
    gathered = {}

    def keep(module, args):
        storage = module.weight.quantized_storage
        gathered[module.name] = (storage.data.clone(), storage.scale_inv.clone())

    for module in model:
        module.register_forward_pre_hook(keep)
    with mf.autocast(recipe=recipe):
        model(torch.randn(64, HIDDEN))
    same = []
    for module in model:
        module.reshard()  # a root keeps its gathered weight after forward
        full = module.weight.full_tensor()
        reference = mf.Float8CurrentScalingQuantizer(torch.float8_e4m3fn, internal=True)(
            getattr(full, "_inner", full))
        data, scale_inv = gathered[module.name]
        same.append(torch.equal(data.view(torch.uint8), reference.data.view(torch.uint8))
                    and torch.equal(scale_inv, reference.scale_inv))
    return same


def test_two_modules_on_two_groups_never_override_each_other():
    for rank, same in enumerate(run_ranks(two_groups_worker, 4, timeout=180)):
        assert same == [True, True], f"rank {rank}"


def test_foreach_ops_over_wrapped_shards_run_on_the_inner_tensors():
    """The optimizer's foreach ops take every shard at once; the wrapper unwraps the lists by
    hand (fsdp._unwrapped) and must give what the ops give on the plain tensors, in place too,
    with nested lists and keyword tensors handled as well."""
    from minifloat.distributed.fsdp import LowPrecisionGatherWeight

    quantizer = mf.Float8CurrentScalingQuantizer(torch.float8_e4m3fn)
    # fixed values, no generator: under NCCL runs the default device is cuda:0 (conftest.py)
    plain = [torch.arange(16.0).reshape(4, 4) * (i + 1) - 7.5 for i in range(3)]
    wrapped = [LowPrecisionGatherWeight(t.clone(), quantizer) for t in plain]
    steps = [torch.full((4, 4), 0.5) for _ in range(3)]
    results = torch._foreach_add(wrapped, steps, alpha=2.0)
    for got, want in zip(results, torch._foreach_add(plain, steps, alpha=2.0), strict=True):
        assert type(got) is torch.Tensor and torch.equal(got, want)
    torch._foreach_mul_(wrapped, 3.0)  # in place: the inner tensors change
    for got, want in zip(wrapped, plain, strict=True):
        assert torch.equal(got._inner, want * 3.0)
    out = torch.empty(4, 4)
    torch.add(wrapped[0], wrapped[1], out=out)  # a keyword tensor
    assert torch.equal(out, wrapped[0]._inner + wrapped[1]._inner)
    stacked = torch.stack([wrapped[0], plain[1]])  # one level down, mixed
    assert type(stacked) is torch.Tensor and torch.equal(stacked[0], wrapped[0]._inner)
