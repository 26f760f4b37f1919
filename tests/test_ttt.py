"""EAGLE-3 inputs (low / mid / high target layers) and the training-time test (TTT) with TALF's tree loss on top:
the merged unroll equals its parts, labels line up, and a drafter trained a few steps in eagle3 mode round-trips
through ``AutoModel`` and decodes losslessly with every tree policy."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModel

import hf_treespec
from hf_treespec.policies import POLICIES, DelaySelector, DelaySelectorConfig
from hf_treespec.policies.nde import action_space
from hf_treespec.trainers import TALFCollator, TTTCollator, TreeLevels, load_prepared, prepare_dataset, unroll
from hf_treespec.trainers.data.prepared import PrepareConfig
from hf_treespec.trainers.objectives.ttt import infer_input_mode, merge_levels, resolve_target_layers

from conftest import assert_drafted, confident_classifier, fixed_budget, tiny_llama, train_cli
from test_trainers import TREES, conversations, make_drafter, target, tokenizer  # noqa: F401  (module fixtures)

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def talf_data(target, tokenizer, tmp_path_factory):  # noqa: F811
    folder = tmp_path_factory.mktemp("ttt")
    config = PrepareConfig(chunk_size=4, batch_tokens=256, storage_dtype="float32", tree_positions=4, **TREES)
    prepare_dataset(target, tokenizer, conversations(4, seed=11), folder, config, progress=False)
    return load_prepared(folder)


def test_eagle3_layers_follow_the_target_depth():
    assert resolve_target_layers("eagle3", None, 30) == [1, 14, 26]  # SmolLM2-135M: low / mid / high
    assert resolve_target_layers("fc", None, 30) == [-1]
    assert resolve_target_layers("eagle3", [2, 5, 7], 30) == [2, 5, 7]  # explicit layers win
    with pytest.raises(ValueError, match="target_layers"):
        resolve_target_layers("eagle3", None, 4)  # too shallow for three distinct layers
    assert infer_input_mode("auto", [1, 14, 26]) == "eagle3" and infer_input_mode("auto", [-1]) == "fc"
    with pytest.raises(ValueError, match="input mode"):
        infer_input_mode("eagle2", [-1])


def test_ttt_batch_chains_every_position_and_keeps_the_trees(talf_data):
    rows = [talf_data.dataset[i] for i in range(2)]
    steps = 6
    batch = TTTCollator.from_prepared(talf_data, steps=steps)(rows)
    talf = TALFCollator.from_prepared(talf_data)(rows)
    levels = TreeLevels.from_batch(batch)
    assert levels.bounds.shape[0] == steps - 1  # the chain is the deepest part: 5 fed-back steps
    width = batch["input_ids"].shape[1]
    index = (levels.roots + levels.depth).clamp(max=width - 1)
    for b in range(2):
        length = int(batch["attention_mask"][b].sum())
        for d in range(1, steps):
            # a chain node at every root j with j + d inside the row: token x[j + d], label state at j + d
            chain = (levels.depth[b] == d) & levels.valid[b] & (levels.tokens[b] == batch["input_ids"][b, index[b]]) \
                & (batch["node_label_hidden"][b] == batch["label_hidden"][b, index[b]]).all(-1)
            assert int(chain.sum()) >= length - d
    # the stored target trees' nodes are all there, with their own label states
    assert int(batch["node_loss_mask"].sum()) >= int(talf["node_loss_mask"].sum())
    stored = talf["node_label_hidden"][talf["node_loss_mask"]]
    kept = batch["node_label_hidden"][batch["node_loss_mask"]]
    for state in stored:
        assert (kept == state).all(-1).any()
    assert int(batch["labels"].ne(-100).sum()) == int(batch["context_mask"].sum() + batch["node_loss_mask"].sum())
    chain_only = TTTCollator.from_prepared(talf_data, steps=steps, tree_loss=False)(rows)  # --no-tree-loss
    assert int(chain_only["node_loss_mask"].sum()) == int(batch["node_loss_mask"].sum() - talf["node_loss_mask"].sum())
    assert "node_label_hidden" in chain_only and chain_only["level_bounds"].shape[0] == steps - 1


def test_merged_unroll_equals_each_part_alone(target, talf_data):  # noqa: F811
    """Chain nodes and tree nodes in one unroll see exactly what they would see alone (the forest mask)."""
    drafter = make_drafter(target, seed=3).eval()
    rows = [talf_data.dataset[i] for i in range(2)]
    batch = TALFCollator.from_prepared(talf_data)(rows)
    from hf_treespec.trainers.data.collators import chain_levels

    chain = chain_levels(batch["input_ids"], batch["attention_mask"].sum(-1), 3)
    trees = TreeLevels.from_batch(batch)
    merged, chain_slots, tree_slots = merge_levels(chain, trees)
    args = (drafter, batch["input_ids"], batch["target_hidden_states"], batch["attention_mask"])
    with torch.no_grad():
        both = unroll(*args, merged)
        alone = [unroll(*args, chain), unroll(*args, trees)]
    for part, slots in zip((chain, trees), (chain_slots, tree_slots)):
        out = alone[0] if part is chain else alone[1]
        valid = part.valid
        torch.testing.assert_close(both.node_logits[:, slots][valid], out.node_logits[valid], atol=2e-5, rtol=1e-4)
    assert torch.equal(merged.valid[:, chain_slots], chain.valid) and torch.equal(merged.valid[:, tree_slots],
                                                                                    trees.valid)


def _selector(hidden: int) -> DelaySelector:
    torch.manual_seed(0)
    actions = action_space((1, 2), (0, 1, 2), (1, 2))
    return DelaySelector(DelaySelectorConfig(actions=[list(a) for a in actions],
                                             hidden_inputs={"target_hidden": hidden}, shared_dim=8)).eval()


SMALL_TREES = {"chain": dict(tree_depth=4), "eagle2": dict(tree_depth=4, tree_topk=4), "optimal": {}, "salf": {},
               "delayed": {}, "iid": {}, "swor": {}, "nde": {}}
SMALL_BUDGET = 16  # nodes of the policies sized by tree_budget (pinned at each call: ``fixed_budget(policy, 16)``)


def test_eagle3_ttt_drafter_round_trips_and_decodes_losslessly(tokenizer, tmp_path, capsys):  # noqa: F811
    """CLI: prepare --input-mode eagle3 (+ TALF trees) -> train ttt -> AutoModel -> greedy identity, every policy."""

    deep = tiny_llama(seed=5, layers=8)  # deep enough for EAGLE-3's three distinct default layers
    deep.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    (tmp_path / "convs.jsonl").write_text("\n".join(json.dumps(r) for r in conversations(6, seed=13)) + "\n")
    run = train_cli(tmp_path / "target", capsys)

    source = ["--data-file", str(tmp_path / "convs.jsonl"), "--dtype", "fp32", "--storage-dtype", "float32",
              "--input-mode", "eagle3"]
    run("prepare", *source, "--num-conversations", "6", "--tree-positions", "3", "--output", str(tmp_path / "data"))
    data = load_prepared(tmp_path / "data")
    assert data.config.target_layers == [1, 3, 4] and data.config.stores_last_hidden
    run("prepare", *source, "--num-conversations", "2", "--tree-policy", "chain", "--tree-depth", "5",
        "--tree-positions", "all", "--output", str(tmp_path / "dev"))
    summary = run("ttt", "--data", str(tmp_path / "data"), "--output-dir", str(tmp_path / "ttt"), "--max-steps",
                  "3", "--precision", "fp32", "--batch-size", "2", "--draft-vocab-size", "48", "--ttt-steps", "5",
                  "--step-decay", "0.8", "--logging-steps", "1")
    assert summary["steps"] == 3 and summary["objective"] == "ttt"
    logged = set(json.loads((tmp_path / "ttt" / "training_summary.json").read_text())["last_log"])
    assert "top1_d5" in logged  # the fifth drafted token was trained on the drafter's own features
    result = run("evaluate", "--data", str(tmp_path / "dev"), "--drafter", str(tmp_path / "ttt"))
    assert result[str(tmp_path / "ttt")]["roots"] > 0

    enabled = hf_treespec.enable(deep)
    drafter = AutoModel.from_pretrained(tmp_path / "ttt")
    assert type(drafter).__name__ == "TreeSpecDrafterModel"
    assert drafter.config.input_mode == "eagle3" and drafter.config.target_layers == [1, 3, 4]
    assert drafter.config.draft_vocab_size == 48 and not (tmp_path / "ttt" / "delay_selector").exists()
    drafter = drafter.eval().tie_to_target(enabled)
    prompt = torch.randint(0, 64, (1, 10), generator=torch.Generator().manual_seed(4))
    ref = enabled.generate(prompt, do_sample=False, max_new_tokens=24)
    for policy in POLICIES:
        extra = {"nde": dict(tree_selector=_selector(32)),
                 "c2t": dict(c2t_classifier=confident_classifier())}.get(policy, {})
        out = enabled.generate(prompt, do_sample=False, max_new_tokens=24, assistant_model=drafter,
                               tree_policy=policy, return_dict_in_generate=True, **fixed_budget(policy, SMALL_BUDGET),
                               **SMALL_TREES.get(policy, {}), **extra)
        assert_drafted(out, accepting=False)  # three training steps: acceptance is not the point here
        assert torch.equal(out.sequences, ref), policy


def test_steps_decay_as_eagle3_weighs_them():
    """EAGLE-3 weighs training-time-test step i by 0.8^i: the default; 1 turns the decay off."""
    from hf_treespec.trainers.objectives.ttt import TTTConfig, TTTTrainer

    depth = torch.tensor([1, 2, 3, 7])
    trainer = TTTTrainer.__new__(TTTTrainer)
    trainer.args = TTTConfig(output_dir="unused")
    assert trainer.args.step_decay == 0.8
    assert torch.allclose(trainer.item_weights(depth), torch.tensor([1.0, 0.8, 0.64, 0.8 ** 6]))
    trainer.args = TTTConfig(output_dir="unused", step_decay=1.0)
    assert trainer.item_weights(depth) is None


@pytest.mark.parametrize("steps", [3, 7])
def test_a_training_loss_reads_the_device_a_few_times_whatever_the_depth(target, talf_data, tmp_path, steps):  # noqa: F811
    """On a GPU each device -> host read stalls the step. The loss of a TTT micro-batch (trees + a chain of
    ``steps`` passes) reads: the level bounds once, the two loss masks once each (they size the scored items), and
    transformers' padding check twice; its metrics stay on the device until a log step, so the count does not grow
    with the depth. Before, every depth's metrics cost reads (47 at 7 steps)."""
    from sync_counter import SyncCounter
    from hf_treespec.trainers.objectives.ttt import TTTConfig, TTTTrainer
    from test_trainers import _args

    drafter = make_drafter(target)
    trainer = TTTTrainer(drafter, _args(TTTConfig, tmp_path, ttt_steps=steps), target_model=target,
                         train_dataset=talf_data)
    batch = trainer.data_collator([talf_data.dataset[i] for i in range(2)])
    assert batch["level_bounds"].shape[0] == steps - 1
    trainer.compute_loss(trainer.model, batch)  # memoises the drafter's vocabulary check (once per drafter)
    with SyncCounter(drafter, target, trainer.target_head) as counter:
        counter.mark(*(value for value in batch.values() if isinstance(value, torch.Tensor)))
        trainer.compute_loss(trainer.model, batch)
    assert counter.reads <= 5, [event for event in counter.events if event.kind == "read"]
    # the metrics of both micro-batches reach the log, per depth, as host numbers
    logs = {}
    trainer.log(logs)
    assert isinstance(logs["top1_d1"], float) and f"ce_d{steps}" in logs
