"""Which adapter wraps an assistant model is an explicit rule (`as_drafter`): the accepting adapter of highest
``priority``; a tie at the top is an error that names the adapters, whatever their registration names."""

from __future__ import annotations

import pytest

from hf_treespec.drafters import (DRAFTER_ADAPTERS, CausalLMDrafter, FeatureDrafter, TreeSpecDrafterConfig,
                                  TreeSpecDrafterModel, as_drafter, prompt_lookup)

from conftest import tiny_llama


@pytest.fixture
def temporary_adapter():
    """Registers adapters for one test and unregisters them afterwards."""
    names = []

    def register(name: str, base: type, priority: int) -> type:
        adapter = DRAFTER_ADAPTERS.register(name)(type(f"Adapter_{name}", (base,), {"priority": priority}))
        names.append(name)
        return adapter

    yield register
    for name in names:
        DRAFTER_ADAPTERS.unregister(name)


def test_builtin_choices():
    target = tiny_llama(layers=2)
    assert type(as_drafter(tiny_llama(layers=1))) is CausalLMDrafter
    feature = TreeSpecDrafterModel(TreeSpecDrafterConfig.for_target(target.config)).eval()
    assert CausalLMDrafter.accepts(feature) and FeatureDrafter.accepts(feature)  # both accept: priority decides
    assert FeatureDrafter.priority > CausalLMDrafter.priority
    assert type(as_drafter(feature)) is FeatureDrafter
    lookup = prompt_lookup(target)
    assert as_drafter(lookup) is lookup  # a Drafter instance is used as given


def test_a_tie_at_the_top_priority_is_an_error_naming_both(temporary_adapter):
    # "a_causal" sorts before "causal_lm": under the old name-order rule it would have won silently
    temporary_adapter("a_causal", CausalLMDrafter, priority=0)
    with pytest.raises(ValueError, match=r"Ambiguous drafter adapters for a LlamaForCausalLM: 'a_causal' "
                                         r"\(Adapter_a_causal\), 'causal_lm' \(CausalLMDrafter\) all accept it at "
                                         r"priority 0"):
        as_drafter(tiny_llama(layers=1))


def test_a_higher_priority_wins_whatever_its_name(temporary_adapter):
    specific = temporary_adapter("zz_specific", CausalLMDrafter, priority=5)
    assert type(as_drafter(tiny_llama(layers=1))) is specific
