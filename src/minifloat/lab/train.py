"""Train the lab GPT with FSDP2 on N processes under a recipe: the distributed example.

    torchrun --nproc-per-node 2 -m minifloat.lab.train --preset tiny --recipe fp8-current
    torchrun --nproc-per-node 4 -m minifloat.lab.train --preset tiny --tp 2   # 2 x 2: FSDP2 x TP

gloo on a CPU machine, NCCL on GPUs (one per process, LOCAL_RANK). Run without torchrun it
trains on one process. Every rank draws the same global batch from the same seed and trains
on its share of the rows; FSDP2 (`fully_shard` per block, then the root) shards the parameters,
gathers them in high precision and minifloat quantizes after the gather (`--mode hp`), or
gathers them quantized (`--mode lp`: FP8 current or delayed, block FP8, MXFP8, NVFP4); either
way no full-size weight copy is kept from forward to backward. Delayed
scaling reduces its amaxes over all ranks. With `--tp N` the ranks form a (world / N) x N
mesh: tensor parallelism over each group of N (heads and MLP features split, the model built
from the one-rank model's weights: models/gpt_parallel.py) inside FSDP2 over the other
dimension. Rank 0 prints the loss averaged over ranks each step.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import time

import torch
import torch.distributed as dist

from ..autocast import autocast, quantized_model_init, update_delayed_backward_scales
from ..distributed import (
    destroy_process_group,
    enable_low_precision_all_gather,
    quantize_master_weights,
    rebuild_weight_copies_in_backward,
)
from ..distributed.fsdp import gemm_weights
from ..models.gpt import GPT, PRESETS
from ..models.gpt_parallel import tensor_parallel_gpt
from ..step_graphs import make_graphed_step
from . import train_checkpoint
from .data import load_corpus, sample_batch
from .recipe_specs import parse_recipe, recipes_help


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="torchrun --nproc-per-node N -m minifloat.lab.train",
        description="Train the lab GPT with FSDP2 under a minifloat recipe.")
    parser.add_argument("--preset", default="tiny", choices=list(PRESETS))
    parser.add_argument("--recipe", default="fp8-current", help=recipes_help())
    parser.add_argument("--mode", default="hp", choices=("hp", "lp", "qw"),
                        help="hp: FSDP2 gathers high-precision weights (minifloat quantizes after "
                             "the gather); lp: FSDP2 gathers them quantized (fp8-current, "
                             "fp8-delayed, fp8-block, mxfp8, nvfp4); qw: the weights are stored "
                             "quantized (quantized_model_init), sharded and gathered as bytes, "
                             "and AdamW steps fp32 master rows cast back with "
                             "quantize_master_weights")
    parser.add_argument("--tp", type=int, default=1,
                        help="tensor-parallel size: ranks per TP group (FSDP2 shards over the "
                             "world / tp groups); --mode hp or lp")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data", default=None, help="a text file or folder (default: the "
                                                     "Python standard library's sources)")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="save a checkpoint there every --checkpoint-every steps "
                             "(torch.distributed.checkpoint, written then renamed)")
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--resume", action="store_true",
                        help="continue from the latest complete checkpoint in --checkpoint-dir "
                             "(none there: start from step 0)")
    parser.add_argument("--graph-step", action="store_true",
                        help="capture each training step (forward, backward, FSDP2's "
                             "collectives, the AdamW step) as one CUDA graph after two eager "
                             "steps (minifloat.make_graphed_step): the Python leaves the step; "
                             "CUDA only, --mode hp or lp, not delayed scaling")
    parser.add_argument("--compile", nargs="?", const="inductor", default=None,
                        metavar="BACKEND",
                        help="compile each block with torch.compile(fullgraph=True) before "
                             "sharding it, as FSDP2 users do (BACKEND: inductor, the default; "
                             "aot_eager runs the traced ops without generating code); with "
                             "--tp the split operands' maxima are reduced inside the graph")
    parser.add_argument("--print-digest", action="store_true",
                        help="print a SHA-256 of the final full weights (rank 0)")
    return parser


def _init_process_group() -> torch.device:
    """From torchrun's environment, or a one-process group when run directly. A default
    group the caller initialized already (its own launcher, a notebook) is used as it is, on
    the current CUDA device."""
    cuda = torch.cuda.is_available()
    if dist.is_initialized():
        return torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if "RANK" not in os.environ:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    local_rank = int(os.environ["LOCAL_RANK"])
    if cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if cuda else "gloo")
    return torch.device("cuda", local_rank) if cuda else torch.device("cpu")


def _mesh(device: torch.device, tp: int):
    """(data-parallel mesh, tensor-parallel group or None): a (world / tp) x tp mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if tp == 1:
        return init_device_mesh(device.type, (world,)), None
    if world % tp:
        raise ValueError(f"--tp {tp} does not divide the {world} processes")
    mesh = init_device_mesh(device.type, (world // tp, tp), mesh_dim_names=("dp", "tp"))
    return mesh["dp"], mesh["tp"].get_group()


def _shard(model: GPT, device: torch.device, mesh) -> None:
    from torch.distributed.fsdp import (
        MixedPrecisionPolicy,
        fully_shard,
        register_fsdp_forward_method,
    )

    # on GPUs the compute copies are bf16 (fp32 master shards); on the CPU everything is fp32
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if device.type == "cuda" else MixedPrecisionPolicy())
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    register_fsdp_forward_method(model, "loss")  # the step calls model.loss, not forward


class MasterWeights:
    """fp32 masters of the quantized weights (each rank's rows, from the initial high-precision
    copies) and the AdamW that steps them, beside the optimizer of the model's other parameters:
    what `--mode qw` trains. Two optimizers, because get_state_dict (checkpoints) maps an
    optimizer's parameters to the model's, and the masters are no model parameters."""

    def __init__(self, model: GPT, rank: int, world: int, mesh, lr: float) -> None:
        self.weights, self.masters, self.starts, self.shapes = [], [], [], []
        self.mesh = mesh
        quantized = set()
        for module in model.modules():
            for name, _ in gemm_weights(module):
                weight = getattr(module, name)
                full = getattr(module, f"{name}_hp_init").float()
                rows = full.shape[0] // world
                self.weights.append(weight)
                self.masters.append(full[rank * rows:(rank + 1) * rows].reshape(-1).clone()
                                    .requires_grad_())
                self.starts.append(rank * rows * full.shape[1])
                self.shapes.append(tuple(full.shape))
                quantized.add(id(weight))
        self.others = [p for p in model.parameters() if id(p) not in quantized]
        self.optimizer = torch.optim.AdamW(self.masters, lr=lr)

    def take_gradients(self) -> None:
        """The FSDP2 gradient shards of the quantized weights, onto their masters."""
        for master, weight in zip(self.masters, self.weights, strict=True):
            master.grad = weight.grad.to_local().float().reshape(-1)
            weight.grad = None

    def step(self) -> None:
        """Step the masters and cast them into the quantized weights."""
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        quantize_master_weights(self.weights, self.masters, self.starts,
                                group=dist.group.WORLD)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Masters and their AdamW state as DTensors of the full weights' shapes, sharded by
        rows like the weights, so DCP saves each rank's rows once and loads them into any
        number of ranks; in place: loading into it loads into the masters."""
        from torch.distributed.tensor import DTensor, Shard

        state = {}
        for index, (master, shape) in enumerate(zip(self.masters, self.shapes, strict=True)):
            slots = self.optimizer.state[master]
            if not slots:  # a fresh run about to load: AdamW's own initial state
                slots.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(master),
                             exp_avg_sq=torch.zeros_like(master))
            for name, value in (("master", master), ("exp_avg", slots["exp_avg"]),
                                ("exp_avg_sq", slots["exp_avg_sq"])):
                rows = value.detach().view(-1, shape[1])
                state[f"{index}.{name}"] = DTensor.from_local(
                    rows, self.mesh, [Shard(0)], run_check=False, shape=shape,
                    stride=(shape[1], 1))
            state[f"{index}.step"] = slots["step"]
        return state


def train(args: argparse.Namespace) -> list[float]:
    """The training loop; returns the rank-averaged loss of every step (on every rank)."""
    device = _init_process_group()
    world = dist.get_world_size()
    config = PRESETS[args.preset]
    if args.tp > 1 and args.mode == "qw":
        raise ValueError("--tp with --mode qw is not written (the master rows of TP shards); "
                         "use --mode hp or lp")
    dp_mesh, tp_group = _mesh(device, args.tp)
    rank, shards = dp_mesh.get_local_rank(), dp_mesh.size()
    if config.batch_size % shards:
        raise ValueError(f"the {shards} data-parallel ranks do not divide the preset's batch "
                         f"of {config.batch_size} sequences; choose a divisor")
    recipe = parse_recipe(args.recipe, config.n_layers)
    torch.manual_seed(args.seed)
    with quantized_model_init(enabled=args.mode == "qw", recipe=recipe,
                              keep_high_precision_copy=True):
        model = GPT(config, device=device)
    if tp_group is not None:  # every rank built the one-rank model: keep its slices
        model = tensor_parallel_gpt(model, tp_group)
    if args.mode in ("lp", "qw"):
        enable_low_precision_all_gather(model, recipe)
    else:  # keep no full-size weight copy from forward to backward: weights stay sharded
        rebuild_weight_copies_in_backward(model)
    if args.compile:  # each block, then its shard: FSDP2's hooks stay outside the graphs
        for block in model.blocks:
            block.compile(backend=args.compile, fullgraph=True)
    _shard(model, device, dp_mesh)
    masters = MasterWeights(model, rank, shards, dp_mesh, args.lr) if args.mode == "qw" else None
    optimizer = torch.optim.AdamW(masters.others if masters else model.parameters(), lr=args.lr,
                                  capturable=args.graph_step)
    # a TP rank's parameters are its slices, saved under keys of its own (checkpoints)
    tp_rank = dist.get_rank(tp_group) if tp_group is not None else None
    corpus = load_corpus(args.data)
    generator = torch.Generator().manual_seed(args.seed)  # the same batches on every rank
    first_step = _resume(args, model, optimizer, generator, tp_rank, masters)
    kill_at = _kill_point()
    current = [first_step]  # the step being taken, for the fault injection

    def train_step(tokens: torch.Tensor) -> torch.Tensor:
        """One step; returns the loss summed over the ranks (all-reduced on the device)."""
        with autocast(enabled=recipe is not None, recipe=recipe,
                      amax_reduction_group=dist.group.WORLD):
            loss = model.loss(tokens)
        if kill_at == (current[0], dist.get_rank()):  # fault injection for the recovery test
            os.kill(os.getpid(), signal.SIGKILL)
        loss.backward()
        if masters is not None:
            masters.take_gradients()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if masters is not None:
            masters.step()
        summed = loss.detach().clone()
        dist.all_reduce(summed)
        return summed

    run = make_graphed_step(train_step) if args.graph_step else train_step
    losses = []
    start = time.perf_counter()
    for step in range(first_step, args.steps):
        current[0] = step
        batch = sample_batch(corpus.train, config.batch_size, config.seq_len, generator)
        tokens = batch.chunk(shards)[rank].to(device)  # TP ranks of a group: the same rows
        losses.append(run(tokens).item() / world)
        if dist.get_rank() == 0:
            print(f"step {step:4d}  loss {losses[-1]:.6f}", flush=True)
        if args.checkpoint_dir and (step + 1) % args.checkpoint_every == 0:
            train_checkpoint.save(args.checkpoint_dir, step + 1, model, optimizer, generator,
                                  tp_rank=tp_rank, masters=masters)
    # the last step's backward amaxes (delayed scaling) are reduced at the next autocast entry;
    # there is none, so reduce them now, while the process group exists
    update_delayed_backward_scales()
    if args.print_digest:
        _print_digest(model)
    if dist.get_rank() == 0:
        elapsed = time.perf_counter() - start
        tokens_per_step = config.batch_size * config.seq_len
        print(f"{args.steps} steps of {args.preset} under {args.recipe} on {world} "
              f"{device.type} process(es): {args.steps * tokens_per_step / elapsed:.0f} tokens/s",
              flush=True)
    return losses


def _resume(args: argparse.Namespace, model, optimizer, generator: torch.Generator,
            tp_rank: int | None, masters: MasterWeights | None) -> int:
    """The first step to run: 0, or the steps done by the latest complete checkpoint."""
    if not args.resume:
        return 0
    if not args.checkpoint_dir:
        raise ValueError("--resume needs --checkpoint-dir")
    path = train_checkpoint.latest(args.checkpoint_dir)
    if path is None:
        return 0
    steps_done = train_checkpoint.load(path, model, optimizer, generator, tp_rank=tp_rank,
                                       masters=masters)
    if dist.get_rank() == 0:
        print(f"resumed from {path} after {steps_done} steps", flush=True)
    return steps_done


def _kill_point() -> tuple[int, int] | None:
    """MINIFLOAT_TRAIN_KILL_AT=STEP:RANK: that rank kills itself (SIGKILL) inside that step,
    between forward and backward (tests/distributed/test_train_recovery.py)."""
    value = os.environ.get("MINIFLOAT_TRAIN_KILL_AT")
    if not value:
        return None
    step, rank = value.split(":")
    return int(step), int(rank)


def _print_digest(model) -> None:
    """A SHA-256 of every rank's full weights: high-precision values, and the bytes and scales
    of weights sharded as bytes (--mode qw: their state-dict entry is a dict of them)."""
    import hashlib

    def tensors(name: str, value):
        if isinstance(value, dict):
            for key in sorted(value):
                yield from tensors(f"{name}.{key}", value[key])
        elif isinstance(value, torch.Tensor):
            yield name, value

    digest = hashlib.sha256()
    for key, entry in model.state_dict().items():
        for name, value in tensors(key, entry):
            full = value.full_tensor() if hasattr(value, "full_tensor") else value
            full = getattr(full, "_inner", full)
            digest.update(name.encode())
            digest.update(full.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    ranks = [None] * dist.get_world_size()  # under TP each rank holds its own slices
    dist.all_gather_object(ranks, digest.hexdigest())
    if dist.get_rank() == 0:
        print(f"weights sha256 {hashlib.sha256(' '.join(ranks).encode()).hexdigest()}",
              flush=True)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.mode in ("lp", "qw") and args.recipe == "bf16":
        print(f"minifloat.lab.train: --mode {args.mode} gathers quantized weights and needs a "
              "recipe; bf16 has none (use --mode hp)", file=sys.stderr)
        return 2
    if args.graph_step and (args.mode == "qw" or not torch.cuda.is_available()):
        print("minifloat.lab.train: --graph-step captures CUDA graphs: it needs a CUDA device "
              "and --mode hp or lp (the master-weight casts of --mode qw are not captured)",
              file=sys.stderr)
        return 2
    owns_group = not dist.is_initialized()  # a caller's own group outlives this run
    try:
        train(args)
    finally:
        if owns_group and dist.is_initialized():
            destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
