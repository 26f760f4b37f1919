"""GTO trainer: tree reward, group advantages, PPO ratio / clipping, batched tree rollouts, and training runs.

A tiny random Llama (vocab 64, hidden 32, 2 layers) plays the target, with a character-level tokenizer whose chat
template renders ``U+text/`` for user turns and ``A+text/`` for assistant turns (as in test_trainers.py).
"""

from __future__ import annotations

import math

import pytest
import torch

from conftest import train_cli
from test_trainers import conversations, target, tokenizer  # noqa: F401  (the tiny target of test_trainers)

from hf_treespec.policies.base import DraftSource
from hf_treespec.step_context import StepContext

from hf_treespec.drafters import TreeSpecDrafterConfig, TreeSpecDrafterModel
from hf_treespec.policies import POLICIES
from hf_treespec.tree import DraftTree
from hf_treespec.trainers import EAGLEConfig, EAGLETrainer, PrepareConfig, load_prepared, prepare_dataset
from hf_treespec.trainers.objectives.gto import (
    GTOCollator,
    GTOConfig,
    GTOTrainer,
    chain_levels,
    clipped_surrogate,
    frozen_copy,
    group_advantages,
    longest_accepted,
    path_logprob,
    sequence_acceptance,
    tree_reward,
)
from hf_treespec.trainers.objectives.tree_rollout import grow_drafter_trees, score_trees
from hf_treespec.trainers.objectives.unroll import unroll

torch.set_num_threads(1)

SMALL_TREES = dict(tree_topk=3, tree_budget=8, tree_depth=3, num_groups=2, group_size=3)


def make_drafter(target, seed: int = 0) -> TreeSpecDrafterModel:
    torch.manual_seed(seed)
    config = TreeSpecDrafterConfig.for_target(target.config, draft_vocab_size=48, share_target_embeddings=True,
                                              share_target_lm_head=True)
    drafter = TreeSpecDrafterModel(config)
    drafter.set_draft_vocab(torch.arange(8, 56))
    return drafter.tie_to_target(target)


@pytest.fixture(scope="module")
def data(target, tokenizer, tmp_path_factory):
    folder = tmp_path_factory.mktemp("gto")
    config = PrepareConfig(chunk_size=4, batch_tokens=256, storage_dtype="float32", target_layers=[-1])
    prepare_dataset(target, tokenizer, conversations(8), folder, config, progress=False)
    return load_prepared(folder)


@pytest.fixture(scope="module")
def warm_state(target, data, tmp_path_factory) -> dict:
    """A drafter warmed up with EAGLE's loss, so that some of its tree paths are accepted by the target."""
    drafter = make_drafter(target, seed=6)
    args = EAGLEConfig(output_dir=str(tmp_path_factory.mktemp("warm")), per_device_train_batch_size=4,
                       learning_rate=3e-3, max_steps=40, save_strategy="no", report_to="none", use_cpu=True,
                       disable_tqdm=True, lr_scheduler_type="constant", feature_weight=0.0, ce_weight=1.0)
    EAGLETrainer(drafter, args, target_model=target, train_dataset=data).train()
    return {k: v.clone() for k, v in drafter.state_dict().items()}


def _args(tmp_path, **overrides):
    values = dict(output_dir=str(tmp_path), per_device_train_batch_size=2, learning_rate=3e-3, max_steps=6,
                  logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, seed=0,
                  dataloader_num_workers=0, disable_tqdm=True, warmup_steps=0, lr_scheduler_type="constant",
                  **SMALL_TREES)
    values.update(overrides)
    return GTOConfig(**values)


def _params(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten().clone() for p in model.parameters()])


# ------------------------------------------------------------------------------------------------- reward math
def toy_tree() -> DraftTree:
    """root -> a (1) -> c (3) -> e (5);  root -> b (2) -> d (4). Leaves: e, d."""
    return DraftTree(tokens=torch.tensor([0, 1, 2, 3, 4, 5]), parents=torch.tensor([-1, 0, 0, 1, 2, 3]),
                     depth=torch.tensor([0, 1, 1, 2, 2, 3]), scores=torch.tensor([0.0, -0.1, -0.2, -0.3, -0.4, -0.5]))


def test_reward_on_a_hand_worked_tree():
    tree = toy_tree()
    accept = torch.tensor([1.0, 0.5, 0.4, 0.6, 0.5, 0.2])
    # sequence root-a-c-e: 0.5 + 0.5*0.6 + 0.5*0.6*0.2 = 0.86; root-b-d: 0.4 + 0.4*0.5 = 0.6
    lengths = sequence_acceptance(tree, accept)
    torch.testing.assert_close(lengths, torch.tensor([0.6, 0.86]))  # leaves in node order: d (4), e (5)
    expected = math.log(math.exp(0.86) + math.exp(0.6))
    assert float(tree_reward(tree, accept)) == pytest.approx(expected, abs=1e-6)
    assert float(tree_reward(tree, accept, eta=2.0)) == pytest.approx(math.log(math.exp(1.72) + math.exp(1.2)) / 2)
    assert float(tree_reward(tree, accept, aggregation="max")) == pytest.approx(0.86)
    assert float(tree_reward(tree, accept, aggregation="mean")) == pytest.approx(0.73)
    # temperature 0: indicators; a rejected node cuts its whole subtree
    greedy = torch.tensor([True, True, True, False, True, True])
    torch.testing.assert_close(sequence_acceptance(tree, greedy.float()), torch.tensor([2.0, 1.0]))
    assert longest_accepted(tree, greedy) == 4
    assert longest_accepted(tree, torch.tensor([True, False, False, True, True, True])) == 0
    root_only = DraftTree.root(7)
    assert float(tree_reward(root_only, torch.ones(1))) == 0.0


def test_logsumexp_reward_bounds_on_random_trees():
    generator = torch.Generator().manual_seed(0)
    for _ in range(30):
        n = int(torch.randint(2, 20, (1,), generator=generator))
        parents = torch.tensor([-1] + [int(torch.randint(0, i, (1,), generator=generator)) for i in range(1, n)])
        depth = torch.zeros(n, dtype=torch.long)
        for i in range(1, n):
            depth[i] = depth[parents[i]] + 1
        tree = DraftTree(tokens=torch.arange(n), parents=parents, depth=depth, scores=torch.zeros(n))
        accept = torch.rand(n, generator=generator)
        lengths = sequence_acceptance(tree, accept)
        for eta in (0.5, 1.0, 4.0):
            reward = float(tree_reward(tree, accept, eta))
            assert float(lengths.max()) - 1e-5 <= reward <= float(lengths.max()) + math.log(lengths.numel()) / eta + 1e-5


def test_group_advantages_are_standardised_per_group():
    rewards = torch.tensor([[1.0, 2.0, 3.0, 6.0], [5.0, 5.0, 5.0, 5.0]])
    adv = group_advantages(rewards, eps=1e-4)
    torch.testing.assert_close(adv.mean(-1), torch.zeros(2), atol=1e-6, rtol=0)
    assert float(adv[0].std(unbiased=False)) == pytest.approx(1.0, abs=1e-3)
    assert torch.equal(adv[1], torch.zeros(4))  # a group of equal rewards teaches nothing
    assert adv[0].argsort().tolist() == [0, 1, 2, 3]
    # shifting or scaling a group's rewards leaves its advantages unchanged
    torch.testing.assert_close(group_advantages(rewards[:1] * 3 + 7), adv[:1], atol=1e-4, rtol=1e-4)


def test_clipped_surrogate_and_its_gradient():
    ratio = torch.tensor([1.0, 1.5, 1.5, 0.5, 0.5, 1.1], requires_grad=True)
    adv = torch.tensor([1.0, 1.0, -1.0, 1.0, -1.0, -2.0])
    objective, clipped = clipped_surrogate(ratio, adv, 0.2)
    torch.testing.assert_close(objective.detach(), torch.tensor([1.0, 1.2, -1.5, 0.5, -0.8, -2.2]))
    assert clipped.tolist() == [False, True, False, False, True, False]
    objective.sum().backward()
    # clipped samples stop pushing; the others move the ratio along their advantage
    torch.testing.assert_close(ratio.grad, torch.tensor([1.0, 0.0, -1.0, 1.0, 0.0, -2.0]))


# ------------------------------------------------------------------------------------------------ rollouts
class DraftSourceByHand(DraftSource):
    """The reference rollout: the drafter run on one root's prefix, then along each path, feature by feature."""

    def __init__(self, drafter, ids, feats, column):
        self.drafter, self.ids, self.feats, self.column = drafter, ids, feats, column

    def logprobs(self, tree, nodes):
        rows = []
        for node in nodes.tolist():
            with torch.no_grad():
                out = self.drafter(self.ids[:, : self.column + 1], target_hidden_states=self.feats[:, : self.column + 1],
                                   use_cache=True)
                feature, cache, logits = out.hidden_states[:, -1:], out.cache, out.logits[0, -1]
                for x in tree.path_to(node)[1:].tolist():
                    step = self.drafter(tree.tokens[x].view(1, 1), features=feature, cache=cache,
                                        use_cache=True)
                    feature, logits = step.hidden_states, step.logits[0, 0]
            rows.append(torch.log_softmax(self.drafter.target_logits(logits.float()), -1))
        return torch.stack(rows)


def test_lockstep_rollouts_match_the_policy_run_alone(target, data):
    drafter = make_drafter(target, seed=3).eval()
    collator = GTOCollator.from_prepared(data, num_groups=2, group_size=2)
    batch = collator([data.dataset[i] for i in range(3)])
    valid = batch["group_valid"]
    rows, groups = valid.nonzero(as_tuple=True)
    positions = batch["group_positions"][rows, groups]
    rows, positions = rows[:, None].expand_as(positions).reshape(-1), positions.reshape(-1)
    policy = POLICIES.get("eagle2")(tree_topk=3, tree_budget=8, tree_depth=3)
    trees = grow_drafter_trees(drafter, batch["input_ids"], batch["target_hidden_states"], batch["attention_mask"],
                               rows, positions, policy, topk=3)
    assert len(trees) == rows.numel() >= 6
    for tree, row, position in list(zip(trees, rows.tolist(), positions.tolist()))[::2]:
        source = DraftSourceByHand(drafter, batch["input_ids"][row:row + 1],
                                   batch["target_hidden_states"][row:row + 1], position - 1)
        root = int(batch["sequence_ids"][row, position])
        reference = policy.build(source, root, context=StepContext(root))
        assert tree.tokens.tolist() == reference.tokens.tolist()
        assert tree.parents.tolist() == reference.parents.tolist()
        torch.testing.assert_close(tree.scores, reference.scores, atol=1e-4, rtol=1e-4)

    # the target's acceptance of every node, checked against a plain forward over prefix + path
    accept = score_trees(target, batch["sequence_ids"], batch["sequence_lengths"], trees, rows, positions,
                         temperature=1.0, chunk_tokens=4)
    checked = 0
    for tree, acc, row, position in list(zip(trees, accept, rows.tolist(), positions.tolist()))[:4]:
        prefix = batch["sequence_ids"][row, : position + 1].tolist()
        for node in range(1, tree.num_nodes):
            path = tree.tokens[tree.path_to(node)[1:]].tolist()
            with torch.no_grad():
                logits = target(torch.tensor([prefix + path[:-1]])).logits[0, -1]
            probs = torch.softmax(logits.float(), -1)
            assert float(acc.probs[node]) == pytest.approx(float(probs[path[-1]]), abs=1e-5)
            assert bool(acc.greedy[node]) == (int(probs.argmax()) == path[-1])
            checked += 1
    assert checked >= 8

    # the unroll along chosen paths gives the drafter's own tree scores (same masks, same features)
    chosen = [int(tree.depth.argmax()) for tree in trees]
    lengths = torch.tensor([int(tree.depth[node]) for tree, node in zip(trees, chosen)])
    paths = torch.zeros(len(trees), int(lengths.max()), dtype=torch.long)
    for i, (tree, node) in enumerate(zip(trees, chosen)):
        paths[i, : lengths[i]] = tree.paths()[node, 1: int(lengths[i]) + 1]
    levels, local = chain_levels(rows, positions - 1, paths, lengths, batch["input_ids"].shape[0])
    with torch.no_grad():
        out = unroll(drafter, batch["input_ids"], batch["target_hidden_states"], batch["attention_mask"], levels)
    logp = path_logprob(drafter, out, levels, rows, positions - 1, local, paths, lengths)
    torch.testing.assert_close(logp, torch.stack([tree.scores[node] for tree, node in zip(trees, chosen)]),
                               atol=1e-4, rtol=1e-4)


def test_collator_windows_are_adjacent_assistant_positions(data):
    collator = GTOCollator.from_prepared(data, num_groups=3, group_size=4, seed=1)
    rows = [data.dataset[i] for i in range(4)]
    batch = collator(rows)
    again = GTOCollator.from_prepared(data, num_groups=3, group_size=4, seed=1)([rows[2]])
    assert torch.equal(again["group_positions"][0], batch["group_positions"][2])  # independent of batching
    for b, row in enumerate(rows):
        taken = set()
        for k in batch["group_valid"][b].nonzero().squeeze(-1).tolist():
            window = batch["group_positions"][b, k].tolist()
            assert window == list(range(window[0], window[0] + 4))
            assert all(row["loss_mask"][s + 1] == 1 and s >= 1 for s in window)
            assert not taken & set(window)
            taken |= set(window)
        assert batch["group_valid"][b].sum() >= 1


def test_config_defaults_are_the_papers():
    args = GTOConfig(output_dir="unused", report_to="none")
    assert (args.eta, args.num_groups, args.group_size, args.omega, args.clip_epsilon) == (1.0, 16, 8, 0.5, 0.2)
    assert (args.tree_topk, args.tree_budget, args.tree_depth) == (10, 60, 7)
    assert (args.learning_rate, args.warmup_steps, args.max_grad_norm) == (5e-6, 1000, 0.5)
    assert (args.adam_beta1, args.adam_beta2) == (0.9, 0.95)
    assert args.reward_aggregation == "logsumexp" and args.debias
    with pytest.raises(ValueError, match="reward_aggregation"):
        GTOConfig(output_dir="unused", reward_aggregation="median")
    with pytest.raises(ValueError, match="samples"):
        GTOConfig(output_dir="unused", tree_policy="iid")


# ------------------------------------------------------------------------------------------------- training
def test_training_lowers_the_loss_changes_the_drafter_and_not_the_reference(target, data, tmp_path):
    drafter = make_drafter(target, seed=5)
    start = _params(drafter)
    trainer = GTOTrainer(drafter, _args(tmp_path, max_steps=12, learning_rate=3e-4), target_model=target,
                         train_dataset=data)
    ref_start = _params(trainer.ref_model)
    assert torch.equal(ref_start, start)
    trainer.train()
    logs = [log for log in trainer.state.log_history if "loss" in log]
    losses = [log["loss"] for log in logs]
    assert len(losses) == 12 and sum(losses[-3:]) < sum(losses[:3]), losses
    for key in ("reward", "debiased_reward", "clip_fraction", "accepted_length", "ref_reward"):
        assert all(key in log for log in logs), (key, logs[0])
    assert any(log["clip_fraction"] > 0 or abs(log["debiased_reward"]) > 0 for log in logs[1:])
    assert (_params(drafter) - start).abs().max() > 1e-3
    assert torch.equal(_params(trainer.ref_model), ref_start)
    assert not any(p.requires_grad for p in trainer.ref_model.parameters())
    optimised = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert not optimised & {id(p) for p in trainer.ref_model.parameters()}
    assert not any(p.grad is not None for p in target.parameters())


def test_gto_step_moves_the_accepted_paths_along_their_advantages(target, data, warm_state, tmp_path):
    """GTO alone (no L_token): a small gradient step raises sum_i A_i log M(S_i) / l_i, the first-order change of
    the surrogate, on the very sequences it was computed on."""
    drafter = make_drafter(target, seed=6)
    drafter.load_state_dict(warm_state)
    args = _args(tmp_path, token_loss_weight=0.0, omega=1.0, debias=False)
    trainer = GTOTrainer(drafter, args, target_model=target, train_dataset=data)
    batch = trainer.data_collator([data.dataset[i] for i in range(4)])
    terms = trainer.gto_terms(drafter, batch)
    levels, rows, columns, local, paths, lengths = terms["chains"]
    assert int(lengths.max()) >= 1 and terms["advantages"].abs().sum() > 0
    context = (batch["input_ids"], batch["target_hidden_states"], batch["attention_mask"])

    def weighted_likelihood() -> float:
        with torch.no_grad():
            log_m = path_logprob(drafter, unroll(drafter, *context, levels), levels, rows, columns, local, paths,
                                 lengths)
        return float((terms["advantages"].flatten() * log_m / lengths.clamp(min=1)).sum())

    before = weighted_likelihood()
    (terms["gto_sum"]).backward()
    with torch.no_grad():
        for p in drafter.parameters():
            if p.grad is not None:
                p.sub_(1e-3 * p.grad)
    assert weighted_likelihood() > before


def test_gradient_accumulation_matches_the_full_batch(target, data, warm_state, tmp_path):
    """One step on 2 sequences equals 2 accumulated micro-batches of 1 (L_token over the window's positions, L_GTO
    over its windows). The reference differs from the drafter, so the GTO term is not zero."""
    params = []
    for batch, accumulation, omega in ((2, 1, 0.5), (1, 2, 0.5), (2, 1, 0.0)):
        drafter = make_drafter(target, seed=1)
        drafter.load_state_dict(warm_state)
        args = _args(tmp_path / f"{batch}-{omega}", per_device_train_batch_size=batch, max_steps=1, omega=omega,
                     gradient_accumulation_steps=accumulation, max_grad_norm=1e9, optim="sgd", learning_rate=1.0)
        trainer = GTOTrainer(drafter, args, target_model=target, train_dataset=data,
                             ref_model=frozen_copy(make_drafter(target, seed=1), target))
        trainer.train()
        params.append(_params(drafter))
    start = make_drafter(target, seed=1)
    start.load_state_dict(warm_state)
    assert (params[0] - _params(start)).abs().max() > 1e-3
    torch.testing.assert_close(params[0], params[1], atol=1e-5, rtol=1e-4)
    assert (params[0] - params[2]).abs().max() > 1e-4  # the GTO term took part in the update


def test_cli_trains_and_resumes(target, tokenizer, tmp_path, capsys):
    import json

    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    make_drafter(target, seed=2).save_pretrained(tmp_path / "init")
    (tmp_path / "convs.jsonl").write_text("\n".join(json.dumps(r) for r in conversations(4, seed=9)) + "\n")
    run = train_cli(tmp_path / "target", capsys)

    run("prepare", "--data-file", str(tmp_path / "convs.jsonl"), "--dtype", "fp32", "--tree-policy", "none",
        "--output", str(tmp_path / "data"))
    common = ["gto", "--data", str(tmp_path / "data"), "--init", str(tmp_path / "init"), "--output-dir",
              str(tmp_path / "gto"), "--batch-size", "2", "--grad-accum", "1", "--save-strategy", "steps", "--save-steps", "1", "--lr", "1e-3",
              "--warmup", "0", "--num-groups", "2", "--group-size", "3", "--tree-topk", "3", "--tree-budget", "6",
              "--tree-depth", "3", "--logging-steps", "1"]
    first = run(*common, "--max-steps", "1")
    assert first["steps"] == 1 and "reward" in first["last_log"] and (tmp_path / "gto" / "checkpoint-1").is_dir()
    resumed = run(*common, "--max-steps", "2", "--resume")
    assert resumed["steps"] == 2 and (tmp_path / "gto" / "checkpoint-2").is_dir()
    saved = TreeSpecDrafterModel.from_pretrained(tmp_path / "gto")
    assert not torch.equal(saved.fc.weight, TreeSpecDrafterModel.from_pretrained(tmp_path / "init").fc.weight)
