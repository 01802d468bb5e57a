"""Recipes (frozen, validated, NUMERICS.md §10 defaults), QuantizerRole, RecipeState.create and
CustomRecipe factories (DESIGN.md §2, seed 001)."""

from __future__ import annotations

import dataclasses
import io
import pickle

import pytest
import torch

import minifloat as mf
from minifloat import (
    CustomRecipe,
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    QuantizerRole,
    RecipeState,
)

from ._reference import E4M3, E5M2, assert_bitwise_equal

ALL_RECIPES = [
    DelayedScaling(),
    Float8CurrentScaling(),
    Float8BlockScaling(),
    MXFP8BlockScaling(),
    NVFP4BlockScaling(),
]

FORWARD_ROLES = [
    QuantizerRole("linear", "input", "fc"),
    QuantizerRole("linear", "weight", "fc"),
    QuantizerRole("linear", "input", "next"),  # the output slot: its consumer's input
]
BACKWARD_ROLES = [
    QuantizerRole("linear", "grad_output", "fc"),
    QuantizerRole("linear", "grad_output", "prev"),  # grad_input: its consumer's grad_output
]


# ---------------------------------------------------------------------------------------------
# module-level factories (picklable) and a counting callable class


class CountingFactory:
    """Records every role it is called with and returns a per-tensor current-scaling quantizer."""

    def __init__(self) -> None:
        self.roles: list[QuantizerRole] = []

    def __call__(self, role: QuantizerRole):
        self.roles.append(role)
        dtype = E5M2 if role.tensor_type == "grad_output" else E4M3
        return mf.Float8CurrentScalingQuantizer(dtype)


def none_for_weights(role: QuantizerRole):
    if role.tensor_type == "weight":
        return None
    return mf.IdentityQuantizer()


def not_a_quantizer(role: QuantizerRole):
    return torch.float8_e4m3fn


def module_level_factory(role: QuantizerRole):
    return mf.MXFP8Quantizer()


# ---------------------------------------------------------------------------------------------
# recipes: frozen, validated, defaults


@pytest.mark.parametrize("recipe", ALL_RECIPES + [CustomRecipe(module_level_factory)],
                         ids=lambda r: type(r).__name__)
def test_recipes_are_frozen(recipe):
    field = dataclasses.fields(recipe)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(recipe, field, getattr(recipe, field))
    assert hash(recipe) == hash(dataclasses.replace(recipe))  # hashable, equal by value
    assert isinstance(recipe, mf.Recipe)


def test_recipe_defaults_follow_numerics_section_10():
    d = DelayedScaling()
    assert (d.fp8_format, d.margin, d.amax_history_len, d.amax_compute_algo, d.reduce_amax) == (
        Format.HYBRID, 0, 1024, "max", True)
    c = Float8CurrentScaling()
    assert (c.fp8_format, c.power_2_scale, c.amax_epsilon) == (Format.HYBRID, False, 0.0)
    # fprop fast accumulation, dgrad/wgrad split accumulation
    assert c.fprop_use_split_accumulator is False
    assert c.dgrad_use_split_accumulator is True and c.wgrad_use_split_accumulator is True
    b = Float8BlockScaling()
    assert (b.fp8_format, b.power_2_scale) == (Format.E4M3, True)
    assert (b.x_block_scaling_dim, b.w_block_scaling_dim, b.grad_block_scaling_dim) == (1, 2, 1)
    assert MXFP8BlockScaling().fp8_format == Format.E4M3
    n = NVFP4BlockScaling()
    assert (n.disable_rht, n.disable_stochastic_rounding, n.disable_2d_quantization) == (
        False, False, False)


@pytest.mark.parametrize(
    "make, field",
    [
        (lambda: DelayedScaling(margin=-1), "margin"),
        (lambda: DelayedScaling(amax_history_len=0), "amax_history_len"),
        (lambda: DelayedScaling(amax_compute_algo="mean"), "amax_compute_algo"),
        (lambda: DelayedScaling(fp8_format=Format.E2M1), "fp8_format"),
        (lambda: Float8CurrentScaling(amax_epsilon=-1e-3), "amax_epsilon"),
        (lambda: Float8CurrentScaling(fp8_format=Format.E2M1), "fp8_format"),
        (lambda: Float8BlockScaling(fp8_format=Format.E5M2), "E4M3"),
        (lambda: Float8BlockScaling(amax_epsilon=-1.0), "amax_epsilon"),
        (lambda: Float8BlockScaling(x_block_scaling_dim=3), "x_block_scaling_dim"),
        (lambda: Float8BlockScaling(grad_block_scaling_dim=0), "grad_block_scaling_dim"),
        (lambda: Float8BlockScaling(x_block_scaling_dim=2, w_block_scaling_dim=2), "2D x 2D"),
        (lambda: Float8BlockScaling(grad_block_scaling_dim=2, w_block_scaling_dim=2), "2D x 2D"),
        (lambda: MXFP8BlockScaling(fp8_format=Format.E2M1), "fp8_format"),
        (lambda: NVFP4BlockScaling(fp4_format=Format.E4M3), "fp4_format"),
    ],
)
def test_recipe_validation_errors_name_the_field(make, field):
    with pytest.raises(ValueError, match=field):
        make()


def test_valid_non_default_recipes_construct():
    # the validation must not reject legal combinations
    DelayedScaling(fp8_format=Format.E4M3, margin=3, amax_history_len=1,
                   amax_compute_algo="most_recent", reduce_amax=False)
    Float8CurrentScaling(fp8_format=Format.E5M2, power_2_scale=True, amax_epsilon=1e-12)
    Float8BlockScaling(x_block_scaling_dim=2, w_block_scaling_dim=1, grad_block_scaling_dim=1)
    NVFP4BlockScaling(disable_rht=True, disable_stochastic_rounding=True,
                      disable_2d_quantization=True)


def test_custom_recipe_requires_callable():
    with pytest.raises(TypeError, match="callable"):
        CustomRecipe(qfactory=42)


# ---------------------------------------------------------------------------------------------
# QuantizerRole


def test_quantizer_role_is_frozen_and_minimal():
    role = QuantizerRole("linear", "weight", "qkv")
    with pytest.raises(dataclasses.FrozenInstanceError):
        role.name = "other"
    names = {f.name for f in dataclasses.fields(QuantizerRole)}
    assert names == {"module_type", "tensor_type", "name"}  # no `position` (seed 001 review)
    assert not hasattr(role, "position")
    assert not hasattr(role, "is_gemm") and not hasattr(QuantizerRole, "is_gemm")
    assert role == QuantizerRole("linear", "weight", "qkv")
    assert len({role, QuantizerRole("linear", "weight", "qkv")}) == 1
    assert pickle.loads(pickle.dumps(role)) == role


@pytest.mark.parametrize("tensor_type", ["input", "weight", "grad_output"])
def test_quantizer_role_accepts_the_three_tensor_types(tensor_type):
    assert QuantizerRole("dpa", tensor_type, "attn").tensor_type == tensor_type


@pytest.mark.parametrize("tensor_type", ["output", "grad_input", "bias", ""])
def test_quantizer_role_rejects_other_tensor_types(tensor_type):
    with pytest.raises(ValueError, match="tensor_type"):
        QuantizerRole("linear", tensor_type, "fc")


# ---------------------------------------------------------------------------------------------
# RecipeState.create: per-role decisions of the built-in recipes


def make(recipe, mode, roles):
    return RecipeState.create(recipe, mode, len(roles), roles).make_quantizers()


def test_quantizer_role_field_types():
    with pytest.raises(TypeError):
        QuantizerRole(3, "input", "fc")
    with pytest.raises(TypeError):
        QuantizerRole("linear", "input", None)


def test_recipe_state_rejects_unknown_recipes():
    with pytest.raises(TypeError, match="recipe"):
        RecipeState.create(object(), "forward", 1, FORWARD_ROLES[:1])


def test_recipe_state_argument_errors():
    with pytest.raises(ValueError, match="mode"):
        RecipeState.create(MXFP8BlockScaling(), "sideways", 1, FORWARD_ROLES[:1])
    with pytest.raises(ValueError, match="roles"):
        RecipeState.create(MXFP8BlockScaling(), "forward", 2, FORWARD_ROLES)
    with pytest.raises(TypeError):
        RecipeState.create(MXFP8BlockScaling(), "forward", 1, ["input"])


def test_float8_block_scaling_weights_2d_others_1d():
    fwd = make(Float8BlockScaling(), "forward", FORWARD_ROLES)
    bwd = make(Float8BlockScaling(), "backward", BACKWARD_ROLES)
    assert all(isinstance(q, mf.Float8BlockQuantizer) for q in fwd + bwd)
    assert [q.block_scaling_dim for q in fwd] == [1, 2, 1]
    assert [q.block_scaling_dim for q in bwd] == [1, 1]
    assert all(q.power_2_scale for q in fwd + bwd)
    # non-default dims are honoured per role
    recipe = Float8BlockScaling(x_block_scaling_dim=2, w_block_scaling_dim=1)
    assert [q.block_scaling_dim for q in make(recipe, "forward", FORWARD_ROLES)] == [2, 1, 2]
    recipe = Float8BlockScaling(power_2_scale=False, amax_epsilon=1e-6)
    q = make(recipe, "forward", FORWARD_ROLES)[0]
    assert (q.power_2_scale, q.amax_epsilon) == (False, 1e-6)


@pytest.mark.parametrize(
    "fmt, forward_dtype, grad_dtype",
    [(Format.HYBRID, E4M3, E5M2), (Format.E4M3, E4M3, E4M3), (Format.E5M2, E5M2, E5M2)],
)
def test_current_scaling_formats_per_role(fmt, forward_dtype, grad_dtype):
    recipe = Float8CurrentScaling(fp8_format=fmt, power_2_scale=True, amax_epsilon=1e-8)
    fwd = make(recipe, "forward", FORWARD_ROLES)
    bwd = make(recipe, "backward", BACKWARD_ROLES)
    assert all(isinstance(q, mf.Float8CurrentScalingQuantizer) for q in fwd + bwd)
    assert [q.fp8_dtype for q in fwd] == [forward_dtype] * 3
    assert [q.fp8_dtype for q in bwd] == [grad_dtype] * 2
    assert all(q.power_2_scale and q.amax_epsilon == 1e-8 for q in fwd + bwd)


def test_delayed_scaling_hybrid_gives_grad_slots_e5m2():
    recipe = DelayedScaling()
    fwd = make(recipe, "forward", FORWARD_ROLES)
    bwd = make(recipe, "backward", BACKWARD_ROLES)
    assert all(isinstance(q, mf.Float8Quantizer) for q in fwd + bwd)
    assert [q.fp8_dtype for q in fwd] == [E4M3] * 3
    assert [q.fp8_dtype for q in bwd] == [E5M2] * 2
    fwd = make(DelayedScaling(fp8_format=Format.E4M3), "backward", BACKWARD_ROLES)
    assert [q.fp8_dtype for q in fwd] == [E4M3] * 2


def test_mxfp8_e4m3_for_all_and_hybrid_grads():
    fwd = make(MXFP8BlockScaling(), "forward", FORWARD_ROLES)
    bwd = make(MXFP8BlockScaling(), "backward", BACKWARD_ROLES)
    assert all(isinstance(q, mf.MXFP8Quantizer) for q in fwd + bwd)
    assert [q.fp8_dtype for q in fwd + bwd] == [E4M3] * 5
    bwd = make(MXFP8BlockScaling(fp8_format=Format.HYBRID), "backward", BACKWARD_ROLES)
    assert [q.fp8_dtype for q in bwd] == [E5M2] * 2


def _nvfp4_flags(q):
    return (q.with_2d_quantization, q.with_rht, q.stochastic_rounding)


@pytest.mark.parametrize(
    "recipe, weight, inputs, grads",
    [
        # (2D, RHT, SR) for weights, forward inputs (incl. the output slot) and gradients
        (NVFP4BlockScaling(), (True, False, False), (False, True, False), (False, True, True)),
        (NVFP4BlockScaling(disable_rht=True),
         (True, False, False), (False, False, False), (False, False, True)),
        (NVFP4BlockScaling(disable_stochastic_rounding=True),
         (True, False, False), (False, True, False), (False, True, False)),
        (NVFP4BlockScaling(disable_2d_quantization=True),
         (False, False, False), (False, True, False), (False, True, True)),
    ],
    ids=["default", "disable_rht", "disable_sr", "disable_2d"],
)
def test_nvfp4_per_role_decisions(recipe, weight, inputs, grads):
    fwd = make(recipe, "forward", FORWARD_ROLES)
    bwd = make(recipe, "backward", BACKWARD_ROLES)
    assert all(isinstance(q, mf.NVFP4Quantizer) for q in fwd + bwd)
    assert _nvfp4_flags(fwd[1]) == weight
    assert _nvfp4_flags(fwd[0]) == inputs and _nvfp4_flags(fwd[2]) == inputs
    assert [_nvfp4_flags(q) for q in bwd] == [grads, grads]
    assert fwd[1].is_requantization_safe()
    assert bwd[0].is_requantization_safe() == (not grads[2])


def test_roles_decide_not_slot_order():
    # a weight role in the first slot still gets the weight treatment (role-based, not index)
    roles = [QuantizerRole("linear", "weight", "w"), QuantizerRole("linear", "input", "x")]
    qs = make(Float8BlockScaling(), "forward", roles)
    assert [q.block_scaling_dim for q in qs] == [2, 1]
    qs = make(NVFP4BlockScaling(), "forward", roles)
    assert [_nvfp4_flags(q) for q in qs] == [(True, False, False), (False, True, False)]


# ---------------------------------------------------------------------------------------------
# CustomRecipe


def test_custom_recipe_calls_factory_once_per_slot_with_its_role():
    factory = CountingFactory()
    recipe = CustomRecipe(factory)
    fwd = make(recipe, "forward", FORWARD_ROLES)
    assert factory.roles == FORWARD_ROLES
    bwd = make(recipe, "backward", BACKWARD_ROLES)
    assert factory.roles == FORWARD_ROLES + BACKWARD_ROLES
    assert [q.fp8_dtype for q in fwd + bwd] == [E4M3] * 3 + [E5M2] * 2
    assert len({id(q) for q in fwd + bwd}) == 5


def test_custom_recipe_none_is_a_value_error_naming_the_role():
    state = RecipeState.create(CustomRecipe(none_for_weights), "forward", 3, FORWARD_ROLES)
    with pytest.raises(ValueError, match=r"weight") as info:
        state.make_quantizers()
    assert "IdentityQuantizer" in str(info.value)
    assert "fc" in str(info.value)


def test_custom_recipe_non_quantizer_is_a_type_error():
    state = RecipeState.create(CustomRecipe(not_a_quantizer), "forward", 3, FORWARD_ROLES)
    with pytest.raises(TypeError, match="Quantizer"):
        state.make_quantizers()


def test_custom_recipe_with_lambda_cannot_be_pickled_or_saved():
    recipe = CustomRecipe(lambda role: mf.MXFP8Quantizer())
    with pytest.raises(TypeError, match="module-level"):
        pickle.dumps(recipe)
    with pytest.raises(TypeError, match="module-level"):
        torch.save(recipe, io.BytesIO())


def test_custom_recipe_with_closure_cannot_be_pickled():
    dtype = E4M3

    def closure(role):
        return mf.Float8CurrentScalingQuantizer(dtype)

    with pytest.raises(TypeError, match="module-level"):
        pickle.dumps(CustomRecipe(closure))


@pytest.mark.parametrize("factory", [module_level_factory, CountingFactory(),
                                     mf.factories.nvfp4_factory])
def test_custom_recipe_with_module_level_factory_pickles(factory):
    recipe = CustomRecipe(factory)
    restored = pickle.loads(pickle.dumps(recipe))
    assert type(restored.qfactory) is type(factory)
    buffer = io.BytesIO()
    torch.save(recipe, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    quantizer = loaded.qfactory(QuantizerRole("linear", "weight", "fc"))
    assert isinstance(quantizer, mf.Quantizer)
    if factory is module_level_factory:
        assert restored == recipe and loaded == recipe


@pytest.mark.parametrize(
    "factory, builtin",
    [
        (mf.factories.float8_current_scaling_like, Float8CurrentScaling()),
        (mf.factories.float8_block_scaling_like, Float8BlockScaling()),
        (mf.factories.mxfp8_like, MXFP8BlockScaling()),
        (mf.factories.nvfp4_like, NVFP4BlockScaling()),
    ],
)
def test_like_factories_give_the_builtin_bytes(factory, builtin):
    # Documented in factories.py: CustomRecipe(*_like) equals the built-in recipe byte for byte.
    torch.manual_seed(0)
    x = torch.randn(64, 96)
    for mode, roles in (("forward", FORWARD_ROLES), ("backward", BACKWARD_ROLES)):
        custom = make(CustomRecipe(factory), mode, roles)
        reference = make(builtin, mode, roles)
        for qc, qb in zip(custom, reference, strict=True):
            for q in (qc, qb):
                q.set_usage(rowwise=True, columnwise=True)
            torch.manual_seed(5)  # NVFP4 gradients use stochastic rounding
            a = qc(x)
            torch.manual_seed(5)
            b = qb(x)
            assert type(a.quantized_storage) is type(b.quantized_storage)
            assert_bitwise_equal(a.dequantize(), b.dequantize(), f"{mode} {type(qc).__name__}")


# ---------------------------------------------------------------------------------------------
# delayed-scaling state


def test_delayed_scaling_state_survives_make_quantizers():
    recipe = DelayedScaling(amax_history_len=4)
    state = RecipeState.create(recipe, "forward", 3, FORWARD_ROLES)
    first = state.make_quantizers()
    x = torch.randn(32, 64) * 3
    first[0](x)
    second = state.make_quantizers()
    # same tensors (views of the state), so the amax recorded through `first` is visible
    for q1, q2 in zip(first, second, strict=True):
        assert q1.scale.data_ptr() == q2.scale.data_ptr()
        assert q1.amax.data_ptr() == q2.amax.data_ptr()
    assert second[0].amax.item() == x.abs().max().item()
    state.update()
    expected_scale = torch.tensor(448.0) / x.abs().max()
    assert second[0].scale.item() == expected_scale.item()
    assert first[1].scale.item() == 1.0  # weight slot saw no amax: scale kept
    # a third set of quantizers casts with the updated scale
    third = state.make_quantizers()
    third[0].set_usage(rowwise=True, columnwise=False)
    y = torch.randn(32, 64)
    got = third[0](y).quantized_storage.data
    expected, _ = mf.numerics.quantize_with_scale(y, expected_scale, E4M3)
    assert_bitwise_equal(got, expected, "cast with the updated scale")
