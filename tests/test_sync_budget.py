"""A sync budget per decoding step: `SyncCounter` counts, on the CPU, the operations of a step that would make the host
wait for a GPU (device -> host reads, host -> device copies); these tests fail when a step needs more than the budget
stated below, and check that the counter sees a planted read, so a regression cannot slip through unseen."""

import pytest
import torch

from hf_treespec.kv.tree_kv import keep_rows, to_device
from hf_treespec.policies import base as policy_base
from hf_treespec.policies import swor as swor_policy
from hf_treespec.verifiers import topdown
from hf_treespec.drafters import TreeSpecDrafterConfig, TreeSpecDrafterModel
from sync_counter import SyncCounter
from hf_treespec.tree import to_host
from transformers import DynamicCache

from conftest import fixed_budget

#: most syncs (host waits: runs of transfers with no device work between them) one complete step may cost, single
#: sequence, the feature drafter; measured on this file's tiny pair (4-layer target, one-layer random feature
#: drafter, 24 new tokens) plus a margin of 1 or 2. A tree policy's drafting costs about one sync per draft depth (its
#: tokens reach the host tree), verification one (the target's choices), the commit one at most (the accepted path's
#: indices); sampling verifiers add a read per visited node (the accept / reject draw).
BUDGET = {  # measured worst step: chain 7 / 14, eagle2 10 / 11, salf 4 / 6, dyspec 4 / 17, iid 23 / 26
    ("chain", "greedy"): 8, ("chain", "sampling"): 16,
    ("eagle2", "greedy"): 11, ("eagle2", "sampling"): 12,
    ("salf", "greedy"): 5, ("salf", "sampling"): 7,
    ("dyspec", "greedy"): 5, ("dyspec", "sampling"): 19,
    ("iid", "greedy"): 24, ("iid", "sampling"): 28,
}
#: the same for a batch of 4 prompts (salf, greedy; measured worst step 22): one forward per draft round for the
#: whole batch, but per-row reads and copies around it, each row's tree bookkeeping included (2-3 reads per row; the
#: counter sees them since the rows' policies run on the calling thread: on the lockstep threads of before, the
#: counter's thread-local modes missed them, and the same step counted 11)
BATCH_BUDGET = 24


@pytest.fixture(autouse=True)
def as_on_a_device(monkeypatch):
    """The counter stands for a device on the CPU: the compaction of a draw to the columns q can draw
    (`support_columns`, CPU only: its ``nonzero`` would wait for a device) stays off, as it does on a device."""
    for module in (swor_policy, topdown, policy_base):
        monkeypatch.setattr(module, "support_columns", lambda probs, within=None: within)


@pytest.fixture(scope="module")
def feature_drafter(target):
    torch.manual_seed(0)
    return TreeSpecDrafterModel(TreeSpecDrafterConfig.for_target(target.config)).eval()


def count_steps(target, drafter, ids, mask=None, **kwargs):
    return run_counted(target, drafter, ids, mask, **kwargs).steps


def run_counted(target, drafter, ids, mask=None, **kwargs) -> SyncCounter:
    mask = torch.ones_like(ids) if mask is None else mask
    with torch.no_grad(), SyncCounter(target, drafter) as counter:
        counter.mark(ids, mask)
        target.generate(ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=24, pad_token_id=0,
                        **kwargs)
    assert len(counter.steps) >= 3, "too few complete steps to hold to a budget"
    return counter


def mode_kwargs(mode):
    return dict(do_sample=True, temperature=1.0, top_k=8) if mode == "sampling" else dict(do_sample=False)


@pytest.mark.parametrize("policy,mode", sorted(BUDGET))
def test_syncs_per_step_within_budget(target, feature_drafter, prompt, policy, mode):
    torch.manual_seed(0)
    # the budgets were measured on fixed 60-node trees
    steps = count_steps(target, feature_drafter, prompt, tree_policy=policy, **fixed_budget(policy),
                        **mode_kwargs(mode))
    worst = max(step.syncs for step in steps)
    assert worst <= BUDGET[policy, mode], (
        f"{policy} / {mode}: a step costs {worst} syncs, over the budget of {BUDGET[policy, mode]}; transfers of the "
        f"worst step: {[(e.kind, e.op) for e in max(steps, key=lambda s: s.syncs).events]}")


def test_batch_syncs_per_step_within_budget(target, feature_drafter):
    torch.manual_seed(4)
    ids = torch.randint(1, 64, (4, 10))
    mask = torch.ones_like(ids)
    mask[1, :3] = mask[3, :5] = 0  # left padding
    steps = count_steps(target, feature_drafter, ids, mask, tree_policy="salf", tree_budget=60,
                        do_sample=False)
    assert max(step.syncs for step in steps) <= BATCH_BUDGET


def test_a_planted_read_is_counted(target, feature_drafter, prompt):
    """An ``.item()`` on the drafter's output after every draft forward: one more read per draft forward, and more
    syncs in the worst step. Without this the budget tests could pass with a blind counter."""
    clean = run_counted(target, feature_drafter, prompt, tree_policy="salf", tree_budget=60, do_sample=False)
    forwards = []

    def read_one_logit(module, args, out):  # returns None: the output is left as it is
        out.logits[0, -1, 0].item()

    planted = [feature_drafter.register_forward_hook(read_one_logit),
               feature_drafter.register_forward_pre_hook(lambda module, args: forwards.append(1))]
    try:
        dirty = run_counted(target, feature_drafter, prompt, tree_policy="salf", tree_budget=60, do_sample=False)
    finally:
        for hook in planted:
            hook.remove()
    assert len(dirty.steps) == len(clean.steps) and forwards  # the same decoding, step for step
    assert dirty.reads - clean.reads == len(forwards)
    assert all(after.syncs >= before.syncs for before, after in zip(clean.steps, dirty.steps))
    assert max(s.syncs for s in dirty.steps) > max(s.syncs for s in clean.steps)


def test_counter_rules():
    """Host work is free; device reads and copies count; transfers in a row are one sync."""
    layer = torch.nn.Linear(4, 4)
    with torch.no_grad(), SyncCounter(layer) as counter:
        host = torch.arange(6)
        int(host.sum()), host.tolist(), host.cpu()  # host only: nothing
        assert counter.syncs == 0
        out = layer(torch.ones(2, 4))  # the host input: one copy
        assert [e.kind for e in counter.events] == ["copy"]
        on_host = out.cpu()  # a read: the host copy is no longer a device tensor
        float(on_host.sum())
        assert [e.kind for e in counter.events] == ["copy", "read"]
        a, b = to_host(out[0], out[1])  # two reads in a row: one sync
        float(out.sum())  # device work, then a read: a new sync
        kinds = [(e.kind, e.waits) for e in counter.events]
        assert kinds[2:] == [("read", False), ("read", False), ("read", True)]
        ids, positions = to_device("cpu", torch.arange(3), torch.arange(3))  # moved together: one copy
        layer.weight[:3] + ids[:, None] + positions[:, None]
        assert [e.kind for e in counter.events[5:]] == ["copy"]
        (out > 0).nonzero()  # a data-dependent shape: a read
        assert counter.events[-1].op.startswith("aten.nonzero")


def test_keep_rows_moves_its_index_once():
    """The kept rows' index reaches the device once per commit, not once per layer."""
    cache = DynamicCache()
    for index in range(6):
        cache.update(torch.randn(1, 2, 10, 4), torch.randn(1, 2, 10, 4), index)
    holder = torch.nn.Module()
    with torch.no_grad(), SyncCounter(holder) as counter:
        counter.mark(*(t for layer in cache.layers for t in (layer.keys, layer.values)))
        keep_rows(cache, 4, [1, 3])
    assert counter.copies == 1
    assert cache.layers[5].keys.shape[-2] == 6
