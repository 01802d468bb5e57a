"""The distributed code on one GPU under NCCL (world size 1): what a single-GPU machine can check
before a several-GPU one is lent (issue 18).

FSDP2 with the low-precision all-gather (the Triton kernels quantize the shards, NCCL gathers
the bytes) must train bitwise like FSDP2 gathering high-precision weights; quantized_model_init
weights sharded as bytes and updated through quantize_master_weights must train bitwise like
the same model updated the same way without FSDP2. With one rank the collectives are copies, so
these check the CUDA side of the hooks, the wrappers and the casts, not the communication.
"""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
from torch import nn

import minifloat as mf
from minifloat.distributed import (
    destroy_process_group,
    enable_low_precision_all_gather,
    post_all_gather_processing,
    quantize_master_weights,
)
from train_steps import loss_step

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

RECIPES = {
    "current": mf.Float8CurrentScaling,
    "block": mf.Float8BlockScaling,
    "mxfp8": mf.MXFP8BlockScaling,
    "nvfp4": lambda: mf.NVFP4BlockScaling(disable_stochastic_rounding=True),
}
HIDDEN, ROWS, STEPS = 256, 128, 3


@pytest.fixture(scope="module")
def nccl_group():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1)
    yield
    destroy_process_group()


def _shard(model: nn.Module) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cuda", (1,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _batches() -> list[torch.Tensor]:
    generator = torch.Generator(device="cuda").manual_seed(1)
    return [torch.randn(ROWS, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=generator)
            for _ in range(STEPS)]


def _train_gathering(name: str, low_precision: bool) -> list[torch.Tensor]:
    recipe = RECIPES[name]()
    torch.manual_seed(0)
    model = nn.Sequential(mf.LayerNormMLP(HIDDEN, 2 * HIDDEN, normalization="RMSNorm",
                                          params_dtype=torch.bfloat16, device="cuda"),
                          mf.Linear(HIDDEN, HIDDEN, params_dtype=torch.bfloat16, device="cuda"))
    if low_precision:
        enable_low_precision_all_gather(model, recipe)
    _shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    results = []
    for x in _batches():
        with mf.autocast(recipe=recipe):
            loss = model(x).float().pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        results.append(loss.detach())
    for value in model.state_dict().values():
        if not isinstance(value, torch.Tensor):
            continue  # a module's _extra_state (recipe state)
        full = value.full_tensor()
        results.append(getattr(full, "_inner", full).clone())
    return results


@pytest.mark.parametrize("name", list(RECIPES))
def test_low_precision_gather_trains_like_high_precision_bitwise(nccl_group, name):
    high = _train_gathering(name, False)
    low = _train_gathering(name, True)
    for index, (a, b) in enumerate(zip(low, high, strict=True)):
        assert torch.equal(a, b), f"{name} result {index}"


def _train_quantized_weights(name: str, sharded: bool) -> list[torch.Tensor]:
    recipe = RECIPES[name]()
    torch.manual_seed(0)
    with mf.quantized_model_init(recipe=recipe, keep_high_precision_copy=True):
        model = nn.Sequential(mf.Linear(HIDDEN, HIDDEN, bias=False, device="cuda"),
                              mf.Linear(HIDDEN, HIDDEN, bias=False, device="cuda"))
    masters = [layer.weight_hp_init.float().reshape(-1).clone() for layer in model]
    if sharded:
        enable_low_precision_all_gather(model, recipe)
        _shard(model)
    weights = [layer.weight for layer in model]
    optimizer = torch.optim.SGD(masters, lr=0.5)
    results = []
    for x in _batches():
        with mf.autocast(recipe=recipe):
            loss = model(x.float()).float().pow(2).mean()
        loss.backward()
        for master, weight in zip(masters, weights, strict=True):
            grad = weight.grad.to_local() if sharded else weight.grad
            master.grad = grad.float().reshape(-1)
            weight.grad = None
        optimizer.step()
        quantize_master_weights(weights, masters, [0, 0],
                                group=dist.group.WORLD if sharded else None)
        if not sharded:
            post_all_gather_processing(weights)
        results.append(loss.detach())
    return results + masters


@pytest.mark.parametrize("name", list(RECIPES))
def test_quantized_weights_sharded_as_bytes_train_like_unsharded_bitwise(nccl_group, name):
    sharded = _train_quantized_weights(name, True)
    plain = _train_quantized_weights(name, False)
    for index, (a, b) in enumerate(zip(sharded, plain, strict=True)):
        assert torch.equal(a, b), f"{name} result {index}"


def _train_stepping(name: str, graphed: bool) -> list[torch.Tensor]:
    """Seven FSDP2 steps with FP8 all-gather and a capturable fused AdamW, eager or through
    make_graphed_step (two warm-up steps, the capture, four replays), with an eager forward
    before each of the last two."""
    recipe = RECIPES[name]()
    torch.manual_seed(0)
    model = nn.Sequential(mf.LayerNormMLP(HIDDEN, 2 * HIDDEN, normalization="RMSNorm",
                                          params_dtype=torch.bfloat16, device="cuda"),
                          mf.Linear(HIDDEN, HIDDEN, params_dtype=torch.bfloat16, device="cuda"))
    enable_low_precision_all_gather(model, recipe)
    _shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True, capturable=True)
    step = loss_step(model, optimizer, recipe)
    run = mf.make_graphed_step(step) if graphed else step
    generator = torch.Generator(device="cuda").manual_seed(2)

    def batch() -> torch.Tensor:
        return torch.randn(ROWS, HIDDEN, device="cuda", dtype=torch.bfloat16,
                           generator=generator)

    results = [run(batch()).clone() for _ in range(5)]
    # eager forwards between replays (evaluations) gather the weights the last replay's
    # optimizer step made: the second one would read the first one's cached casts unless a
    # replay marks them stale (minifloat.optimizer_steps)
    probe = batch()
    for _ in range(2):
        with torch.no_grad(), mf.autocast(recipe=recipe):
            results.append(model(probe).clone())
        results.append(run(batch()).clone())
    for value in model.state_dict().values():
        if isinstance(value, torch.Tensor):
            full = value.full_tensor()
            results.append(getattr(full, "_inner", full).clone())
    return results


@pytest.mark.parametrize("name", list(RECIPES))
def test_a_graphed_fsdp2_step_trains_like_eager_bitwise(nccl_group, name):
    """The whole step captured (FSDP2's gathers and reduce-scatters, the batched FP8 weight
    casts, the optimizer) replays the eager step's bytes: losses, an eager forward after the
    replays, weights."""
    graphed = _train_stepping(name, True)
    eager = _train_stepping(name, False)
    for index, (a, b) in enumerate(zip(graphed, eager, strict=True)):
        assert torch.equal(a, b), f"{name} result {index}"


def test_the_trainer_graphs_its_steps(nccl_group, capsys):
    """`python -m minifloat.lab.train --graph-step`: the captured steps train as the eager
    ones do. Not bitwise: the captured AdamW is the capturable one, whose bias corrections are
    device tensors (the eager trainer's are Python floats); a replay that missed the optimizer
    step or read stale weights would leave the trajectory by far more than 1%."""
    from minifloat.lab import train

    def losses(*extra: str) -> list[float]:
        argv = ["--preset", "tiny", "--steps", "8", "--lr", "1e-2", "--recipe", "fp8-current",
                "--mode", "lp", *extra]
        assert train.main(argv) == 0
        return [float(line.split()[-1]) for line in capsys.readouterr().out.splitlines()
                if line.startswith("step ")]

    eager, graphed = losses(), losses("--graph-step")
    assert len(eager) == len(graphed) == 8
    assert abs(eager[-1] - eager[0]) > 0.05 * eager[0]  # the trajectory moves
    for a, b in zip(graphed, eager, strict=True):
        assert abs(a - b) <= 1e-2 * abs(b), (graphed, eager)
