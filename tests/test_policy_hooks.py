"""The loop's hooks around `TreePolicy.grow`: ``setup`` once per generate call, ``observe`` once per verified step
(a batch step is ONE outcome covering every row); the loop's sizing (``tree_budget="auto"``), not the policy, decides
whether a step drafts: where it says no, the step is a plain one and ``grow`` is not called."""

import pytest
import torch

from hf_treespec.policies import POLICIES
from hf_treespec.policies.chain import ChainPolicy

from conftest import assert_drafted
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

        def grow(self, root_token, *, context, capabilities=frozenset(), generator=None):
            calls["grow"] += 1
            return super().grow(root_token, context=context, capabilities=capabilities, generator=generator)

    yield calls
    POLICIES.unregister("recording_chain")


def test_single_sequence_hooks(target, drafters, prompt, recording_policy):
    ref = target.generate(prompt, do_sample=False, max_new_tokens=20)
    out = target.generate(prompt, do_sample=False, max_new_tokens=20, assistant_model=drafters["perturbed"],
                          tree_policy="recording_chain", tree_depth=3, return_dict_in_generate=True)
    assert_drafted(out)
    assert torch.equal(out.sequences, ref)
    calls = recording_policy
    assert calls["setup"] == [1]
    outcomes = calls["observe"]
    assert len(outcomes) == len(out.accepted_lengths)  # one per verified step (the last may stop early)
    assert all(len(o.trees) == 1 and len(o.accepted) == 1 for o in outcomes)
    drafted = [o for o in outcomes if o.trees[0].num_nodes > 1]
    assert calls["grow"] == len(outcomes) and len(drafted) > 0  # a numeric budget: every step grows a tree
    assert all(o.contexts[0].budget is None for o in outcomes)  # the policy's own size: no step budget


def test_batch_step_is_one_outcome(target, drafters, recording_policy):
    ids, mask = left_padded()
    out = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=12, pad_token_id=PAD,
                          assistant_model=drafters["perturbed"], tree_policy="recording_chain", tree_depth=3,
                          return_dict_in_generate=True)
    assert_drafted(out)
    calls = recording_policy
    assert calls["setup"] == [3]
    outcomes = calls["observe"]
    assert len(outcomes) == max(len(lengths) for lengths in out.row_accepted_lengths)
    assert len(outcomes[0].trees) == 3 and outcomes[0].tokens == sum(int(p.numel()) for p in outcomes[0].accepted)


@pytest.mark.auto_budget
def test_sizing_decides_which_steps_draft(target, drafters, prompt, monkeypatch, recording_policy):
    """With ``tree_budget="auto"`` the loop's `TreeSizing` decides per step: where ``may_draft`` says no, no policy
    runs (a plain step, no drafter forward); where it says yes, each row grows with its own step budget."""
    from hf_treespec.generation.sizing import TreeSizing

    from hf_treespec.cost.curve import CostCurve

    sizes = [1, 2, 4, 8, 16, 32, 64]  # a pinned flat curve and a cheap drafter: every step the sizing allows drafts
    flat = CostCurve(sizes, [256], [[0.05 + 0.0001 * n for n in sizes]])
    monkeypatch.setattr("hf_treespec.cost.speed_model.load_or_calibrate", lambda model, *a, **k: flat)
    monkeypatch.setattr("hf_treespec.cost.speed_model.draft_cost_ratio", lambda target, drafter: 0.02)
    monkeypatch.setattr(TreeSizing, "may_draft", lambda self, context_length: context_length % 2 == 0)
    ref = target.generate(prompt, do_sample=False, max_new_tokens=20)
    out = target.generate(prompt, do_sample=False, max_new_tokens=20, assistant_model=drafters["perturbed"],
                          tree_policy="salf", tree_budget="auto", return_dict_in_generate=True)
    assert_drafted(out)
    assert torch.equal(out.sequences, ref)
    lengths = prompt.shape[1] + 1 + torch.tensor([0, *out.accepted_lengths[:-1]]).cumsum(0)  # context per step
    drafted = [size > 0 for size in out.tree_sizes]
    assert not any(d for d, n in zip(drafted, lengths.tolist()) if n % 2)  # odd contexts: plain steps only
    assert all(d for d, n in zip(drafted, lengths.tolist()) if n % 2 == 0)  # even ones: every step drafted
