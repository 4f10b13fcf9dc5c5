"""The LoRA parameters `protect` registers (`_lora_parameters`): a walk of
the model by hand that must find what `named_parameters()` filtered by a
"lora_" part finds, in its order, under its names, with its rules for a
module or parameter met twice; a class with a walk of its own is asked
through `named_parameters` itself."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the transformers integration needs torch")
pytest.importorskip("transformers", reason="the transformers integration needs transformers (test extra)")
pytest.importorskip("peft", reason="the LoRA part needs peft (test extra)")

from concordia.demo.model import build  # noqa: E402
from concordia.integrations.transformers import _lora_parameters  # noqa: E402

nn = torch.nn


def _filtered(model) -> list:
    return [(n, p) for n, p in model.named_parameters() if ".lora_" in n or n.startswith("lora_")]


def _same(model) -> list:
    got = list(_lora_parameters(model).items())
    want = _filtered(model)
    assert [n for n, _ in got] == [n for n, _ in want]
    assert all(a is b for (_, a), (_, b) in zip(got, want))
    return got


def test_a_peft_qwen3s_adapters_are_named_parameters_own():
    _, model = build("tiny", "cpu")
    got = _same(model)
    assert len(got) == 2 * 2 * 2   # two layers, q and v, A and B
    assert got[0][0] == "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"


class _Block(nn.Module):
    def __init__(self, shared: nn.Module, tied: nn.Parameter):
        super().__init__()
        self.base = nn.Linear(4, 4)
        self.lora_A = nn.ModuleDict({"default": nn.Linear(4, 2, bias=False)})
        self.lora_B = shared            # the same module under two blocks
        self.lora_scale = tied          # a parameter of its own name, shared with another block
        self.register_parameter("lora_gone", None)
        self.register_module("nothing", None)


def test_modules_and_parameters_met_twice_are_taken_once_where_named_parameters_takes_them():
    shared = nn.ModuleDict({"default": nn.Linear(2, 4, bias=False)})
    tied = nn.Parameter(torch.ones(1))
    model = nn.Sequential(_Block(shared, tied), _Block(shared, tied))
    model.lora_top = nn.Parameter(torch.zeros(2))   # a name beginning the path
    model.extra = nn.Linear(2, 2)
    model.extra.lora_scale = tied                   # met again, under another module
    got = dict(_same(model))
    assert "lora_top" in got and "0.lora_B.default.weight" in got and "1.lora_B.default.weight" not in got
    assert "0.lora_scale" in got and "1.lora_scale" not in got and "extra.lora_scale" not in got
    assert not any("lora_gone" in n for n in got)


class _OwnModules(nn.Module):
    """A module whose walk hides one of its children."""

    def __init__(self):
        super().__init__()
        self.lora_A = nn.Linear(2, 2)
        self.lora_hidden = nn.Linear(2, 2)

    def named_modules(self, memo=None, prefix="", remove_duplicate=True):
        for name, m in super().named_modules(memo, prefix, remove_duplicate):
            if "lora_hidden" not in name:
                yield name, m


class _OwnParameters(nn.Module):
    def __init__(self):
        super().__init__()
        self.lora_A = nn.Linear(2, 2)

    def named_parameters(self, prefix="", recurse=True, remove_duplicate=True):
        yield "lora_only.weight", self.lora_A.weight


@pytest.mark.parametrize("where", ["child", "root"])
def test_a_class_with_a_walk_of_its_own_is_asked_through_named_parameters(where):
    model = nn.Sequential(nn.Linear(2, 2), _OwnModules()) if where == "child" else _OwnParameters()
    got = dict(_same(model))
    assert not any("lora_hidden" in n for n in got)
    if where == "root":
        assert list(got) == ["lora_only.weight"]


def test_a_module_holding_its_parent_is_walked_once():
    model = nn.Sequential(nn.Linear(2, 2))
    model[0].lora_A = nn.Linear(2, 2)
    model[0].add_module("up", model)   # a cycle: named_modules meets the model once
    assert len(_same(model)) == 2


def _peft(model_kind: str = "tiny", **config):
    """The demo's tiny Qwen3 under a PEFT LoRA of `config` (q and v, r=4, by default)."""
    from peft import LoraConfig, get_peft_model

    from concordia.demo.model import SHAPES
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    base = Qwen3ForCausalLM(Qwen3Config(**SHAPES[model_kind]))
    return get_peft_model(base, LoraConfig(**{"r": 4, "target_modules": ["q_proj", "v_proj"], **config}))


@pytest.mark.filterwarnings("ignore:`lora_bias=True` was passed")   # (PEFT's: the base layers have no bias)
def test_a_peft_models_adapters_are_found_from_its_targets_as_the_walk_finds_them():
    """The PEFT path (`_peft_lora`: the targets PEFT lists, not every module)
    finds what the whole walk and `named_parameters` find, in their order."""
    from concordia.integrations.transformers import _lora_walk, _peft_lora

    _, model = build("tiny", "cpu")
    fast = _peft_lora(model)
    assert fast is not None and list(fast.items()) == list(_lora_walk(model).items())
    assert [n for n in fast] == [n for n, _ in _filtered(model)]
    # embeddings adapted too (lora_embedding_A, parameters of a ParameterDict), and a LoRA bias: the same
    for config in (dict(target_modules=["q_proj", "v_proj", "embed_tokens"]), dict(lora_bias=True)):
        model = _peft(**config)
        fast = _peft_lora(model)
        assert fast is not None and list(fast.items()) == list(_lora_walk(model).items())
        assert list(_lora_parameters(model)) == [n for n, _ in _filtered(model)]
        assert any("lora_embedding_A" in n or "lora_B.default.bias" in n for n in fast)


@pytest.mark.parametrize("config", [dict(modules_to_save=["lm_head"])], ids=["modules_to_save"])
def test_a_peft_model_whose_weights_lie_outside_its_targets_is_walked_whole(config):
    from concordia.integrations.transformers import _peft_lora

    model = _peft(**config)
    assert _peft_lora(model) is None
    _same(model)


def test_a_second_adapter_is_walked_whole():
    from peft import LoraConfig

    from concordia.integrations.transformers import _peft_lora

    model = _peft()
    model.add_adapter("other", LoraConfig(r=2, target_modules=["k_proj", "q_proj"]))
    assert _peft_lora(model) is None
    _same(model)


def test_an_adapter_added_then_the_first_deleted_is_found_in_the_modules_order():
    """PEFT lists a second adapter's targets after the first's and keeps the
    first's listed once it is deleted: the targets are taken in the order
    of the modules, as the walk takes them."""
    from peft import LoraConfig

    from concordia.integrations.transformers import _lora_walk, _peft_lora

    model = _peft()
    model.add_adapter("other", LoraConfig(r=2, target_modules=["k_proj", "q_proj"]))
    model.set_adapter("other")   # (the active one is not deleted)
    model.delete_adapter("default")
    fast = _peft_lora(model)
    assert fast is not None and list(fast.items()) == list(_lora_walk(model).items())
    assert list(fast) == [n for n, _ in _filtered(model)] and any(".k_proj." in n for n in fast)
