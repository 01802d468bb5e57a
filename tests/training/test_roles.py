"""Roles a Linear emits (seed 001 review: no "output"/"grad_input" types; the output slot carries
its consumer's input role, configurable with set_consumer_roles) and their delivery to
CustomRecipe factories."""

from __future__ import annotations

from collections import Counter

import torch

import minifloat as mf
from minifloat import CustomRecipe, QuantizerRole

from ._reference import E4M3, E5M2


class RecordingFactory:
    def __init__(self) -> None:
        self.roles: list[QuantizerRole] = []

    def __call__(self, role: QuantizerRole):
        self.roles.append(role)
        if role.tensor_type == "grad_output":
            return mf.Float8CurrentScalingQuantizer(E5M2)
        return mf.Float8CurrentScalingQuantizer(E4M3)


def test_linear_roles_counts():
    lin = mf.Linear(32, 32, name="fc1")
    roles = lin.get_quantizer_roles(True) + lin.get_quantizer_roles(False)
    counts = Counter(role.tensor_type for role in roles)
    assert counts == {"input": 2, "weight": 1, "grad_output": 2}
    assert all(isinstance(role, QuantizerRole) for role in roles)
    assert {role.tensor_type for role in roles} <= {"input", "weight", "grad_output"}
    # the module's own slots carry its type and name
    forward = lin.get_quantizer_roles(True)
    assert forward[0] == QuantizerRole("linear", "input", "fc1")
    assert forward[1] == QuantizerRole("linear", "weight", "fc1")
    assert lin.get_quantizer_roles(False)[0] == QuantizerRole("linear", "grad_output", "fc1")


def test_set_consumer_roles_changes_the_roles():
    lin = mf.Linear(32, 32, name="proj")
    dpa = QuantizerRole("dpa", "input", "attn")
    lin.set_consumer_roles(output=dpa)
    forward = lin.get_quantizer_roles(True)
    assert dpa in forward
    assert Counter(r.tensor_type for r in forward) == {"input": 2, "weight": 1}
    grad_consumer = QuantizerRole("dpa", "grad_output", "attn")
    lin.set_consumer_roles(grad_input=grad_consumer)
    backward = lin.get_quantizer_roles(False)
    assert grad_consumer in backward
    assert dpa in lin.get_quantizer_roles(True)  # the earlier setting is kept


def test_consumer_roles_reach_the_custom_factory():
    factory = RecordingFactory()
    recipe = CustomRecipe(factory)
    lin = mf.Linear(32, 32, name="proj")
    dpa = QuantizerRole("dpa", "input", "attn")
    dpa_grad = QuantizerRole("dpa", "grad_output", "attn")
    lin.set_consumer_roles(output=dpa, grad_input=dpa_grad)
    x = torch.randn(16, 32, requires_grad=True)
    with mf.autocast(recipe=recipe):
        y = lin(x)
    y.sum().backward()
    assert dpa in factory.roles and dpa_grad in factory.roles
    assert Counter(r.tensor_type for r in factory.roles) == {
        "input": 2, "weight": 1, "grad_output": 2}
    assert QuantizerRole("linear", "weight", "proj") in factory.roles
    # quantizers are built once per slot: a second step calls the factory no more
    calls = len(factory.roles)
    assert calls == 5
    with mf.autocast(recipe=recipe):
        y = lin(x)
    y.sum().backward()
    assert len(factory.roles) == calls


def test_set_consumer_roles_after_first_use_rebuilds_quantizers():
    factory = RecordingFactory()
    recipe = CustomRecipe(factory)
    lin = mf.Linear(32, 32, name="proj")
    x = torch.randn(16, 32)
    with mf.autocast(recipe=recipe):
        lin(x)
    assert QuantizerRole("linear", "input", "proj") in factory.roles
    dpa = QuantizerRole("dpa", "input", "attn")
    assert dpa not in factory.roles
    lin.set_consumer_roles(output=dpa)
    with mf.autocast(recipe=recipe):
        lin(x)
    assert dpa in factory.roles
