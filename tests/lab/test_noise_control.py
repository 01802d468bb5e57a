"""The bf16-nudged control (lab.noise_control): the nudge, the run and the noise floor."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from minifloat.lab import compare
from minifloat.lab.noise_control import CONTROL, nudge_weights
from minifloat.lab.recipe_specs import parse_recipes, recipes_help
from minifloat.lab.seeds import format_summary, summarise


def _model(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.LayerNorm(48))
    return model.to(dtype)


def _comparisons(finals: dict[str, list[float]]) -> list[SimpleNamespace]:
    """What seeds.summarise reads of a comparison per seed: its seed and each run's final
    validation loss ({label: [loss of seed 0, seed 1, ...]})."""
    seeds = range(len(next(iter(finals.values()))))
    return [SimpleNamespace(plan=SimpleNamespace(seed=seed), runs=[
        SimpleNamespace(label=label, final_val_loss=values[seed])
        for label, values in finals.items()]) for seed in seeds]


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to(torch.bfloat16).view(torch.int16).to(torch.int32)


def test_every_bf16_weight_moves_one_step_up_or_down_at_random():
    model = _model(torch.bfloat16)
    before = [p.detach().clone() for p in model.parameters()]
    nudge_weights(model, seed=0)
    moved_up = 0
    total = 0
    for old, new in zip(before, model.parameters(), strict=True):
        nonzero = old != 0  # (LayerNorm's bias: from 0 to the smallest subnormal either way)
        # adjacent bf16 values of one sign differ by one in their bit pattern
        step = (_bits(new) - _bits(old))[nonzero]
        assert step.abs().eq(1).all()
        up = new[nonzero] > old[nonzero]
        moved_up += int(up.sum())
        total += int(nonzero.sum())
        smallest = torch.tensor(2.0 ** -133, dtype=torch.bfloat16)
        assert torch.equal(new[~nonzero].abs(), smallest.expand_as(new[~nonzero]))
    assert 0.45 < moved_up / total < 0.55


def test_fp32_weights_land_next_to_their_bf16_rounding_and_seeds_differ():
    model = _model(torch.float32)
    rounded = [p.detach().to(torch.bfloat16) for p in model.parameters()]
    nudge_weights(model, seed=1)
    for old, new in zip(rounded, model.parameters(), strict=True):
        assert new.dtype == torch.float32
        assert torch.equal(new.to(torch.bfloat16).float(), new)  # a bf16 value
        nonzero = old != 0
        assert (_bits(new) - _bits(old))[nonzero].abs().eq(1).all()
    again, other = _model(torch.float32), _model(torch.float32)
    nudge_weights(again, seed=1)
    nudge_weights(other, seed=2)
    assert all(torch.equal(a, b) for a, b in zip(again.parameters(), model.parameters(),
                                                  strict=True))
    assert not torch.equal(other[0].weight, model[0].weight)


def test_the_control_trains_as_bf16_from_nudged_weights(tmp_path):
    result = compare.run_comparison(f"bf16,{CONTROL}", steps=2, out_dir=tmp_path, seed=0,
                                    data_path=None, device="cpu", progress=False,
                                    val_batches=1)
    bf16, control = result.runs
    # the same batches from weights one bf16 step apart: close, and not equal
    assert control.train_loss[0] != bf16.train_loss[0]
    assert control.train_loss[0] == pytest.approx(bf16.train_loss[0], rel=2e-2)
    assert "chaos alone" in (tmp_path / "table.txt").read_text()


def test_the_control_is_a_plain_spec():
    assert parse_recipes(f"bf16,{CONTROL}", 2, head_in_high_precision=True) == [
        ("bf16", None), (CONTROL, None)]
    with pytest.raises(ValueError, match="takes no @ suffix"):
        parse_recipes(f"{CONTROL}@last1", 2)
    assert CONTROL in recipes_help()


def test_the_controls_largest_same_seed_gap_is_the_floor():
    """Floor = max |control's paired gap| over the seeds (here 2.0%, seed 1); a recipe whose
    mean paired gap is inside it is marked, one outside is not."""
    finals = {"bf16": [1.00, 2.00, 0.50], CONTROL: [1.01, 1.96, 0.505],
              "inside": [1.02, 2.02, 0.505], "outside": [1.03, 2.06, 0.515]}
    summary = summarise(_comparisons(finals))
    assert summary["paired_noise_floor_percent"] == pytest.approx(2.0)
    assert summary["recipes"]["inside"]["paired_gap_mean"] == pytest.approx(4 / 3)
    assert summary["recipes"]["inside"]["within_control"] is True
    assert summary["recipes"]["outside"]["within_control"] is False
    assert summary["recipes"]["bf16"]["within_control"] is None
    text = format_summary(summary)
    assert "within 2.00% of the same-seed bf16 run" in text
    inside = next(line for line in text.splitlines() if line.startswith("inside "))
    outside = next(line for line in text.splitlines() if line.startswith("outside "))
    assert "within the control's" in inside and "within the control's" not in outside


def test_without_the_control_there_is_no_floor():
    summary = summarise(_comparisons({"bf16": [1.0, 2.0], "mxfp8": [1.01, 2.01]}))
    assert summary["paired_noise_floor_percent"] is None
    assert summary["recipes"]["mxfp8"]["within_control"] is None
    assert "nudged" not in format_summary(summary)


def test_the_plot_draws_each_same_seed_gap_inside_or_outside_the_controls_band():
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from minifloat.lab.seeds import _plot_paired_gaps

    finals = {"bf16": [1.00, 2.00], CONTROL: [1.01, 1.98], "mxfp8": [1.03, 2.02]}
    figure, axis = plt.subplots()
    _plot_paired_gaps(axis, summarise(_comparisons(finals)), {})
    (band,) = axis.patches
    corners = band.get_path().transformed(band.get_patch_transform()).vertices[:, 1]
    assert (corners.min(), corners.max()) == pytest.approx((-1.0, 1.0))  # +-max |1%, -1%|
    from matplotlib.collections import PathCollection

    dots = [list(points.get_offsets()[:, 1]) for points in axis.collections
            if isinstance(points, PathCollection)]
    assert dots == [pytest.approx([1.0, -1.0]), pytest.approx([3.0, 1.0])]
    plt.close(figure)
