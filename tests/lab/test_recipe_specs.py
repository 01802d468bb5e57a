"""Recipe specs: every name, hybrid and suffix form, user factories, and the errors a typo gets."""

from __future__ import annotations

import textwrap

import pytest

import minifloat as mf
from minifloat.lab.recipe_specs import NAMED_RECIPES, parse_recipe, parse_recipes, recipes_help

N_LAYERS = 4


@pytest.mark.parametrize("name, kind", [
    ("fp8-delayed", mf.DelayedScaling), ("fp8-current", mf.Float8CurrentScaling),
    ("fp8-block", mf.Float8BlockScaling), ("mxfp8", mf.MXFP8BlockScaling),
    ("nvfp4", mf.NVFP4BlockScaling),
])
def test_named_recipes(name, kind):
    assert parse_recipe(name, N_LAYERS) == kind()


def test_bf16_is_no_quantization_and_labels_are_the_specs():
    parsed = parse_recipes(" bf16 , mxfp8 ", N_LAYERS)
    assert parsed == [("bf16", None), ("mxfp8", mf.MXFP8BlockScaling())]


def test_hybrid_forward_backward_and_per_gemm():
    mx, nv = mf.MXFP8BlockScaling(), mf.NVFP4BlockScaling()
    assert parse_recipe("hybrid:mxfp8/nvfp4", N_LAYERS) == mf.HybridRecipe(mx, nv, nv)
    assert parse_recipe("hybrid:fp8-block/nvfp4/bf16", N_LAYERS) == mf.HybridRecipe(
        mf.Float8BlockScaling(), nv, None)


def test_block_suffixes_resolve_against_n_layers():
    recipe = parse_recipe("hybrid:mxfp8/nvfp4@last2", N_LAYERS)
    assert recipe.high_precision == ("blocks.2.*", "blocks.3.*")
    assert recipe.fprop == mf.MXFP8BlockScaling() and recipe.wgrad == mf.NVFP4BlockScaling()
    combined = parse_recipe("mxfp8@first1@last1@hp=head+blocks.1.mlp.*:weight", N_LAYERS)
    assert combined == mf.HybridRecipe(
        mf.MXFP8BlockScaling(), mf.MXFP8BlockScaling(), mf.MXFP8BlockScaling(),
        ("blocks.0.*", "blocks.3.*", "head", "blocks.1.mlp.*:weight"))
    assert parse_recipe("nvfp4@last4", N_LAYERS).high_precision == tuple(
        f"blocks.{i}.*" for i in range(4))


@pytest.mark.parametrize("spec, fragment", [
    ("fp9", "unknown recipe 'fp9'"),
    ("MXFP8", "unknown recipe 'MXFP8'"),
    ("hybrid:mxfp8", "hybrid:FWD/BWD"),
    ("hybrid:mxfp8/nvfp5", "unknown recipe 'nvfp5'"),
    ("hybrid:a/b/c/d", "hybrid:FPROP/DGRAD/WGRAD"),
    ("mxfp8@last5", "the model has 4"),
    ("mxfp8@last0", "asks for 0 blocks"),
    ("mxfp8@middle", "unknown suffix @middle"),
    ("mxfp8@hp=", "at least one layer glob"),
    ("mxfp8@hp=head:output", "head:output"),
    ("bf16@last1", "already all high precision"),
    ("mxfp8,mxfp8", "listed twice"),
    ("", "empty"),
    ("mxfp8,", "empty recipe name"),
])
def test_bad_specs_name_the_token(spec, fragment):
    with pytest.raises(ValueError) as error:
        parse_recipes(spec, N_LAYERS)
    assert fragment in str(error.value)


def test_unknown_name_lists_the_valid_names():
    with pytest.raises(ValueError) as error:
        parse_recipes("bf16,fp8-latest", N_LAYERS)
    for name in NAMED_RECIPES:
        assert name in str(error.value)


USER_FILE = textwrap.dedent("""
    import minifloat as mf

    def recipe():
        return mf.HybridRecipe(fprop=mf.MXFP8BlockScaling(), dgrad=None, wgrad=None)

    def quantizer(role):
        if role.tensor_type == "grad_output":
            return mf.IdentityQuantizer()
        return mf.MXFP8Quantizer()

    def not_a_recipe():
        return 42

    def broken(role):
        raise RuntimeError("boom")

    def too_many(a, b):
        return None
""")


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "my_recipes.py"
    path.write_text(USER_FILE)
    return path


def test_factory_from_a_file(user_file):
    recipe = parse_recipe(f"{user_file}:recipe", N_LAYERS)
    assert recipe == mf.HybridRecipe(mf.MXFP8BlockScaling(), None, None)
    custom = parse_recipe(f"{user_file}:quantizer", N_LAYERS)
    assert isinstance(custom, mf.CustomRecipe)
    role = mf.QuantizerRole("linear", "grad_output", "head")
    assert isinstance(custom.qfactory(role), mf.IdentityQuantizer)


def test_factory_from_a_module(user_file, monkeypatch):
    monkeypatch.syspath_prepend(str(user_file.parent))
    assert isinstance(parse_recipe("my_recipes:quantizer", N_LAYERS), mf.CustomRecipe)
    assert isinstance(parse_recipe("minifloat.factories:mxfp8_like", N_LAYERS),
                      mf.CustomRecipe)


@pytest.mark.parametrize("function, fragment", [
    ("not_a_recipe", "must return a minifloat Recipe, got int"),
    ("broken", "raised"),
    ("too_many", "takes 2 arguments"),
    ("missing", "has no function 'missing'"),
])
def test_bad_factories(user_file, function, fragment):
    with pytest.raises(ValueError) as error:
        parse_recipe(f"{user_file}:{function}", N_LAYERS)
    assert fragment in str(error.value)


def test_missing_file_and_module(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        parse_recipe(f"{tmp_path}/nope.py:f", N_LAYERS)
    with pytest.raises(ValueError, match="cannot import module 'no_such_module_xyz'"):
        parse_recipe("no_such_module_xyz:f", N_LAYERS)


def test_help_lists_names_and_syntax():
    text = recipes_help()
    for fragment in (*NAMED_RECIPES, "hybrid:FWD/BWD", "hybrid:FPROP/DGRAD/WGRAD", "@lastN",
                     "@hp=", "module:function", "path/to/file.py:function"):
        assert fragment in text


def test_the_comparison_keeps_the_head_in_high_precision_unless_asked():
    """Issue 19: with head_in_high_precision (what compare asks for) every named or hybrid
    spec keeps the layer "head" out of quantization; @quantize-head opts back in; the bf16
    baseline and a user's factory are left as they are."""
    mx, nv = mf.MXFP8BlockScaling(), mf.NVFP4BlockScaling()
    assert parse_recipe("mxfp8", N_LAYERS, True) == mf.HybridRecipe(mx, mx, mx, ("head",))
    assert parse_recipe("mxfp8@quantize-head", N_LAYERS, True) == mx
    assert parse_recipe("hybrid:mxfp8/nvfp4", N_LAYERS, True) == mf.HybridRecipe(
        mx, nv, nv, ("head",))
    assert parse_recipe("nvfp4@last1", N_LAYERS, True).high_precision == (
        f"blocks.{N_LAYERS - 1}.*", "head")
    assert parse_recipe("bf16", N_LAYERS, True) is None
    assert isinstance(parse_recipe("minifloat.factories:mxfp8_like", N_LAYERS, True),
                      mf.CustomRecipe)
    assert parse_recipe("mxfp8", N_LAYERS) == mx  # the library's own default: as written
    labels = [label for label, _ in parse_recipes("bf16,fp8-current,fp8-current@quantize-head",
                                                  N_LAYERS, True)]
    assert labels == ["bf16", "fp8-current", "fp8-current@quantize-head"]
