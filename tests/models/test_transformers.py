"""Hugging Face transformers models, built from small configs (no download), converted with
convert_model (issue 21): they train under every recipe with a loss that falls as the
high-precision run's does, `generate` works for prompts and single-token decode steps of any
length (rows padded inside minifloat for MXFP8's and NVFP4's row blocks), and converted models
round-trip through save_pretrained / from_pretrained with their state-dict keys unchanged
(GPT-2's Conv1D weights keep their [in, out] layout)."""

from __future__ import annotations

import warnings

import pytest
import torch

import minifloat as mf
from minifloat.modules.fused_experts import FusedExperts

transformers = pytest.importorskip("transformers")

SMALL = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 64}
MODELS = {
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL)),
    "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SMALL)),
    "mistral": lambda: transformers.MistralForCausalLM(transformers.MistralConfig(**SMALL)),
    "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64)),
    # mixtures of experts: fused 3-D expert weights on grouped GEMMs, routers in high precision
    "mixtral": lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **SMALL, num_local_experts=4, num_experts_per_tok=2)),
    "qwen3-moe": lambda: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **SMALL, moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2,
        head_dim=16)),
}
# linear layers a converted model holds per block: q, k, v, o, gate, up, down (Llama family);
# c_attn, c_proj (attention), c_fc, c_proj (MLP) for GPT-2's Conv1D
CONVERTED = {"llama": 14, "qwen2": 14, "mistral": 14, "gpt2": 8,
             "mixtral": 10, "qwen3-moe": 10}  # MoE: q, k, v, o and the experts, per block
RECIPES = {
    "delayed": mf.DelayedScaling,
    "current": mf.Float8CurrentScaling,
    "block": mf.Float8BlockScaling,
    "mxfp8": mf.MXFP8BlockScaling,
    "nvfp4": mf.NVFP4BlockScaling,
}
STEPS = 3


def build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return MODELS[name]()


def not_head(name: str, _module) -> bool:
    return name != "lm_head"  # the LM head stays in high precision, as the frameworks keep it


def tokens() -> torch.Tensor:
    return torch.randint(0, 128, (2, 13), generator=torch.Generator().manual_seed(1))


def train(model: torch.nn.Module, recipe) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batch, losses = tokens(), []
    for _ in range(STEPS):
        with mf.autocast(enabled=recipe is not None, recipe=recipe):
            loss = model(input_ids=batch, labels=batch).loss  # 26 rows: padded for MX/NVFP4
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("name", list(MODELS))
def test_converted_models_train_generate_and_round_trip(name, tmp_path):
    reference = train(build(name), None)
    for recipe_name, make in RECIPES.items():
        recipe = make()
        model = build(name)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # nothing left behind unsaid
            mf.convert_model(model, recipe=recipe, filter_fn=not_head)
        assert len(model.minifloat_conversion.converted) == CONVERTED[name], recipe_name
        losses = train(model, recipe)
        assert all(torch.isfinite(torch.tensor(losses))), (recipe_name, losses)
        drop, reference_drop = losses[0] - losses[-1], reference[0] - reference[-1]
        assert drop > 0.5 * reference_drop, (recipe_name, losses, reference)
        with torch.no_grad(), mf.autocast(recipe=recipe):  # a 7-token prompt, 1-token steps
            out = model.generate(tokens()[:1, :7], max_new_tokens=3, do_sample=False,
                                 pad_token_id=0)
        assert out.shape == (1, 10) and torch.equal(out[:, :7], tokens()[:1, :7])

    # save_pretrained from the converted model (last recipe), from_pretrained into the plain
    # class: the same keys, and the same weights (Conv1D's in its own layout)
    model.save_pretrained(tmp_path)
    plain = type(model).from_pretrained(tmp_path)
    converted_state = model.state_dict()
    plain_state = plain.state_dict()
    weights = {k for k in converted_state if not k.endswith("_extra_state")}
    assert weights == set(plain_state)
    for key in weights:
        assert torch.equal(converted_state[key], plain_state[key]), key
    batch = tokens()
    model.eval()  # from_pretrained returns an eval-mode model (GPT-2 has dropout)
    with torch.no_grad():  # outside autocast the converted model is the plain model (MoE:
        # grouped GEMMs sum a token's experts in another order than transformers' loop)
        assert torch.allclose(model(input_ids=batch).logits, plain(input_ids=batch).logits,
                              rtol=0, atol=1e-5)


def test_gpt2_conv1d_is_converted_with_its_layout_kept():
    model = build("gpt2").eval()  # no dropout: outputs compare
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = tokens()
    with torch.no_grad():
        expected = model(input_ids=x).logits
    mf.convert_model(model, recipe=mf.Float8CurrentScaling(), filter_fn=not_head)
    attention = model.transformer.h[0].attn.c_attn
    assert isinstance(attention, mf.Linear) and attention.weight.shape == (192, 64)
    after = model.state_dict()
    for key, value in before.items():
        assert torch.equal(after[key], value), key  # [in, out] in the state dict, as saved
    with torch.no_grad():
        assert torch.allclose(model(input_ids=x).logits, expected, atol=1e-5)


def test_fused_experts_compute_as_transformers_does_and_keep_their_keys():
    """Outside autocast the converted experts compute what transformers' own loop does (to
    float summation order); the parameters keep their names; the routers stay; a fused-expert
    module of another layout (here: gate/up halves swapped) is left in high precision, said."""
    model = build("mixtral").eval()
    keys = set(model.state_dict())
    x = tokens()
    with torch.no_grad():
        expected = model(input_ids=x).logits
    mf.convert_model(model, recipe=mf.MXFP8BlockScaling(), filter_fn=not_head)
    assert isinstance(model.model.layers[0].mlp.experts, FusedExperts)
    assert type(model.model.layers[0].mlp.gate).__name__ == "MixtralTopKRouter"
    assert {k for k in model.state_dict() if not k.endswith("_extra_state")} == keys
    with torch.no_grad():
        assert torch.allclose(model(input_ids=x).logits, expected, atol=1e-5)

    other = build("mixtral")
    experts = other.model.layers[0].mlp.experts

    def swapped_halves(hidden_states, top_k_index, top_k_weights):  # up first, then gate
        out = torch.zeros_like(hidden_states)
        for k in range(top_k_index.shape[1]):
            for t in range(hidden_states.shape[0]):
                e = int(top_k_index[t, k])
                up, gate = (hidden_states[t] @ experts.gate_up_proj[e].t()).chunk(2)
                h = (experts.act_fn(gate) * up) @ experts.down_proj[e].t()
                out[t] += h * top_k_weights[t, k]
        return out

    experts.forward = swapped_halves
    with pytest.warns(UserWarning, match="do not compute as Mixtral"):
        mf.convert_model(other, recipe=mf.Float8CurrentScaling(), filter_fn=not_head)
    assert not isinstance(other.model.layers[0].mlp.experts, FusedExperts)
    assert isinstance(other.model.layers[1].mlp.experts, FusedExperts)


def test_bf16_experts_run_by_another_kernel_are_still_converted():
    """On CUDA transformers runs its experts with grouped_mm, whose bf16 sums round otherwise
    than FusedExperts' GEMMs: the conversion check must accept that (an elementwise bf16
    comparison refused every expert of a Mixtral on an H200, which then trained in bf16)."""
    model = build("mixtral").to(torch.bfloat16)
    experts = model.model.layers[0].mlp.experts
    with torch.no_grad():  # outputs of order one: a bf16 rounding is then above 1e-3
        experts.gate_up_proj.normal_(0, 0.5)
        experts.down_proj.normal_(0, 0.5)

    def rounded_otherwise(hidden_states, top_k_index, top_k_weights):
        """The same math, each expert's output rounded to bf16 and summed in bf16 (the
        elementwise bf16 test refuses this; a relative error norm accepts it)."""
        out = torch.zeros_like(hidden_states)
        for k in range(top_k_index.shape[1]):
            for t in range(hidden_states.shape[0]):
                e = int(top_k_index[t, k])
                gate, up = (hidden_states[t].double() @ experts.gate_up_proj[e].double().t()
                            ).chunk(2)
                h = (experts.act_fn(gate) * up) @ experts.down_proj[e].double().t()
                out[t] += h.to(out.dtype) * top_k_weights[t, k]
        return out

    experts.forward = rounded_otherwise
    mf.convert_model(model, recipe=mf.Float8CurrentScaling(), filter_fn=not_head)
    assert isinstance(model.model.layers[0].mlp.experts, FusedExperts)


def weight_quantizations(model: torch.nn.Module, run) -> int:
    """How many times `run()` quantizes one of the model's weights."""
    from minifloat.quantizers.base import Quantizer

    pointers = {p.data_ptr() for p in model.parameters()}
    count, original = [0], Quantizer.quantize

    def counting(self, x):
        count[0] += x.data_ptr() in pointers
        return original(self, x)

    Quantizer.quantize = Quantizer.__call__ = counting
    try:
        run()
    finally:
        Quantizer.quantize = Quantizer.__call__ = original
    return count[0]


@pytest.mark.parametrize("recipe", [mf.Float8CurrentScaling(), mf.MXFP8BlockScaling()],
                         ids=["current", "mxfp8"])
def test_generate_quantizes_each_weight_once_inside_quantize_weights_once(recipe):
    model = build("llama")
    mf.convert_model(model, recipe=recipe, filter_fn=not_head)
    prompt = tokens()[:1, :7]

    def generate(once: bool):
        with torch.no_grad(), mf.autocast(recipe=recipe):
            if not once:
                return model.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)
            with mf.quantize_weights_once(small_m_rows=0):  # the recipe's quantized GEMMs
                return model.generate(prompt, max_new_tokens=4, do_sample=False,
                                      pad_token_id=0)

    outputs = {}
    per_token = weight_quantizations(model, lambda: outputs.update(plain=generate(False)))
    once = weight_quantizations(model, lambda: outputs.update(once=generate(True)))
    assert per_token == 14 * 4  # the prompt's forward and 3 decode steps
    assert once == 14
    assert torch.equal(outputs["once"], outputs["plain"])  # the same weights' bytes


@pytest.mark.parametrize("recipe", [mf.Float8CurrentScaling(), mf.MXFP8BlockScaling()],
                         ids=["current", "mxfp8"])
def test_generate_under_the_small_m_rule_equals_dequantized_weights(recipe):
    """quantize_weights_once's default: the prompt (7 rows) and the decode steps run against
    the weights quantized once and dequantized; the reference is the model with those weights
    written into it and no autocast (plain F.linear), generating the same tokens."""
    model = build("llama")
    mf.convert_model(model, recipe=recipe, filter_fn=not_head)
    prompt = tokens()[:1, :7]
    outputs = []

    def generate() -> None:
        with torch.no_grad(), mf.autocast(recipe=recipe), mf.quantize_weights_once():
            outputs.append(model.generate(prompt, max_new_tokens=4, do_sample=False,
                                          pad_token_id=0))

    assert weight_quantizations(model, generate) == 14
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, mf.Linear):
                quantizer = module.quantizers(recipe)[0][1].copy()
                quantizer.set_usage(rowwise=True, columnwise=False)
                module.weight.copy_(quantizer(module.weight).dequantize(dtype=module.weight.dtype))
        reference = model.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(outputs[0], reference)


def test_hf_trainer_fine_tunes_under_autocast(tmp_path):
    """transformers' Trainer with autocast around compute_loss (the README's recipe): the
    converted GEMMs run quantized (delayed scaling records amaxes into every module's history),
    the loss falls, and evaluation runs through the same compute_loss."""
    recipe = mf.DelayedScaling()
    model = build("llama")
    mf.convert_model(model, recipe=recipe, filter_fn=not_head)

    class MinifloatTrainer(transformers.Trainer):
        def compute_loss(self, model, inputs, *args, **kwargs):
            with mf.autocast(recipe=recipe):
                return super().compute_loss(model, inputs, *args, **kwargs)

    rows = torch.randint(0, 16, (8, 33), generator=torch.Generator().manual_seed(0))
    dataset = [{"input_ids": row, "labels": row} for row in rows]
    arguments = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=12, per_device_train_batch_size=4,
        learning_rate=3e-3, report_to="none", save_strategy="no", logging_steps=1,
        use_cpu=True, seed=0)
    trainer = MinifloatTrainer(model=model, args=arguments, train_dataset=dataset,
                               eval_dataset=dataset[:4])
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 12 and all(loss == loss for loss in losses)
    assert losses[-1] < 0.8 * losses[0], losses
    histories = [state.amax_history for module in model.modules()
                 if isinstance(module, mf.Linear) for state in module.recipe_states(recipe)]
    assert len(histories) == 2 * 14 and all(h.abs().sum() > 0 for h in histories)
    evaluated = trainer.evaluate()["eval_loss"]  # the first half of the training rows
    assert evaluated == evaluated and evaluated < losses[0]
