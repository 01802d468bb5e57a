"""quantize_master_weights' kernels (kernels/master_cast.py: one maxima launch and one cast
launch per format) equal the per-weight reference cast bit for bit: the maxima vector handed to
the all-reduce, then every buffer of every weight (the rank's bytes, every scale, the bytes
outside its range untouched, NVFP4's other nibble of a shared byte kept) and delayed scaling's
recorded amax. FP8 current and delayed scaling, block FP8, MXFP8 and 2D NVFP4; fp32 and bf16
masters; ranges cut inside rows, tiles, blocks and bytes, single elements, an empty range, a
NaN in one master, infinities and a NaN inside tiles a range covers whole (the MXFP8 maxima
kernel's word path with infinite blocks, and its byte path for a NaN); FSDP2 row shards."""

from __future__ import annotations

import pytest
import torch

import minifloat as mf
import minifloat.distributed.master_weights as master_weights
from minifloat import kernels
from minifloat.distributed import quantize_master_weights

DEVICE = kernels.kernel_device()
if DEVICE is None:
    pytest.skip("needs CUDA with Triton", allow_module_level=True)

RECIPES = {"current": mf.Float8CurrentScaling, "delayed": mf.DelayedScaling,
           "block": mf.Float8BlockScaling, "mxfp8": mf.MXFP8BlockScaling,
           "nvfp4": mf.NVFP4BlockScaling}
SHAPES = {"current": [(64, 96), (128, 256), (48, 80)],
          "delayed": [(64, 96), (128, 256), (48, 80)],
          "block": [(256, 384), (128, 128), (384, 256)],
          # 160 x 512: the cut range covers whole 32 x 256 tiles, which the maxima kernel
          # casts itself (and the head case covers two tile rows)
          "mxfp8": [(160, 512), (128, 160), (64, 256)],
          # 48 x 2048: a tile row's 128 scale columns fill a scale program (the unmasked
          # store)
          "nvfp4": [(96, 64), (48, 144), (48, 2048)]}


def weights(name: str) -> list[torch.Tensor]:
    torch.manual_seed(0)
    with mf.quantized_model_init(recipe=RECIPES[name]()):
        return [mf.Linear(k, n, bias=False, device=DEVICE).weight for n, k in SHAPES[name]]


def ranges(name: str, case: str) -> list[tuple[int, int]]:
    """(start, end) of the rank's range per weight."""
    sizes = [n * k for n, k in SHAPES[name]]
    if case == "cut":  # inside rows, tiles and (odd ends) bytes; the last weight not owned
        return [(size // 3 + 1, 2 * size // 3 + 6) for size in sizes[:2]] + [(0, 0)]
    if case == "single":  # one element at an odd start, one at an even start, the whole weight
        return [(7, 8), (sizes[1] - 2, sizes[1] - 1), (0, sizes[2])]
    # "head" and "special": a prefix ending inside a byte
    return [(0, size // 2 + 1) for size in sizes]


def masters(name: str, case: str, dtype: torch.dtype) -> tuple[list, list[int]]:
    generator = torch.Generator().manual_seed(3)
    shards, starts = [], []
    for index, ((n, k), (start, end)) in enumerate(zip(SHAPES[name], ranges(name, case),
                                                       strict=True)):
        full = torch.randn(n * k, generator=generator) * (index + 2)
        if index == 1 and case == "cut":
            full[start + 5] = float("nan")
        if index == 0 and case == "special":  # inside tiles the range covers whole
            k = SHAPES[name][0][1]
            full[37] = float("inf")
            full[33 * k + k // 2 + 44] = float("nan")
            full[2 * k + 3] = -float("inf")
        shards.append(full[start:end].to(dtype).to(DEVICE) if end > start else None)
        starts.append(start)
    return shards, starts


def run(name: str, case: str, dtype: torch.dtype, monkeypatch) -> tuple[list, torch.Tensor]:
    handed = []
    reduce = master_weights.all_reduce_max_keep_nan
    monkeypatch.setattr(master_weights, "all_reduce_max_keep_nan",
                        lambda values, group, **kwargs: handed.append(values.clone())
                        or reduce(values, group, **kwargs))
    model_weights = weights(name)
    shards, starts = masters(name, case, dtype)
    quantize_master_weights(model_weights, shards, starts)
    storages = [w.quantized_storage for w in model_weights]
    buffers = [{field: getattr(s, field).clone() for field in cast_fields(name, s)}
               for s in storages]
    if name == "delayed":  # the recipe state's amax slot, where the reduced amax is recorded
        for buffer, storage in zip(buffers, storages, strict=True):
            buffer["recorded amax"] = storage.quantizer.amax.clone()
    (vector,) = handed
    return buffers, vector


# transposed copies the format derives after the gather (post_all_gather_processing): the
# cast leaves them stale, and the reference's own quantization may alias them to the rowwise
# tensors (a one-tile grid's transpose is itself), so they are not compared
DERIVED = {"current": ("data_transpose",), "delayed": ("data_transpose",),
           "block": ("columnwise_data", "columnwise_scale_inv"),
           "nvfp4": ("columnwise_data", "columnwise_scale", "amax_columnwise"), "mxfp8": ()}


def cast_fields(name: str, storage) -> list[str]:
    return [field for field in storage.tensor_fields()
            if getattr(storage, field) is not None and field not in DERIVED[name]]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal; NaN equals NaN (payloads may differ in fp32 scales and amaxes)."""
    if torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
        return True
    if a.dtype != torch.float32:
        return False
    return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["cut", "single", "head", "special"])
@pytest.mark.parametrize("name", list(RECIPES))
def test_kernels_equal_the_reference(name, case, dtype, monkeypatch):
    calls = []
    original = master_weights._partial_maxima
    monkeypatch.setattr(master_weights, "_partial_maxima",
                        lambda cast, shape: calls.append(cast.kind) or original(cast, shape))
    got, got_vector = run(name, case, dtype, monkeypatch)
    assert calls == []  # every weight went through the kernels
    monkeypatch.setenv("MINIFLOAT_DISABLE_KERNELS", "1")
    want, want_vector = run(name, case, dtype, monkeypatch)
    assert len(calls) == len(SHAPES[name])  # and here through the reference
    assert same_bits(got_vector, want_vector)
    for index, (mine, reference) in enumerate(zip(got, want, strict=True)):
        assert mine.keys() == reference.keys()
        for field in reference:
            assert same_bits(mine[field], reference[field]), f"{name} weight {index} {field}"


def shard_of(storage, name: str, first: int, last: int, copies: str):
    """A storage over rows [first, last) of a full weight's buffers, as FSDP2's low-precision
    shards hold them (quantized_shards.shard_storage): the rows of per-row tensors, the whole
    of the shared grids (cloned: each path writes its own)."""
    from minifloat.quantizers import Float8BlockStorage, Float8Storage, MXFP8Storage, NVFP4Storage

    rows = last - first
    shape = (rows, storage.shape[-1])
    common = {"shape": shape, "dtype": storage.dtype, "quantizer": storage.quantizer}
    if name in ("current", "delayed"):
        return Float8Storage(data=storage.data[first:last].clone(), data_transpose=None,
                             scale_inv=storage.scale_inv.clone(), fp8_dtype=storage.fp8_dtype,
                             **common)
    if name == "block":
        return Float8BlockStorage(rowwise_data=storage.rowwise_data[first:last].clone(),
                                  rowwise_scale_inv=storage.rowwise_scale_inv.clone(),
                                  columnwise_data=None, columnwise_scale_inv=None,
                                  block_scaling_dim=2, **common)
    if name == "nvfp4":
        return NVFP4Storage(rowwise_data=storage.rowwise_data[first:last].clone(),
                            rowwise_scale=storage.rowwise_scale[first:last].clone(),
                            amax_rowwise=storage.amax_rowwise.clone(), columnwise_data=None,
                            columnwise_scale=None, amax_columnwise=None, two_dimensional=True,
                            with_rht=False, **common)
    rowwise, columnwise = "rowwise" in copies, "columnwise" in copies
    return MXFP8Storage(
        fp8_dtype=storage.fp8_dtype,
        rowwise_data=storage.rowwise_data[first:last].clone() if rowwise else None,
        rowwise_scale=storage.rowwise_scale[first:last].clone() if rowwise else None,
        columnwise_data=storage.columnwise_data[first:last].clone() if columnwise else None,
        columnwise_scale=storage.columnwise_scale.clone() if columnwise else None, **common)


@pytest.mark.parametrize("copies", ["rowwise", "columnwise", "rowwise+columnwise"])
@pytest.mark.parametrize("name", list(RECIPES))
def test_kernels_write_fsdp_shards_like_the_reference(name, copies, monkeypatch):
    """A storage holding rows [first, last) of the weight (base > 0): the rank's range inside
    them, every shared scale written whole, per-row scales of its own rows only."""
    if name != "mxfp8" and copies != "rowwise":
        pytest.skip("per-tensor FP8, block FP8 and NVFP4 shards hold rowwise bytes only")
    rows, columns = SHAPES[name][2]
    first, last = {"block": (128, 256), "mxfp8": (32, 64)}.get(name, (16, 48))
    calls = []
    original = master_weights._partial_maxima
    monkeypatch.setattr(master_weights, "_partial_maxima",
                        lambda cast, shape: calls.append(cast.kind) or original(cast, shape))
    generator = torch.Generator().manual_seed(4)
    full_master = torch.randn(rows * columns, generator=generator).to(DEVICE)
    start, end = first * columns + 37, last * columns - 19  # inside rows and bytes
    results = []
    for disabled in ("0", "1"):
        monkeypatch.setenv("MINIFLOAT_DISABLE_KERNELS", disabled)
        storage = shard_of(weights(name)[2].quantized_storage, name, first, last, copies)
        cast = master_weights._Cast(storage, full_master[start:end], start,
                                    master_weights._kind(storage), base=first * columns)
        master_weights._cast_from_reduced_maxima([(cast, (rows, columns))], None)
        results.append({field: getattr(storage, field).clone()
                        for field in cast_fields(name, storage)})
    assert calls == [name]  # the reference ran once, the kernels the other time
    mine, reference = results
    assert mine.keys() == reference.keys()
    for field in reference:
        assert same_bits(mine[field], reference[field]), f"{name} {copies} {field}"


def test_a_kept_plan_follows_the_quantizer_options(monkeypatch):
    """Plans are kept across calls (the same ranges into the same buffers); a quantizer option
    changed in place between two calls (amax_epsilon here) must reach the kernels, not the kept
    plan's old value."""
    model_weights = weights("current")
    shards, starts = masters("current", "head", torch.float32)
    quantize_master_weights(model_weights, shards, starts)  # builds and keeps the plan
    for weight in model_weights:
        weight.quantized_storage.quantizer.amax_epsilon = 1e3  # above every master's amax
    quantize_master_weights(model_weights, shards, starts)
    got = [weight.quantized_storage.scale_inv.clone() for weight in model_weights]
    monkeypatch.setenv("MINIFLOAT_DISABLE_KERNELS", "1")
    reference = weights("current")
    for weight in reference:
        weight.quantized_storage.quantizer.amax_epsilon = 1e3
    quantize_master_weights(reference, shards, starts)
    for mine, want in zip(got, reference, strict=True):
        assert torch.equal(mine, want.quantized_storage.scale_inv)
    assert not torch.equal(got[0], torch.ones_like(got[0]))  # the epsilon decided the scale


@pytest.mark.parametrize("name", ["current", "block", "nvfp4"])
def test_a_training_loop_keeps_its_plan(name, monkeypatch):
    """cast, all-gather, post_all_gather_processing, cast again: the transposed copies rebuilt
    in between get new addresses, yet the plan (the kernels' table) is built once and kept."""
    from minifloat.distributed import post_all_gather_processing
    from minifloat.kernels import master_cast_plan

    built = []
    original = master_cast_plan.PartialCastPlan.__init__

    def counting(self, *args, **kwargs):
        built.append(args[0])
        original(self, *args, **kwargs)

    monkeypatch.setattr(master_cast_plan.PartialCastPlan, "__init__", counting)
    model_weights = weights(name)
    shards, starts = masters(name, "head", torch.float32)
    for _ in range(3):
        quantize_master_weights(model_weights, shards, starts)
        post_all_gather_processing(model_weights)
        for shard in shards:  # the optimizer step updates the masters in place
            shard.mul_(0.5)
    assert built == [name]
