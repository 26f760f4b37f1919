"""The loop's hooks around `TreePolicy.grow`: ``setup`` once per generate call, ``observe`` once per verified step
(a batch step is ONE outcome covering every row), ``may_draft`` False runs a plain step without calling ``grow``."""

import pytest
import torch

from hf_treespec.policies import POLICIES
from hf_treespec.policies.chain import ChainPolicy

from test_batched_generate import PAD, left_padded


@pytest.fixture
def recording_policy():
    """A chain policy that records its hook calls; it drafts only at even context lengths (a batch asks once per
    step, at its shortest row)."""
    calls = {"setup": [], "observe": [], "grow": 0}

    @POLICIES.register("recording_chain")
    class RecordingChain(ChainPolicy):
        def setup(self, setup):
            calls["setup"].append(setup.batch)
            super().setup(setup)

        def observe(self, outcome):
            calls["observe"].append(outcome)

        def may_draft(self, context_length):
            return context_length % 2 == 0

        def grow(self, root_token, *, context, capabilities=frozenset(), generator=None):
            calls["grow"] += 1
            return super().grow(root_token, context=context, capabilities=capabilities, generator=generator)

    yield calls
    POLICIES.unregister("recording_chain")


def test_single_sequence_hooks(target, drafters, prompt, recording_policy):
    ref = target.generate(prompt, do_sample=False, max_new_tokens=20)
    out = target.generate(prompt, do_sample=False, max_new_tokens=20, assistant_model=drafters["perturbed"],
                          tree_policy="recording_chain", tree_depth=3, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    calls = recording_policy
    assert calls["setup"] == [1]
    outcomes = calls["observe"]
    assert len(outcomes) == len(out.accepted_lengths)  # one per verified step (the last may stop early)
    assert all(len(o.trees) == 1 and len(o.accepted) == 1 for o in outcomes)
    drafted = [o for o in outcomes if o.trees[0].num_nodes > 1]
    assert calls["grow"] == len(drafted) > 0  # growth ran exactly where may_draft allowed it
    assert all(o.contexts[0].context_length % 2 == 0 for o in drafted)
    assert all(o.draft_rounds == 0 for o in outcomes if o.trees[0].num_nodes == 1)


def test_batch_step_is_one_outcome(target, drafters, recording_policy):
    ids, mask = left_padded()
    out = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=12, pad_token_id=PAD,
                          assistant_model=drafters["perturbed"], tree_policy="recording_chain", tree_depth=3,
                          return_dict_in_generate=True)
    calls = recording_policy
    assert calls["setup"] == [3]
    outcomes = calls["observe"]
    assert len(outcomes) == max(len(lengths) for lengths in out.row_accepted_lengths)
    assert len(outcomes[0].trees) == 3 and outcomes[0].tokens == sum(int(p.numel()) for p in outcomes[0].accepted)
