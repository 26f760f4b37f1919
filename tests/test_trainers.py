"""Drafter training stack: chat masks, chunked/resumable extraction, target trees, unrolling, EAGLE/HASS/TALF trainers.

A tiny random Llama (vocab 64, hidden 32, 2 layers) plays the target, with a character-level fast tokenizer whose
chat template renders ``U+text/`` for user turns and ``A+text/`` for assistant turns.
"""

from __future__ import annotations

import json
import math
import random
import string
from dataclasses import replace

import pytest
import torch

from conftest import train_cli
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from hf_treespec.drafters import TreeSpecDrafterConfig, TreeSpecDrafterModel, build_draft_vocab
from hf_treespec.policies import POLICIES, DraftSource, StepContext
from hf_treespec.trainers import (
    EAGLEConfig,
    EAGLETrainer,
    HASSConfig,
    HASSTrainer,
    PrepareConfig,
    TALFCollator,
    TALFConfig,
    TALFTrainer,
    TargetHead,
    TreeLevels,
    acceptance_by_depth,
    load_prepared,
    prepare_dataset,
    tokenize_conversation,
    unroll,
)
from hf_treespec.trainers.data.prepared import CHUNK_PREFIX, decode_tensor

torch.set_num_threads(1)

VOCAB = 64
CHARS = (string.ascii_letters + string.digits + "+/")[:VOCAB]
TEMPLATE = ("{% for m in messages %}{{ m['role'][0] | upper }}+{{ m['content'] }}/{% endfor %}"
            "{% if add_generation_prompt %}A+{% endif %}")




def char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character, with a chat template: conversations of letters tokenize predictably."""
    tok = Tokenizer(models.WordLevel(vocab={c: i for i, c in enumerate(CHARS)}, unk_token="a"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    out = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="a", pad_token="a")
    out.chat_template = TEMPLATE
    return out


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return char_tokenizer()


def tiny_target() -> LlamaForCausalLM:
    """A 2-layer random Llama over the character vocabulary, seeded, with peaked distributions like a real LM's."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(12.0)
    return model


@pytest.fixture(scope="module")
def target() -> LlamaForCausalLM:
    return tiny_target()


def conversations(count: int, seed: int = 0) -> list[dict]:
    """ShareGPT-style records: short human turns, assistant answers with repeated patterns (learnable)."""
    rng = random.Random(seed)
    letters = string.ascii_lowercase
    records = []
    for i in range(count):
        turns = []
        for _ in range(rng.randint(1, 2)):
            turns.append({"from": "human", "value": "".join(rng.choice(letters) for _ in range(rng.randint(3, 6)))})
            word = "".join(rng.choice(letters) for _ in range(3))
            turns.append({"from": "gpt", "value": (word * 8)[: rng.randint(12, 20)]})
        records.append({"id": f"c{i}", "conversations": turns})
    return records


def make_drafter(target, draft_vocab: torch.Tensor | None = None, seed: int = 0) -> TreeSpecDrafterModel:
    torch.manual_seed(seed)
    size = VOCAB if draft_vocab is None else int(draft_vocab.numel())
    config = TreeSpecDrafterConfig.for_target(target.config, draft_vocab_size=size, share_target_embeddings=True,
                                              share_target_lm_head=True)
    drafter = TreeSpecDrafterModel(config)
    if draft_vocab is not None:
        drafter.set_draft_vocab(draft_vocab)
    return drafter.tie_to_target(target)


TREES = dict(tree_policy="eagle2", tree_params={"tree_topk": 4, "tree_depth": 3, "tree_budget": 60})


@pytest.fixture(scope="module")
def talf_data(target, tokenizer, tmp_path_factory):
    folder = tmp_path_factory.mktemp("talf")
    config = PrepareConfig(chunk_size=4, batch_tokens=256, storage_dtype="float32", tree_positions=6, **TREES)
    prepare_dataset(target, tokenizer, conversations(8), folder, config, progress=False)
    return load_prepared(folder)


# ----------------------------------------------------------------------------------------------------- data
def test_assistant_mask_covers_exactly_the_assistant_turns(tokenizer):
    messages = [{"role": "user", "content": "abc"}, {"role": "assistant", "content": "xyz"},
                {"role": "user", "content": "de"}, {"role": "assistant", "content": "qq"}]
    ids, mask = tokenize_conversation(tokenizer, messages)
    text = "".join(CHARS[i] for i in ids)
    assert text == "U+abc/A+xyz/U+de/A+qq/"
    assert "".join(c for c, m in zip(text, mask) if m) == "xyz/qq/"
    assert tokenize_conversation(tokenizer, messages, max_length=5)[0] == ids[:5]


def test_prepare_writes_chunks_and_resumes(target, tokenizer, tmp_path):
    config = PrepareConfig(chunk_size=2, batch_tokens=64)
    records = conversations(5)
    prepare_dataset(target, tokenizer, records, tmp_path, config, progress=False)
    chunks = sorted(p.name for p in tmp_path.glob(f"{CHUNK_PREFIX}*"))
    assert chunks == ["chunk-00000", "chunk-00001", "chunk-00002"]
    data = load_prepared(tmp_path)
    assert len(data.dataset) == 5 and data.hidden_size == 32
    row = data.dataset[3]
    ids = torch.tensor([row["input_ids"]])
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
    # layer -1 is the pre-norm last state: norm(stored) gives the target's logits
    stored = decode_tensor(row["hidden_states"], torch.bfloat16, 32)
    assert stored.shape == (ids.shape[1], 32)
    logits = target.lm_head(target.model.norm(stored.float()))
    assert (logits.argmax(-1) == out.logits[0].argmax(-1)).float().mean() > 0.9
    scored = sum(sum(m[1:]) for m in data.dataset["loss_mask"])
    assert int(data.token_counts.sum()) == scored

    # a crash mid-chunk leaves only a .tmp folder; a rerun redoes that chunk alone
    (tmp_path / "chunk-00001").rename(tmp_path / "chunk-00001.tmp")
    stamps = {name: (tmp_path / name / "chunk.json").stat().st_mtime_ns for name in ("chunk-00000", "chunk-00002")}
    calls = []
    handle = target.register_forward_hook(lambda *args: calls.append(1))
    try:
        prepare_dataset(target, tokenizer, records, tmp_path, config, progress=False)
    finally:
        handle.remove()
    assert 1 <= len(calls) <= 2  # only chunk 1's two conversations went through the target
    assert stamps == {name: (tmp_path / name / "chunk.json").stat().st_mtime_ns for name in stamps}
    assert not (tmp_path / "chunk-00001.tmp").exists() and len(load_prepared(tmp_path).dataset) == 5
    with pytest.raises(ValueError, match="different settings"):
        prepare_dataset(target, tokenizer, records, tmp_path, PrepareConfig(chunk_size=3), progress=False)


def test_several_prepared_folders_train_together(target, tokenizer, tmp_path):
    """ShareGPT's and regenerated answers live in separate folders; rows and token counts add up, and folders
    holding other kinds of rows are refused by name."""
    first, second, other = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    prepare_dataset(target, tokenizer, conversations(3), first, PrepareConfig(chunk_size=2), progress=False)
    prepare_dataset(target, tokenizer, conversations(2, seed=7), second, PrepareConfig(chunk_size=1, max_length=64),
                    progress=False)
    a, b = load_prepared(first), load_prepared(second)
    both = load_prepared([first, second])
    assert len(both.dataset) == 5 and both.dataset[3]["input_ids"] == b.dataset[0]["input_ids"]
    assert torch.equal(both.token_counts, a.token_counts + b.token_counts) and both.config == a.config
    assert both.sources == (str(first), str(second))
    prepare_dataset(target, tokenizer, conversations(1), other, PrepareConfig(target_layers=[0, -1]), progress=False)
    with pytest.raises(ValueError, match=f"{other}.*target_layers"):
        load_prepared([first, other])
    with pytest.raises(FileNotFoundError, match="not a prepared data folder"):
        load_prepared([first, tmp_path])


class DirectSource(DraftSource):
    """The reference: the target answers one tree's request with a plain forward per node (prefix + path)."""

    def __init__(self, target, prefix):
        self.target, self.prefix = target, prefix

    def logprobs(self, tree, nodes):
        rows = []
        for node in nodes.tolist():
            path = tree.tokens[tree.path_to(node)][1:].tolist()
            with torch.no_grad():
                logits = self.target(torch.tensor([self.prefix + path])).logits[0, -1]
            rows.append(torch.log_softmax(logits.float(), -1))
        return torch.stack(rows)


def test_talf_trees_match_the_policy_and_the_target(target, talf_data):
    data = talf_data
    head = TargetHead.from_target(target)
    checked = 0
    for row in data.dataset.select(range(3)):
        hidden = decode_tensor(row["tree_hidden"], torch.float32, 32)
        assert len(row["tree_roots"]) == min(6, sum(row["loss_mask"][2:]))
        offset = 0
        for position, tokens, parents in list(zip(row["tree_roots"], row["tree_tokens"], row["tree_parents"])):
            # EAGLE-2 k=4, depth 3: root + 4 children + a 4-node beam at depth 2, all expanded
            assert len(tokens) == 9 and parents[:5] == [-1, 0, 0, 0, 0] and all(1 <= p <= 4 for p in parents[5:])
            prefix = row["input_ids"][: position + 1]
            assert tokens[0] == prefix[-1]
            # the lockstep batch reproduces the policy run alone with an unbatched target
            reference = POLICIES.get("eagle2")(tree_topk=4, tree_depth=3, tree_budget=60).build(
                DirectSource(target, prefix), prefix[-1], context=StepContext(prefix[-1]))
            expanded = reference.select(reference.num_children() > 0)
            assert tokens == expanded.tokens.tolist() and parents == expanded.parents.tolist()
            for node in (1, 6, 8):  # per-node labels = the target's distribution recomputed from scratch
                path, x = [], node
                while x > 0:
                    path.append(tokens[x])
                    x = parents[x]
                with torch.no_grad():
                    expected = torch.softmax(target(torch.tensor([prefix + path[::-1]])).logits[0, -1], -1)
                got = head.log_probs(hidden[offset + node - 1]).exp()
                torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
                checked += 1
            offset += len(tokens) - 1
        assert offset == hidden.shape[0]
    assert checked >= 6


def test_unroll_matches_feeding_each_path_step_by_step(target, talf_data):
    drafter = make_drafter(target, seed=3).eval()
    rows = [talf_data.dataset[i] for i in range(2)]
    batch = TALFCollator.from_prepared(talf_data)(rows)
    levels = TreeLevels.from_batch(batch)
    with torch.no_grad():
        out = unroll(drafter, batch["input_ids"], batch["target_hidden_states"], batch["attention_mask"], levels)
    checked = 0
    for b in range(2):
        nodes = levels.valid[b].nonzero().squeeze(-1).tolist()
        for slot in nodes[:: max(1, len(nodes) // 5)]:
            chain, x = [], slot
            while x >= 0:
                chain.append(x)
                x = int(levels.parents[b, x])
            chain = chain[::-1]
            root = int(levels.roots[b, slot])
            with torch.no_grad():  # reference: causal prefix up to the root, then the path with fed-back features
                ctx = drafter(batch["input_ids"][b:b + 1, : root + 1],
                              target_hidden_states=batch["target_hidden_states"][b:b + 1, : root + 1], use_cache=True)
                feature, cache = ctx.hidden_states[:, -1:], ctx.cache
                for node in chain:
                    step = drafter(levels.tokens[b:b + 1, node:node + 1], features=feature, cache=cache,
                                   use_cache=True)
                    feature = step.hidden_states
            torch.testing.assert_close(out.node_logits[b, slot], step.logits[0, 0], atol=1e-4, rtol=1e-4)
            checked += 1
    assert checked >= 4


def _prenorm(target, ids: torch.Tensor) -> torch.Tensor:
    from hf_treespec.features import capture_hidden_states

    with torch.no_grad(), capture_hidden_states(target, [-1]) as captured:
        target(ids)
    return captured.hidden_states


# ------------------------------------------------------------------------------------------------- trainers
def _args(config_cls, tmp_path, **overrides):
    values = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, learning_rate=3e-3, max_steps=24,
                  logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, seed=0,
                  dataloader_num_workers=0, disable_tqdm=True, warmup_steps=0, lr_scheduler_type="constant")
    values.update(overrides)
    return config_cls(**values)


def _losses(trainer) -> list[float]:
    return [log["loss"] for log in trainer.state.log_history if "loss" in log]


@pytest.mark.parametrize("trainer_cls, config_cls", [(EAGLETrainer, EAGLEConfig), (HASSTrainer, HASSConfig),
                                                     (TALFTrainer, TALFConfig)])
def test_trainer_loss_falls(trainer_cls, config_cls, target, talf_data, tmp_path):
    vocab = build_draft_vocab(talf_data.token_counts + 1, 48)[0]  # a reduced draft vocabulary, as on real targets
    drafter = make_drafter(target, vocab)
    trainer = trainer_cls(drafter, _args(config_cls, tmp_path), target_model=target, train_dataset=talf_data)
    trainer.train()
    losses = _losses(trainer)
    assert len(losses) == 24
    # soft cross-entropy has the target's entropy as its floor: ask for a clear fall, and for agreement to rise
    assert sum(losses[-4:]) / 4 < 0.9 * sum(losses[:4]) / 4, losses
    top1 = [log["top1_d1"] for log in trainer.state.log_history if "top1_d1" in log]
    assert sum(top1[-4:]) > sum(top1[:4]) + 0.4, top1
    logged = {key for log in trainer.state.log_history for key in log}
    assert "top1_d1" in logged
    if trainer_cls is not EAGLETrainer:
        assert {"top1_d2", "top1_d3"} <= logged  # unrolled depths are trained and reported
    assert not any(p.grad is not None and p.grad.abs().sum() > 0 for p in target.parameters())


def test_loss_is_normalised_over_the_accumulation_window(target, talf_data, tmp_path):
    """One optimizer step on 2 sequences equals two accumulated micro-batches of 1 (items counted over the window)."""
    params = []
    for batch, accumulation in ((2, 1), (1, 2)):
        drafter = make_drafter(target, seed=1)
        args = _args(TALFConfig, tmp_path / f"{batch}", per_device_train_batch_size=batch, max_steps=1,
                     gradient_accumulation_steps=accumulation, max_grad_norm=1e9, optim="sgd", learning_rate=1.0)
        TALFTrainer(drafter, args, target_model=target, train_dataset=talf_data).train()
        params.append(torch.cat([p.detach().flatten() for p in drafter.parameters()]))
    start = torch.cat([p.detach().flatten() for p in make_drafter(target, seed=1).parameters()])
    assert (params[0] - start).abs().max() > 1e-3  # the step moved the weights
    torch.testing.assert_close(params[0], params[1], atol=1e-6, rtol=1e-5)


def test_resume_from_checkpoint_reproduces_the_run(target, talf_data, tmp_path):
    def run(folder, max_steps, resume=None):
        drafter = make_drafter(target, seed=2)
        args = _args(EAGLEConfig, folder, max_steps=max_steps, save_strategy="steps", save_steps=3)
        trainer = EAGLETrainer(drafter, args, target_model=target, train_dataset=talf_data)
        trainer.train(resume_from_checkpoint=resume)
        return torch.cat([p.detach().flatten() for p in drafter.parameters()])

    full = run(tmp_path / "full", 6)
    run(tmp_path / "cut", 3)
    resumed = run(tmp_path / "cut", 6, resume=str(tmp_path / "cut" / "checkpoint-3"))
    torch.testing.assert_close(resumed, full, atol=1e-5, rtol=1e-4)


def _random_forest_rows(rng, count=4):
    rows = []
    for _ in range(count):
        nodes = []
        for _ in range(rng.randint(0, 12)):
            shallower = [j for j, node in enumerate(nodes) if node[3] < 4]
            parent = rng.choice([-1] + shallower)
            nodes.append((rng.randrange(50), parent, rng.randrange(9), 1 if parent < 0 else nodes[parent][3] + 1))
        rows.append(nodes)
    return rows


def test_ancestor_mask_matches_the_draft_tree():
    """The unroll's ancestor mask (built where the batch lives, level by level) equals DraftTree's on random forests."""
    from hf_treespec.tree import DraftTree

    rows = _random_forest_rows(random.Random(5))
    levels, _ = TreeLevels.from_rows(rows)
    mask = levels.ancestors()
    for b in range(len(rows)):
        parents = torch.where(levels.valid[b] & (levels.parents[b] >= 0), levels.parents[b] + 1, 0)
        forest = DraftTree(tokens=torch.cat([torch.zeros(1, dtype=torch.long), levels.tokens[b]]),
                           parents=torch.cat([torch.full((1,), -1), parents]),
                           depth=torch.cat([torch.zeros(1, dtype=torch.long), levels.depth[b].clamp(min=1)]),
                           scores=torch.zeros(levels.tokens.shape[1] + 1))
        assert torch.equal(mask[b], forest.ancestor_mask()[1:, 1:])


def _layout_by_node(rows):
    """The padded node layout built one node at a time: the reference the vectorised ``TreeLevels.from_rows`` must
    equal (slots: within a depth, each row's nodes in listed order after the row's shallower levels' widths)."""
    levels = max((node[3] for row in rows for node in row), default=0)
    widths = [max(sum(1 for node in row if node[3] == d) for row in rows) for d in range(1, levels + 1)]
    starts = [sum(widths[:i]) for i in range(levels)]
    out = {key: torch.full((len(rows), sum(widths)), fill, dtype=torch.long)
           for key, fill in (("tokens", 0), ("parents", -1), ("roots", 0), ("depth", 0), ("valid", 0))}
    slots = []
    for b, row in enumerate(rows):
        fill, slot_of = list(starts), []
        for token, parent, root, depth in row:
            slot_of.append(fill[depth - 1])
            fill[depth - 1] += 1
            for key, value in (("tokens", token), ("parents", slot_of[parent] if parent >= 0 else -1),
                               ("roots", root), ("depth", depth), ("valid", 1)):
                out[key][b, slot_of[-1]] = value
        slots.append(slot_of)
    return out, slots


def test_node_layout_equals_the_node_by_node_reference():
    rng = random.Random(11)
    for _ in range(20):
        rows = _random_forest_rows(rng)
        levels, slots = TreeLevels.from_rows(rows)
        expected, expected_slots = _layout_by_node(rows)
        for key, value in expected.items():
            assert torch.equal(getattr(levels, key).long(), value), key
        assert [slot.tolist() for slot in slots] == expected_slots
    for bad in ([(1, -1, 0, 2), (2, 0, 0, 2)], [(1, 1, 0, 1), (2, -1, 0, 1)], [(1, -1, 0, 0)]):
        with pytest.raises(ValueError, match="parents first"):  # wrong depth step, parent listed later, depth 0
            TreeLevels.from_rows([bad])


def test_stored_trees_unpack_to_their_nodes():
    """A prepared row's stored trees (root first, parents by local index) -> non-root nodes with depths and
    renumbered parents, as the node-by-node loop computed them; a parent after its node is refused by name."""
    from hf_treespec.trainers.data.collators import stored_tree_nodes

    rng = random.Random(3)
    row = {"tree_roots": [], "tree_tokens": [], "tree_parents": []}
    expected = []
    for position in (4, 9, 17):
        size = rng.randint(1, 9)
        parents = [-1] + [rng.randrange(i) for i in range(1, size)]
        tokens = [rng.randrange(50) for _ in range(size)]
        base, depth = len(expected), [0] * size
        for i in range(1, size):
            depth[i] = depth[parents[i]] + 1
            expected.append((tokens[i], base + parents[i] - 1 if parents[i] > 0 else -1, position - 1, depth[i]))
        row["tree_roots"].append(position)
        row["tree_tokens"].append(tokens)
        row["tree_parents"].append(parents)
    nodes = stored_tree_nodes(row)
    assert torch.stack(nodes, 1).tolist() == [list(node) for node in expected]
    row["tree_tokens"][1], row["tree_parents"][1] = [5, 6, 7], [-1, 2, 0]  # node 1's parent is node 2
    with pytest.raises(ValueError, match="must precede"):
        stored_tree_nodes(row)


def test_time_budget_schedule_follows_the_clock():
    from hf_treespec.trainers.objectives.time_budget import time_budget_factor

    assert time_budget_factor(0.05, "cosine", 0.1) == pytest.approx(0.5)  # half-way through the warm-up
    assert time_budget_factor(0.1, "cosine", 0.1) == pytest.approx(1.0)
    assert time_budget_factor(0.55, "cosine", 0.1) == pytest.approx(0.5)  # half-way through the decay
    assert time_budget_factor(1.0, "cosine", 0.1) == pytest.approx(0.0)
    assert time_budget_factor(3.0, "linear", 0.0) == 0.0  # past the budget: nothing left to learn at
    assert time_budget_factor(0.9, "constant", 0.5) == 1.0
    with pytest.raises(ValueError, match="lr_scheduler_type"):
        time_budget_factor(0.5, "polynomial", 0.0)


def test_time_budget_stops_training_annealed(target, talf_data, tmp_path, monkeypatch):
    """A spent budget ends the run before its epochs do, and the learning rate follows the clock down a cosine
    (a fake clock advancing one second per reading: one reading per optimizer step)."""
    import itertools
    import math
    import types

    from hf_treespec.trainers.objectives import time_budget

    ticks = itertools.count()
    monkeypatch.setattr(time_budget, "time", types.SimpleNamespace(monotonic=lambda: float(next(ticks))))
    drafter = make_drafter(target, seed=3)
    args = _args(TALFConfig, tmp_path, max_steps=-1, num_train_epochs=24, max_train_seconds=4.5,
                 lr_scheduler_type="cosine", learning_rate=1e-3)
    trainer = TALFTrainer(drafter, args, target_model=target, train_dataset=talf_data)
    result = trainer.train()
    assert result.global_step == 5 < 24 * -(-len(talf_data.dataset) // 4)  # readings 1..5 s; 5 >= 4.5 stops
    used = [log["learning_rate"] for log in trainer.state.log_history if "learning_rate" in log]
    expected = [1e-3 * 0.5 * (1 + math.cos(math.pi * k / 4.5)) for k in range(5)]  # step k+1 steps at reading k
    assert used == pytest.approx(expected, rel=1e-6)
    with pytest.raises(ValueError, match="fraction of the budget"):
        TALFTrainer(make_drafter(target), _args(TALFConfig, tmp_path, max_train_seconds=60, warmup_steps=10),
                    target_model=target, train_dataset=talf_data)


def test_acceptance_by_depth_on_chain_data(target, tokenizer, tmp_path):
    config = PrepareConfig(chunk_size=8, tree_policy="chain", tree_params={"tree_depth": 3}, tree_positions=None,
                           storage_dtype="float32")
    prepare_dataset(target, tokenizer, conversations(3, seed=5), tmp_path, config, progress=False)
    data = load_prepared(tmp_path)
    head = TargetHead.from_target(target)
    drafter = make_drafter(target, build_draft_vocab(torch.arange(VOCAB).flip(0), 40)[0])
    result = acceptance_by_depth(drafter, data, head, batch_size=2, progress=False)
    assert result["roots"] == sum(sum(m[2:]) for m in data.dataset["loss_mask"])
    hits = []  # depth 1 by hand: the drafter's argmax (as a target id) vs the target's argmax at every root
    for row in data.dataset:
        ids, roots = torch.tensor([row["input_ids"]]), torch.tensor(row["tree_roots"])
        with torch.no_grad():
            states = target(ids, output_hidden_states=True)
            drafted = drafter(ids[:, 1:], target_hidden_states=_prenorm(target, ids)[:, :-1]).logits[0]
        hits += (drafter.d2t[drafted[roots - 1].argmax(-1)] == states.logits[0, roots].argmax(-1)).tolist()
    assert result["top1_d1"] == pytest.approx(sum(hits) / len(hits), abs=1e-4)
    assert set(result) >= {"top1_d1", "top1_d3", "accept_d2", "tau_chain"}
    # tau_chain = 1 + E[leading accepted]; E[leading] = sum over depths of P(the first k all accepted)
    assert result["tau_chain"] == pytest.approx(1.0 + result["mean_accepted"], abs=1e-4)
    reach, expected = 1.0, 0.0
    for k in (1, 2, 3):
        reach *= result[f"accept_d{k}"] or 0.0
        expected += reach
    assert result["mean_accepted"] == pytest.approx(expected, abs=2e-3)
    json.dumps(result)
    assert result["accept_d1"] == result["top1_d1"] and result["mean_accepted"] <= 3
    eagle2_data = replace(data, config=replace(data.config, **TREES))
    with pytest.raises(ValueError, match="chain"):
        acceptance_by_depth(make_drafter(target), eagle2_data, head)


def test_unroll_under_bf16_autocast(target, talf_data):
    """Mixed precision (``bf16=True`` on CPU / GPU) runs the tree levels: masks follow the attention dtype."""
    drafter = make_drafter(target, seed=4)
    batch = TALFCollator.from_prepared(talf_data)([talf_data.dataset[0]])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = unroll(drafter, batch["input_ids"], batch["target_hidden_states"], batch["attention_mask"],
                     TreeLevels.from_batch(batch))
    out.node_logits.float().sum().backward()
    assert torch.isfinite(out.node_logits.float()).all()


def test_cli_prepare_train_evaluate(target, tokenizer, tmp_path, capsys):


    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    (tmp_path / "convs.jsonl").write_text("\n".join(json.dumps(r) for r in conversations(6, seed=9)) + "\n")
    run = train_cli(tmp_path / "target", capsys)

    source = ["--data-file", str(tmp_path / "convs.jsonl"), "--dtype", "fp32", "--storage-dtype", "float32"]
    summary = run("prepare", *source, "--skip", "2", "--num-conversations", "4", "--tree-positions", "3",
                  "--output", str(tmp_path / "train"))
    assert summary["conversations"] == 4 and summary["tokens"] > 0
    run("prepare", *source, "--num-conversations", "2", "--tree-policy", "chain", "--tree-positions", "all",
        "--output", str(tmp_path / "dev"))
    run("prepare", *source, "--num-conversations", "2", "--tree-positions", "3", "--output", str(tmp_path / "more"))
    common = ["--data", str(tmp_path / "train"), str(tmp_path / "more"), "--max-steps", "2", "--batch-size", "2",
              "--draft-vocab-size", "32"]
    eagle = run("eagle", *common, "--precision", "fp32", "--output-dir", str(tmp_path / "eagle"))
    assert eagle["steps"] == 2 and (tmp_path / "eagle" / "config.json").is_file()
    assert eagle["sequences"] == 6  # both folders: 4 + 2 conversations
    # bf16 autocast on a CPU: transformers refuses it unless the run says use_cpu, which the command adds
    talf = run("talf", *common, "--precision", "bf16", "--init", str(tmp_path / "eagle"),
               "--output-dir", str(tmp_path / "talf"))
    assert talf["steps"] == 2 and talf["bf16"] and math.isfinite(talf["train_loss"])
    run("prepare", *source, "--num-conversations", "1", "--tree-policy", "none", "--output", str(tmp_path / "flat"))
    with pytest.raises(ValueError, match="flat holds no target trees"):  # TALF needs the stored trees
        run("talf", "--data", str(tmp_path / "flat"), "--max-steps", "1", "--output-dir", str(tmp_path / "x"))
    with pytest.raises(ValueError, match=r"--draft-vocab-size 16 \(it has 32\)"):  # shape flags size new drafters
        run("talf", *common[:-1], "16", "--init", str(tmp_path / "eagle"), "--output-dir", str(tmp_path / "x"))
    # a larger --num-layers deepens --init; a bf16 checkpoint (as shipped) still trains fp32 master weights
    TreeSpecDrafterModel.from_pretrained(tmp_path / "eagle").to(torch.bfloat16).save_pretrained(tmp_path / "eagle16")
    deep = run("talf", *common, "--num-layers", "2", "--init", str(tmp_path / "eagle16"),
               "--output-dir", str(tmp_path / "deep"))
    assert deep["steps"] == 2
    saved = TreeSpecDrafterModel.from_pretrained(tmp_path / "deep")
    assert saved.config.num_hidden_layers == 2 and saved.dtype == torch.float32
    saved = TreeSpecDrafterModel.from_pretrained(tmp_path / "talf")
    assert saved.config.draft_vocab_size == 32 and saved.config.share_target_lm_head  # head not stored
    result = run("evaluate", "--data", str(tmp_path / "dev"), "--drafter", str(tmp_path / "talf"))
    assert result[str(tmp_path / "talf")]["roots"] > 0
