"""quantize_master_weights (seed 004): each rank casts its flat range of the fp32 master weights
into the quantized model weights; after the all-gather of the bytes and
post_all_gather_processing, every buffer equals quantizing the full master weight, bit for bit.

Two levels:
- one process, several "ranks" (up to 8) as separate copies of the model, their maxima reduced
  by the test: random flat splits, cuts inside 128x128 tiles, 32-blocks and rows included;
- real processes over gloo (3 ranks): the public API with its all-reduce, the bytes gathered by
  the test, post_all_gather_processing, and delayed scaling's recorded amax.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import minifloat as mf
from minifloat import numerics
from minifloat.distributed import master_weights as mw
from minifloat.distributed import post_all_gather_processing, quantize_master_weights

from .launch import cpu_randn, run_ranks

RECIPES = {
    "current": lambda: mf.Float8CurrentScaling(),
    "delayed": lambda: mf.DelayedScaling(),
    "block": lambda: mf.Float8BlockScaling(),
    "mxfp8": lambda: mf.MXFP8BlockScaling(),
    "nvfp4": lambda: mf.NVFP4BlockScaling(),  # weights: 2D 16x16 tiles, round-to-nearest
}
# fields holding elements the ranks write by range (the rest are scales, written whole, or
# copies rebuilt by post_all_gather_processing)
RANGE_FIELDS = {"current": ("data",), "delayed": ("data",), "block": ("rowwise_data",),
                "mxfp8": ("rowwise_data", "columnwise_data"), "nvfp4": ("rowwise_data",)}
SHAPES = [(256, 384), (128, 128), (96, 64)]  # block FP8 and MXFP8 need multiples of 128 / 32;
# the random cuts fall inside rows, tiles, blocks and (NVFP4) bytes


def shapes_for(name: str) -> list[tuple[int, int]]:
    return SHAPES[:2] if name == "block" else SHAPES


def build(name: str) -> list[mf.Linear]:
    """Linears whose weights are QuantizedTensors (the model weights of the cast)."""
    torch.manual_seed(0)
    with mf.quantized_model_init(recipe=RECIPES[name]()):
        return [mf.Linear(k, n, bias=False, name=f"fc{i}")
                for i, (n, k) in enumerate(shapes_for(name))]


def masters(name: str, seed: int = 5) -> list[torch.Tensor]:
    """fp32 master weights (what the optimizer updated), wider than the first quantization."""
    generator = torch.Generator().manual_seed(seed)
    return [cpu_randn(shape, generator=generator) * 3 for shape in shapes_for(name)]


def buffers(weight) -> dict[str, torch.Tensor]:
    storage = weight.quantized_storage
    return {field: getattr(storage, field).clone() for field in storage.tensor_fields()
            if getattr(storage, field) is not None}


def full_cast(name: str, master_list: list[torch.Tensor], amaxes: list | None = None
              ) -> list[dict[str, torch.Tensor]]:
    """The reference: each weight's own quantizer on the full master weight (and, into
    `amaxes`, the amax a delayed-scaling quantizer recorded)."""
    expected = []
    for module, master in zip(build(name), master_list, strict=True):
        storage = module.weight.quantized_storage
        quantizer = storage.quantizer.copy()
        quantizer.set_usage(rowwise=storage.has_rowwise(), columnwise=storage.has_columnwise())
        quantizer.internal = True
        fresh = quantizer.quantize(master)
        expected.append({field: getattr(fresh, field) for field in fresh.tensor_fields()
                         if getattr(fresh, field) is not None})
        if amaxes is not None:
            amaxes.append(recorded_amax(module.weight))
    return expected


def elements(name: str, buffer: torch.Tensor) -> torch.Tensor:
    """One code per weight element: the bytes, or NVFP4's unpacked nibbles."""
    flat = buffer.reshape(-1).view(torch.uint8)
    return numerics.unpack_nibbles(flat) if name == "nvfp4" else flat


def store_elements(name: str, buffer: torch.Tensor, codes: torch.Tensor) -> None:
    packed = numerics.pack_nibbles(codes) if name == "nvfp4" else codes
    buffer.reshape(-1).view(torch.uint8).copy_(packed.to(torch.uint8))


def cuts(numel: int, parts: int, generator: torch.Generator) -> list[int]:
    """parts + 1 sorted boundaries in [0, numel], repeats allowed (a rank may own nothing)."""
    inner = torch.randint(0, numel + 1, (parts - 1,), generator=generator, device="cpu")
    inner = inner.sort().values
    return [0, *inner.tolist(), numel]


def assert_same(got: dict, want: dict, label: str) -> None:
    assert got.keys() == want.keys(), label
    for field, value in want.items():
        a, b = got[field], value
        assert a.dtype == b.dtype and a.shape == b.shape, f"{label} {field}"
        assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)), \
            f"{label} {field}"


@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("parts", [1, 2, 5, 8, "single elements"])
def test_partial_casts_equal_the_full_cast(name, parts):
    master_list = masters(name)
    if parts == "single elements":  # one-element ranges at odd and even starts, an empty one
        boundaries = [[0, 1, 2, 3, 3, 6, m.numel() - 1, m.numel()] for m in master_list]
        parts = 7
    else:
        generator = torch.Generator().manual_seed(parts)
        boundaries = [cuts(m.numel(), parts, generator) for m in master_list]
    ranks = [build(name) for _ in range(parts)]
    # each rank's maxima, reduced across ranks as the all-reduce would
    casts, maxima = [], []
    for rank, modules in enumerate(ranks):
        row = []
        for module, master, bounds in zip(modules, master_list, boundaries, strict=True):
            start, end = bounds[rank], bounds[rank + 1]
            shard = master.reshape(-1)[start:end] if end > start else None
            storage = module.weight.quantized_storage
            cast = mw._Cast(storage, shard, start, mw._kind(storage))
            row.append(cast)
        casts.append(row)
        maxima.append([mw._partial_maxima(c, tuple(m.shape))
                       for c, m in zip(row, master_list, strict=True)])
    reduced = [torch.stack([maxima[r][i] for r in range(parts)]).amax(0)
               for i in range(len(master_list))]
    before = [[{field: elements(name, getattr(m.weight.quantized_storage, field)).clone()
                for field in RANGE_FIELDS[name]} for m in modules] for modules in ranks]
    for row in casts:
        for cast, master, value in zip(row, master_list, reduced, strict=True):
            mw._cast(cast, value, tuple(master.shape))
    # a rank writes its own range and nothing else (NVFP4: not the other nibble of a byte)
    for rank, modules in enumerate(ranks):
        for index, module in enumerate(modules):
            start, end = boundaries[index][rank], boundaries[index][rank + 1]
            for field, old in before[rank][index].items():
                new = elements(name, getattr(module.weight.quantized_storage, field))
                outside = torch.ones(new.numel(), dtype=torch.bool)
                outside[start:end] = False
                assert torch.equal(new[outside], old[outside]), f"{name} rank {rank} {field}"
    # the all-gather: each rank's range of the bytes it wrote
    expected = full_cast(name, master_list)
    for index in range(len(master_list)):
        for field in RANGE_FIELDS[name]:
            target = getattr(ranks[0][index].weight.quantized_storage, field)
            codes = elements(name, target).clone()
            for rank in range(parts):
                start, end = boundaries[index][rank], boundaries[index][rank + 1]
                source = getattr(ranks[rank][index].weight.quantized_storage, field)
                codes[start:end] = elements(name, source)[start:end]
            store_elements(name, target, codes)
        post_all_gather_processing([ranks[0][index].weight])
        assert_same(buffers(ranks[0][index].weight), expected[index], f"{name} weight {index}")


def test_refuses_what_it_cannot_cast():
    one_dimensional = mf.NVFP4Quantizer()(torch.randn(64, 64))  # 1x16 blocks: not a weight
    with pytest.raises(NotImplementedError, match="NVFP4"):
        quantize_master_weights([one_dimensional], [torch.zeros(16)], [0])
    stochastic = mf.NVFP4Quantizer(with_2d_quantization=True, stochastic_rounding=True)
    with pytest.raises(ValueError, match="stochastic"):
        quantize_master_weights([stochastic(torch.randn(64, 64))], [torch.zeros(16)], [0])
    plain = torch.nn.Linear(64, 64)
    with pytest.raises(TypeError, match="quantized_model_init"):
        quantize_master_weights([plain.weight], [torch.zeros(16)], [0])
    (current,) = build("current")[:1]
    with pytest.raises(ValueError, match="start_offsets"):
        quantize_master_weights([current.weight], [torch.zeros(16)], [current.weight.numel()])
    with pytest.raises(ValueError, match="flat"):
        quantize_master_weights([current.weight], [torch.zeros(4, 4)], [0])


def nan_worker(rank: int, world_size: int) -> torch.Tensor:
    """Rank 1 holds a NaN where rank 0 holds a number, and a smaller value where rank 0 does."""
    values = torch.tensor([1.0, 2.0, 5.0]) if rank == 0 else torch.tensor([float("nan"), 3.0,
                                                                           4.0])
    return mw.all_reduce_max_keep_nan(values, dist.group.WORLD)


def test_nan_in_one_rank_reaches_every_rank():
    """A MAX all-reduce need not carry NaN; the flag beside the values does."""
    for result in run_ranks(nan_worker, 2, timeout=60):
        assert torch.isnan(result[0]) and result[1:].tolist() == [3.0, 5.0]


def exponent_worker(rank: int, world_size: int) -> tuple:
    """uint8 exponents (NaN is 255, the largest): reduced as they are, into a copy or in place."""
    values = torch.tensor([3, 255, 7], dtype=torch.uint8) if rank == 0 else torch.tensor(
        [9, 1, 2], dtype=torch.uint8)
    copied = mw.all_reduce_max_keep_nan(values, dist.group.WORLD)
    untouched = values.clone()
    reduced = mw.all_reduce_max_keep_nan(values, dist.group.WORLD, in_place=True)
    return copied, untouched, reduced, reduced.data_ptr() == values.data_ptr()


def test_integer_maxima_reduce_into_a_copy_or_in_place():
    for rank, (copied, untouched, reduced, same) in enumerate(
            run_ranks(exponent_worker, 2, timeout=60)):
        assert copied.tolist() == reduced.tolist() == [9, 255, 7]
        assert untouched.tolist() == ([3, 255, 7] if rank == 0 else [9, 1, 2])
        assert same  # in place: the caller's vector holds the result


def cast_worker(rank: int, world_size: int, name: str) -> dict:
    """Every rank: its range of each master weight -> quantize_master_weights -> all-gather of
    the bytes (a SUM all-reduce of each rank's range, zeros elsewhere) -> post-processing."""
    master_list = masters(name)
    modules = build(name)
    generator = torch.Generator().manual_seed(11)  # the same split on every rank
    boundaries = [cuts(m.numel(), world_size, generator) for m in master_list]
    shards = [m.reshape(-1)[b[rank]:b[rank + 1]] if b[rank + 1] > b[rank] else None
              for m, b in zip(master_list, boundaries, strict=True)]
    quantize_master_weights([m.weight for m in modules], shards,
                            [b[rank] for b in boundaries], group=dist.group.WORLD)
    for module, bounds in zip(modules, boundaries, strict=True):
        storage = module.weight.quantized_storage
        for field in RANGE_FIELDS[name]:
            buffer = getattr(storage, field)
            codes = elements(name, buffer)
            mine = torch.zeros(codes.numel(), dtype=torch.int32)
            start, end = bounds[rank], bounds[rank + 1]
            mine[start:end] = codes[start:end].to(torch.int32)
            dist.all_reduce(mine)  # ranges are disjoint: the sum is the gather
            store_elements(name, buffer, mine)
    post_all_gather_processing([m.weight for m in modules])
    return {"buffers": [buffers(m.weight) for m in modules],
            "amax": [recorded_amax(m.weight) for m in modules]}


def recorded_amax(weight) -> torch.Tensor | None:
    """Delayed scaling: the amax the cast recorded into the weight's history slot."""
    amax = getattr(weight.quantized_storage.quantizer, "amax", None)
    return None if amax is None else amax.clone()


@pytest.mark.parametrize("name", list(RECIPES))
def test_quantize_master_weights_over_gloo_equals_full_cast(name):
    amaxes: list = []
    expected = full_cast(name, masters(name), amaxes)
    for rank, result in enumerate(run_ranks(cast_worker, 3, name, timeout=120)):
        for index, want in enumerate(expected):
            assert_same(result["buffers"][index], want, f"{name} rank {rank} weight {index}")
            if name == "delayed":
                assert torch.equal(result["amax"][index], amaxes[index])
                assert amaxes[index] > 0


@pytest.mark.parametrize("name", list(RECIPES))
def test_without_manual_post_processing_the_copy_is_rebuilt_on_use(name):
    """manual_post_all_gather_processing=False drops the stale transposed copy; a training
    step rebuilds it from the rowwise bytes, equal to what post_all_gather_processing makes."""
    master_list = masters(name)
    manual, lazy = build(name)[0], build(name)[0]
    quantize_master_weights([manual.weight], [master_list[0].reshape(-1)], [0])
    post_all_gather_processing([manual.weight])
    quantize_master_weights([lazy.weight], [master_list[0].reshape(-1)], [0],
                            manual_post_all_gather_processing=False)
    storage = lazy.weight.quantized_storage
    assert storage.has_columnwise() == (name == "mxfp8")  # MXFP8 writes both copies
    x = torch.randn(64, lazy.in_features, requires_grad=True)
    with mf.autocast(recipe=RECIPES[name]()):
        lazy(x).sum().backward()
    assert_same(buffers(lazy.weight), buffers(manual.weight), name)


def nvfp4_api_worker(rank: int, world_size: int) -> list[dict]:
    """cast_master_weights_to_nvfp4 over 2 gloo ranks, each owning half of the elements (the
    split falls inside a 16x16 tile and, for odd halves, inside a byte)."""
    from minifloat.distributed import cast_master_weights_to_nvfp4

    master_list = masters("nvfp4")
    modules = build("nvfp4")
    halves = [(m.numel() // 2) | 1 for m in master_list]  # odd: a byte shared by both ranks
    ranges = [(0, h) if rank == 0 else (h, m.numel()) for m, h in zip(master_list, halves,
                                                                          strict=True)]
    shards = [m.reshape(-1)[a:b] for m, (a, b) in zip(master_list, ranges, strict=True)]
    cast_master_weights_to_nvfp4([m.weight for m in modules], shards,
                                 [a for a, _ in ranges], group=dist.group.WORLD)
    for module, (start, end) in zip(modules, ranges, strict=True):
        buffer = module.weight.quantized_storage.rowwise_data
        codes = elements("nvfp4", buffer)
        mine = torch.zeros(codes.numel(), dtype=torch.int32)
        mine[start:end] = codes[start:end].to(torch.int32)
        dist.all_reduce(mine)
        store_elements("nvfp4", buffer, mine)
    post_all_gather_processing([m.weight for m in modules])
    return [buffers(m.weight) for m in modules]


def test_cast_master_weights_to_nvfp4_equals_the_full_cast():
    expected = full_cast("nvfp4", masters("nvfp4"))
    for rank, result in enumerate(run_ranks(nvfp4_api_worker, 2, timeout=120)):
        for index, want in enumerate(expected):
            assert_same(result[index], want, f"rank {rank} weight {index}")


def test_cast_master_weights_to_nvfp4_refuses_other_formats():
    from minifloat.distributed import cast_master_weights_to_nvfp4

    modules = build("current")
    with pytest.raises(TypeError, match="not a 2D NVFP4 weight"):
        cast_master_weights_to_nvfp4([modules[0].weight], [None], [0])


# hybrid weights (seed 000): the rowwise copy in the fprop format, the columnwise copy in the
# dgrad format; each sub-storage is cast in its own format
HYBRIDS = {
    "mxfp8-nvfp4": lambda: mf.HybridRecipe(fprop=mf.MXFP8BlockScaling(),
                                           dgrad=mf.NVFP4BlockScaling(),
                                           wgrad=mf.NVFP4BlockScaling()),
    "current-block": lambda: mf.HybridRecipe(fprop=mf.Float8CurrentScaling(),
                                             dgrad=mf.Float8BlockScaling(),
                                             wgrad=mf.Float8CurrentScaling()),
}
SUB_KINDS = {mf.Float8CurrentScalingQuantizer: "current", mf.Float8BlockQuantizer: "block",
             mf.MXFP8Quantizer: "mxfp8", mf.NVFP4Quantizer: "nvfp4"}


def build_hybrid(which: str) -> list[mf.Linear]:
    torch.manual_seed(0)
    with mf.quantized_model_init(recipe=HYBRIDS[which]()):
        return [mf.Linear(k, n, bias=False, name=f"fc{i}")
                for i, (n, k) in enumerate(SHAPES[:2])]


def sub_buffers(weight, keep: dict | None = None) -> dict[str, dict[str, torch.Tensor]]:
    """Each sub-storage's buffers (restricted to the fields `keep` names, when given)."""
    result = {}
    for direction in ("rowwise", "columnwise"):
        sub = getattr(weight.quantized_storage, f"{direction}_storage")
        fields = keep[direction].keys() if keep is not None else sub.tensor_fields()
        result[direction] = {field: getattr(sub, field).clone() for field in fields
                             if getattr(sub, field) is not None}
    return result


def hybrid_worker(rank: int, world_size: int, which: str) -> list[dict]:
    """quantize_master_weights on hybrid weights over gloo: random flat ranges, the range
    fields of both sub-storages gathered by a SUM all-reduce, then post-processing."""
    master_list = [cpu_randn(shape, generator=torch.Generator().manual_seed(3)) * 3
                   for shape in SHAPES[:2]]
    modules = build_hybrid(which)
    generator = torch.Generator().manual_seed(7)
    boundaries = [cuts(m.numel(), world_size, generator) for m in master_list]
    shards = [m.reshape(-1)[b[rank]:b[rank + 1]] if b[rank + 1] > b[rank] else None
              for m, b in zip(master_list, boundaries, strict=True)]
    quantize_master_weights([m.weight for m in modules], shards,
                            [b[rank] for b in boundaries], group=dist.group.WORLD)
    for module, bounds in zip(modules, boundaries, strict=True):
        storage = module.weight.quantized_storage
        for sub in (storage.rowwise_storage, storage.columnwise_storage):
            kind = SUB_KINDS[type(sub.quantizer)]
            for field in RANGE_FIELDS[kind]:
                buffer = getattr(sub, field)
                if buffer is None:
                    continue
                codes = elements(kind, buffer)
                mine = torch.zeros(codes.numel(), dtype=torch.int32)
                start, end = bounds[rank], bounds[rank + 1]
                mine[start:end] = codes[start:end].to(torch.int32)
                dist.all_reduce(mine)
                store_elements(kind, buffer, mine)
    post_all_gather_processing([m.weight for m in modules])
    return [module.weight for module in modules], master_list


def hybrid_result_worker(rank: int, world_size: int, which: str) -> list[dict]:
    weights, master_list = hybrid_worker(rank, world_size, which)
    expected = []
    for weight, master in zip(weights, master_list, strict=True):
        quantizer = weight.quantized_storage.quantizer.copy()
        quantizer.internal = True
        fresh = quantizer.quantize(master)
        want = {direction: {field: getattr(getattr(fresh, f"{direction}_storage"), field)
                            for field in getattr(fresh, f"{direction}_storage").tensor_fields()
                            if getattr(getattr(fresh, f"{direction}_storage"), field)
                            is not None}
                for direction in ("rowwise", "columnwise")}
        expected.append((sub_buffers(weight, want), want))
    return expected


@pytest.mark.parametrize("which", list(HYBRIDS))
def test_hybrid_weights_partial_casts_equal_the_full_cast(which):
    """Both sub-storages of every rank equal the full hybrid cast of the master weight."""
    for rank, result in enumerate(run_ranks(hybrid_result_worker, 3, which, timeout=120)):
        for index, (got, want) in enumerate(result):
            for direction in ("rowwise", "columnwise"):
                assert_same(got[direction], want[direction],
                            f"{which} rank {rank} weight {index} {direction}")


def test_master_cast_benchmark_cpu_smoke(tmp_path):
    """benchmarks/master_cast.py (issue 16's bandwidth and host-time targets) runs on the CPU,
    and its ranks' ranges cover every weight exactly once."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "master_cast.py"
    spec = importlib.util.spec_from_file_location("master_cast", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    shapes = bench.weight_shapes("tiny")
    assert len(shapes) == 4 * 2  # qkv, proj, fc1, fc2 per block; the head left out
    for ranks in (1, 3, 8):
        for index, (n, k) in enumerate(shapes):
            covered = [bench.rank_ranges(shapes, ranks, rank)[index] for rank in range(ranks)]
            assert covered[0][0] == 0 and sum(count for _, count in covered) == n * k
            assert all(a[0] + a[1] == b[0] for a, b in zip(covered[:-1], covered[1:], strict=True))
    out = tmp_path / "master_cast.json"
    assert bench.main(["--preset", "tiny", "--device", "cpu", "--steps", "1",
                       "--recipes", "fp8-current,nvfp4", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [row["row"] for row in rows] == ["fp8-current", "nvfp4"]
    for row in rows:
        assert "error" not in row and row["device_ms"] > 0 and row["host_ms"] > 0
        assert row["bytes"] == int(row["rank_elements"] * (4 + (0.5 if row["row"] == "nvfp4"
                                                                   else 1)))
    # the MXFP8 ablation: the weights keep (and the cast writes) one copy only
    assert bench.main(["--preset", "tiny", "--device", "cpu", "--steps", "1", "--recipes",
                       "mxfp8", "--copies", "columnwise", "--ranks", "2", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert "error" not in row and row["copies"] == "columnwise"
