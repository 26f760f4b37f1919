"""TreeSpecDrafterModel (config, AutoModel, sharing, vocab maps, forward), the FeatureDrafter adapter, model cards."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModel

from hf_treespec.attention import float_mask
from hf_treespec.drafters import (
    FeatureDrafter,
    TargetFeatures,
    TreeSpecDrafterConfig,
    TreeSpecDrafterModel,
    as_drafter,
    build_draft_vocab,
)
from hf_treespec.features import capture_hidden_states
from hf_treespec.model_card import make_card, template_path
from hf_treespec.tree import DraftTree

from conftest import VOCAB, assert_drafted, fixed_budget

POLICIES = ["chain", "eagle2", "optimal", "salf"]



# small trees keep the end-to-end tests fast; the policies' defaults are tested elsewhere
SMALL_TREES = {"chain": dict(tree_depth=4), "eagle2": dict(tree_depth=4, tree_topk=4), "optimal": {}, "salf": {}}
SMALL_BUDGET = 16  # nodes of the policies sized by tree_budget (pinned at each call: ``fixed_budget(policy, 16)``)


def make_drafter(target, seed: int = 0, **overrides) -> TreeSpecDrafterModel:
    torch.manual_seed(seed)
    config = TreeSpecDrafterConfig.for_target(target.config, **overrides)
    return TreeSpecDrafterModel(config).eval()


def permuted_vocab(size: int, seed: int = 3) -> torch.Tensor:
    """A reduced draft vocabulary that is not simply the first ``size`` ids."""
    counts = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed)).float()
    return build_draft_vocab(counts, size)[0]


# ---------------------------------------------------------------------------------------- model / config basics
def test_auto_classes_and_save_load(target, tmp_path):
    drafter = make_drafter(target, target_layers=[0, 2, -1], input_mode="eagle3", draft_vocab_size=40)
    drafter.set_draft_vocab(permuted_vocab(40))
    drafter.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "treespec_drafter"
    assert isinstance(AutoConfig.from_pretrained(tmp_path), TreeSpecDrafterConfig)
    loaded = AutoModel.from_pretrained(tmp_path).eval()
    assert type(loaded) is TreeSpecDrafterModel
    assert loaded.config.target_layers == [0, 2, -1] and loaded.config.draft_vocab_size == 40
    assert torch.equal(loaded.d2t, drafter.d2t) and torch.equal(loaded.t2d, drafter.t2d)
    ids, feats = torch.randint(0, VOCAB, (2, 6)), torch.randn(2, 6, 96)
    assert torch.allclose(loaded(ids, feats).logits, drafter(ids, feats).logits, atol=1e-6)


def test_config_rejects_inconsistent_fields(target):
    with pytest.raises(ValueError, match="input_mode"):
        TreeSpecDrafterConfig.for_target(target.config, input_mode="medusa")
    with pytest.raises(ValueError, match="feature_projection"):
        TreeSpecDrafterConfig.for_target(target.config, target_layers=[0, 1], feature_projection=False)
    with pytest.raises(ValueError, match="draft_vocab_size"):
        TreeSpecDrafterConfig.for_target(target.config, draft_vocab_size=VOCAB + 1)
    with pytest.raises(ValueError, match="distinct"):
        TreeSpecDrafterConfig.for_target(target.config, target_layers=[1, 1])


def test_forward_checks_inputs(target):
    drafter = make_drafter(target, target_layers=[0, 1])
    ids = torch.randint(0, VOCAB, (1, 4))
    with pytest.raises(ValueError, match="exactly one"):
        drafter(ids)
    with pytest.raises(ValueError, match="width"):
        drafter(ids, torch.randn(1, 4, 32))


def test_build_draft_vocab_keeps_most_frequent_with_ties_to_lower_ids():
    counts = torch.tensor([5, 0, 9, 5, 1, 5, 7, 0])
    d2t, t2d = build_draft_vocab(counts, 4)
    assert d2t.tolist() == [0, 2, 3, 6]  # 9, 7, then the two lowest ids among the 5s
    assert t2d.tolist() == [True, False, True, True, False, False, True, False]
    with pytest.raises(ValueError):
        build_draft_vocab(counts, 9)


def test_target_logits_and_labels_use_the_draft_vocab(target):
    drafter = make_drafter(target, draft_vocab_size=24)
    d2t = permuted_vocab(24)
    drafter.set_draft_vocab(d2t)
    ids, feats = torch.randint(0, VOCAB, (2, 7)), torch.randn(2, 7, 32)
    labels = torch.randint(0, VOCAB, (2, 7))
    labels[0, 3] = -100
    out = drafter(ids, feats, labels=labels)
    full = drafter.target_logits(out.logits)
    assert full.shape == (2, 7, VOCAB)
    assert torch.equal(full[..., d2t], out.logits)
    assert torch.isinf(full[..., ~drafter.t2d]).all()
    # labels shift like a causal LM; ids outside the draft vocabulary and -100 are ignored
    lookup = {int(t): i for i, t in enumerate(d2t)}
    rows, cols = [], []
    for b in range(2):
        for t in range(6):
            label = int(labels[b, t + 1])
            if label in lookup:
                rows.append(out.logits[b, t])
                cols.append(lookup[label])
    manual = F.cross_entropy(torch.stack(rows), torch.tensor(cols))
    assert torch.allclose(out.loss, manual, atol=1e-6)
    with pytest.raises(ValueError, match="repeat"):
        drafter.set_draft_vocab(torch.zeros(24, dtype=torch.long))


def test_draft_support_is_the_sorted_draft_vocabulary(target):
    """What sampled draws and the SWOR walk pass over (`Drafter.draft_support`): the draft vocabulary's ids sorted,
    following a new d2t; None for a full vocabulary."""
    drafter = make_drafter(target, draft_vocab_size=24)
    drafter.set_draft_vocab(permuted_vocab(24))
    adapter = FeatureDrafter(drafter)
    assert torch.equal(adapter.draft_support, permuted_vocab(24).sort().values)
    drafter.set_draft_vocab(torch.arange(24))
    assert torch.equal(adapter.draft_support, torch.arange(24))
    logits = drafter.target_logits(torch.randn(3, 24))
    assert bool(torch.isinf(logits).all(0)[~torch.isin(torch.arange(VOCAB), adapter.draft_support)].all())
    assert FeatureDrafter(make_drafter(target)).draft_support is None


def test_sampling_warpers_run_over_the_draft_vocabulary_alone(target):
    """`WarpedDraftSource` keeps a reduced vocabulary's columns as its support under sampling's column-local warpers
    (temperature, top-k, top-p, min-p filling with -inf): log q over those columns equals the vocabulary-wide warp and
    log-softmax, -inf elsewhere. A processor that may write outside them (a finite filter value, keeping two
    tokens, removing infinities) keeps the vocabulary-wide route."""
    from transformers import (InfNanRemoveLogitsProcessor, LogitsProcessorList, MinPLogitsWarper,
                              TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

    from hf_treespec.generation.draft_source import WarpedDraftSource

    drafter = make_drafter(target, draft_vocab_size=24)
    drafter.set_draft_vocab(permuted_vocab(24))
    adapter = FeatureDrafter(drafter)
    logits = drafter.target_logits(torch.randn(3, 24, generator=torch.Generator().manual_seed(1)) * 3)
    tree, nodes, prefix = DraftTree.root(5), torch.zeros(3, dtype=torch.long), torch.tensor([[5]])
    for warpers in ([], [TemperatureLogitsWarper(0.7)], [TemperatureLogitsWarper(1.3), TopKLogitsWarper(5)],
                    [TopPLogitsWarper(0.8)], [MinPLogitsWarper(0.1), TopKLogitsWarper(30)]):
        processors = LogitsProcessorList(warpers)
        source = WarpedDraftSource(adapter, processors, prefix)
        assert torch.equal(source.support, adapter.draft_support)
        logq = source.warp(tree, nodes, logits)
        wide = torch.log_softmax(processors(prefix.expand(3, -1), logits.clone()), dim=-1)
        assert torch.isinf(logq[:, ~torch.isin(torch.arange(VOCAB), adapter.draft_support)]).all()
        assert torch.equal(torch.isinf(logq), torch.isinf(wide))
        assert torch.allclose(logq.exp(), wide.exp(), atol=1e-6)
    for warper in (TopKLogitsWarper(5, filter_value=-50.0), TopPLogitsWarper(0.8, min_tokens_to_keep=2),
                   InfNanRemoveLogitsProcessor()):
        assert WarpedDraftSource(adapter, LogitsProcessorList([warper]), prefix).support is None


@pytest.mark.parametrize("input_mode", ["fc", "eagle3"])
def test_forward_with_tree_mask_equals_each_path_alone(target, input_mode):
    """Training with tree attention (TALF): one forward over a tree = independent causal forwards over its paths."""
    drafter = make_drafter(target, target_layers=[1, 3], input_mode=input_mode, num_hidden_layers=2)
    tree = DraftTree(tokens=torch.tensor([5, 9, 11, 7, 3, 8]), parents=torch.tensor([-1, 0, 0, 1, 1, 2]),
                     depth=torch.tensor([0, 1, 1, 2, 2, 2]), scores=torch.zeros(6))
    prefix = torch.randint(0, VOCAB, (4,))
    feats = torch.randn(4 + 6, 64)
    visible = torch.ones(10, 10, dtype=torch.bool).tril()
    visible[4:, 4:] = tree.ancestor_mask()
    ids = torch.cat([prefix, tree.tokens])[None]
    positions = torch.cat([torch.arange(4), 4 + tree.depth])[None]
    out = drafter(ids, feats[None], attention_mask=float_mask(visible, torch.float32), position_ids=positions)
    for node in range(6):
        path = tree.path_to(node)
        alone = drafter(torch.cat([prefix, tree.tokens[path]])[None], torch.cat([feats[:4], feats[4 + path]])[None])
        assert torch.allclose(out.logits[0, 4 + node], alone.logits[0, -1], atol=1e-5)
        assert torch.allclose(out.hidden_states[0, 4 + node], alone.hidden_states[0, -1], atol=1e-5)


@pytest.mark.parametrize("input_mode", ["fc", "eagle3"])
def test_cache_continues_a_forward_under_both_keyword_names(target, input_mode):
    """The drafter's cache (``out.cache``) continues a forward exactly, passed as ``cache=`` or as
    ``past_key_values=`` (the keyword before transformers 5.24, which EAGLE-style callers still use)."""
    drafter = make_drafter(target, target_layers=[1, 3], input_mode=input_mode)
    ids, feats = torch.randint(0, VOCAB, (1, 7)), torch.randn(1, 7, 64)
    whole = drafter(ids, feats)
    for name in ("cache", "past_key_values"):
        head = drafter(ids[:, :4], feats[:, :4], use_cache=True)
        assert head.cache is not None and head.cache.get_seq_length() == 4
        tail = drafter(ids[:, 4:], feats[:, 4:], use_cache=True, **{name: head.cache})
        assert tail.cache is head.cache and head.cache.get_seq_length() == 7
        torch.testing.assert_close(tail.logits, whole.logits[:, 4:], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="cache once"):
        drafter(ids, feats, use_cache=True, cache=head.cache, past_key_values=head.cache)


@pytest.mark.parametrize("overrides", [dict(input_mode="fc"), dict(input_mode="eagle3"),
                                       dict(input_mode="eagle3", attention_bias=True, mlp_bias=True)],
                         ids=["fc", "eagle3", "eagle3-biases"])
def test_add_layers_keeps_the_drafts_then_trains_the_new_layer(target, tmp_path, overrides):
    """A deepened drafter computes what it did (logits and the hidden states it drafts deeper levels from), saves and
    loads at its new depth, drafts through a cache of that depth, and the new layer is trainable (not a dead branch)."""
    drafter = make_drafter(target, target_layers=[1, 3], **overrides)
    ids, feats = torch.randint(0, VOCAB, (2, 7)), torch.randn(2, 7, 64)
    before = drafter(ids, feats)
    drafter.add_layers(3)
    assert drafter.config.num_hidden_layers == 3 and len(drafter.layers) == 3
    after = drafter(ids, feats)
    torch.testing.assert_close(after.logits, before.logits)
    torch.testing.assert_close(after.hidden_states, before.hidden_states)
    head = drafter(ids[:, :4], feats[:, :4], use_cache=True)
    assert len(head.cache.layers) == 3
    tail = drafter(ids[:, 4:], feats[:, 4:], use_cache=True, cache=head.cache)
    torch.testing.assert_close(tail.logits, before.logits[:, 4:], atol=1e-5, rtol=1e-5)
    drafter.save_pretrained(tmp_path / "deep")
    loaded = TreeSpecDrafterModel.from_pretrained(tmp_path / "deep").eval()
    torch.testing.assert_close(loaded(ids, feats).logits, before.logits)
    drafter.train()
    optimizer = torch.optim.SGD(drafter.parameters(), lr=1.0)
    for _ in range(2):  # step 1 moves the zeroed output projections, step 2 the rest of the new layer through them
        optimizer.zero_grad()
        F.cross_entropy(drafter(ids, feats).logits.flatten(0, 1), ids.flatten()).backward()
        optimizer.step()
    assert drafter.layers[2].self_attn.o_proj.weight.abs().sum() > 0
    assert drafter.layers[2].self_attn.q_proj.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="cannot remove layers"):
        drafter.add_layers(1)


# ----------------------------------------------------------------------------------------- sharing the target
def test_shared_embeddings_and_head_are_not_saved(target, tmp_path):
    drafter = make_drafter(target, draft_vocab_size=40)
    drafter.set_draft_vocab(permuted_vocab(40))
    drafter.tie_to_target(target, embeddings=True, lm_head=True)
    ids, feats = torch.randint(0, VOCAB, (1, 5)), torch.randn(1, 5, 32)
    out = drafter(ids, feats)
    head_rows = target.lm_head.weight[drafter.d2t]
    assert torch.allclose(out.logits, drafter.norm(out.hidden_states) @ head_rows.T, atol=1e-5)

    drafter.save_pretrained(tmp_path)
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert not any(k.startswith(("embed_tokens", "lm_head")) for k in saved)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["share_target_embeddings"] and config["share_target_lm_head"]

    loaded = AutoModel.from_pretrained(tmp_path).eval()
    assert not loaded.is_attached
    with pytest.raises(ValueError, match="tie_to_target"):
        loaded(ids, feats)
    with pytest.raises(ValueError, match="tie_to_target"):
        as_drafter(loaded)
    loaded.tie_to_target(target)
    assert torch.allclose(loaded(ids, feats).logits, out.logits, atol=1e-6)
    with pytest.raises(ValueError, match="must share"):
        loaded.tie_to_target(target, embeddings=False)


def test_tie_to_target_checks_shapes(target):
    from conftest import tiny_llama

    other = tiny_llama(seed=1)
    other.lm_head = torch.nn.Linear(32, VOCAB - 1, bias=False)
    drafter = make_drafter(target)
    with pytest.raises(ValueError, match="shape"):
        drafter.tie_to_target(other, lm_head=True)


# -------------------------------------------------------------------------------------------- the adapter
def test_as_drafter_picks_the_feature_adapter(target):
    drafter = make_drafter(target, target_layers=[1, 2])
    adapter = as_drafter(drafter)
    assert isinstance(adapter, FeatureDrafter)
    assert adapter.target_layers == (1, 2) and adapter.vocab_size == VOCAB
    with pytest.raises(ValueError, match="hidden states"):
        adapter.start(torch.arange(5))
    with pytest.raises(ValueError, match="shape"):
        adapter.start(torch.arange(5), TargetFeatures(torch.randn(5, 32)))


class StreamReference:
    """The drafter stream recomputed from scratch (no cache, plain causal forwards) after every committed step.

    Position t pairs token x_t with the target feature of t - 1 for committed tokens; a tree node pairs its token with
    the drafter's output feature at its parent; the root pairs with the target feature of the last committed token.
    """

    def __init__(self, model: TreeSpecDrafterModel, prompt: torch.Tensor, raw: torch.Tensor):
        self.model = model
        self.tokens = prompt[1:].tolist()
        self.raw = raw[:-1]
        self.root_raw = raw[-1]

    @torch.no_grad()
    def node_logits(self, tree: DraftTree, node: int) -> torch.Tensor:
        path = tree.tokens[tree.path_to(node)].tolist()
        feats = self.model.project_features(torch.cat([self.raw, self.root_raw[None]]))
        tokens = self.tokens + path[:1]
        for depth in range(len(path)):
            out = self.model(input_ids=torch.tensor(tokens)[None], features=feats[None])
            if depth + 1 < len(path):
                tokens.append(path[depth + 1])
                feats = torch.cat([feats, out.hidden_states[0, -1:]])
        return self.model.target_logits(out.logits[0, -1].float())

    def commit(self, tree: DraftTree, accepted: torch.Tensor, raw: torch.Tensor) -> None:
        self.tokens += tree.tokens[accepted].tolist()
        self.raw = torch.cat([self.raw, self.root_raw[None], raw[:-1]])
        self.root_raw = raw[-1]


def assert_same_logits(got: torch.Tensor, want: torch.Tensor) -> None:
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = torch.isfinite(want)
    assert torch.allclose(got[finite], want[finite], atol=1e-5)


def grow(tree: DraftTree, parents: list[int], logits: dict[int, torch.Tensor], per_parent: int) -> DraftTree:
    """Adds the ``per_parent`` best children (by the drafter's logits) of each parent."""
    parent_ids, tokens = [], []
    for p in parents:
        top = logits[p].topk(per_parent).indices
        parent_ids += [p] * per_parent
        tokens += top.tolist()
    return tree.add_children(torch.tensor(parent_ids), torch.tensor(tokens), torch.zeros(len(tokens)))


@pytest.mark.parametrize(
    "overrides",
    [
        dict(target_layers=[-1]),
        dict(target_layers=[0, 2, 3], input_mode="eagle3", draft_vocab_size=40),
        dict(target_layers=[1, -1], num_hidden_layers=2, draft_vocab_size=48),
    ],
    ids=["fc", "eagle3-reduced-vocab", "fc-2-layers"],
)
def test_expand_with_cache_equals_from_scratch_paths(target, overrides):
    """expand() through the KV cache, tree masks, pruning, pending re-feeds and commits gives exactly the logits of a
    cache-free forward over each node's full path with the same features."""
    drafter = make_drafter(target, seed=4, **overrides)
    if drafter.config.draft_vocab_size < VOCAB:
        drafter.set_draft_vocab(permuted_vocab(drafter.config.draft_vocab_size))
    width = drafter.config.feature_size
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, VOCAB, (7,), generator=gen)
    raw = torch.randn(7, width, generator=gen)
    adapter = as_drafter(drafter)
    adapter.start(prompt, TargetFeatures(raw))
    ref = StreamReference(drafter, prompt, raw)

    def expand_and_check(tree: DraftTree, nodes: list[int]) -> dict[int, torch.Tensor]:
        got = adapter.expand(tree, torch.tensor(nodes))
        assert got.shape == (len(nodes), VOCAB) and got.dtype == torch.float32
        for row, node in enumerate(nodes):
            assert_same_logits(got[row], ref.node_logits(tree, node))
        return dict(zip(nodes, got))

    def commit(tree: DraftTree, accepted: list[int]) -> None:
        accepted = torch.tensor(accepted)
        features = torch.randn(len(accepted), width, generator=gen)
        adapter.commit(tree, accepted, TargetFeatures(features))
        ref.commit(tree, accepted, features)

    # step 1: a 3-level tree expanded in three calls, pruned, expanded again; accept a path ending in a leaf
    tree = DraftTree.root(int(prompt[-1]) ^ 1)
    logits = expand_and_check(tree, [0])
    tree = grow(tree, [0], logits, 3)  # nodes 1, 2, 3
    logits = expand_and_check(tree, [1, 2, 3])
    tree = grow(tree, [1, 3], logits, 2)  # 4, 5 under 1; 6, 7 under 3
    logits = expand_and_check(tree, [4, 6])
    tree = tree.select(torch.tensor([0, 1, 3, 4, 5, 6]))  # prune node 2 and leaf 7: indices shift
    logits = {0: None, 3: logits[4]}  # old node 4 is now node 3
    tree = grow(tree, [3], logits, 1)  # node 6, under the re-indexed node 3
    expand_and_check(tree, [6])
    commit(tree, [0, 1, 4])  # root -> old node 1 -> unexpanded leaf

    # step 2: nothing accepted but the root
    tree = DraftTree.root(3)
    logits = expand_and_check(tree, [0])
    tree = grow(tree, [0], logits, 2)
    expand_and_check(tree, [1, 2])
    commit(tree, [0])

    # step 3: a chain, fully accepted; step 4 drafts on top of it
    tree = DraftTree.root(11)
    logits = expand_and_check(tree, [0])
    tree = grow(tree, [0], logits, 1)
    logits = expand_and_check(tree, [1])
    tree = grow(tree, [1], logits, 1)
    commit(tree, [0, 1, 2])

    # steps 4-6: draft-free (tree_budget="auto" skipped the drafter): root-only trees committed, never expanded
    for token in (5, 9, 2):
        commit(DraftTree.root(token), [0])

    # step 7 drafts on top of the committed chain and the three unfed roots
    tree = DraftTree.root(17)
    logits = expand_and_check(tree, [0])
    tree = grow(tree, [0], logits, 4)
    expand_and_check(tree, [1, 2, 3, 4])


def test_expand_refuses_nodes_whose_parent_was_not_expanded(target):
    adapter = as_drafter(make_drafter(target))
    adapter.start(torch.arange(4), TargetFeatures(torch.randn(4, 32)))
    tree = DraftTree.root(1).add_children(torch.tensor([0]), torch.tensor([2]), torch.zeros(1))
    with pytest.raises(RuntimeError, match="parent"):
        adapter.expand(tree, torch.tensor([1]))


# ------------------------------------------------------------------------------------- generate, end to end
@pytest.fixture(scope="module")
def trained_drafter(target) -> TreeSpecDrafterModel:
    """A drafter fitted in a second to the tiny target's greedy continuations (EAGLE alignment: token t with the
    target state at t - 1). Its drafts get accepted, so generate exercises multi-token commits and pending re-feeds
    (a random drafter's tau stays near 1); the exact feature pairing is checked by the from-scratch test above."""
    prompts = torch.randint(0, VOCAB, (16, 6), generator=torch.Generator().manual_seed(0))
    seqs = target.generate(prompts, do_sample=False, max_new_tokens=26)
    with torch.no_grad(), capture_hidden_states(target, [1, -1]) as captured:
        target(seqs)
    states = captured.hidden_states
    drafter = make_drafter(target, seed=0, target_layers=[1, -1], draft_vocab_size=48)
    counts = torch.bincount(seqs.flatten(), minlength=VOCAB)
    drafter.set_draft_vocab(build_draft_vocab(counts, 48)[0])
    drafter.train()
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    for _ in range(100):
        loss = drafter(seqs[:, 1:], states[:, :-1], labels=seqs[:, 1:]).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return drafter.eval()


@pytest.mark.parametrize("policy", POLICIES)
def test_greedy_identity_random_drafter(target, prompt, policy):
    drafter = make_drafter(target, seed=2, target_layers=[0, 2, 3], draft_vocab_size=40)
    drafter.set_draft_vocab(permuted_vocab(40))
    ref = target.generate(prompt, do_sample=False, max_new_tokens=20)
    out = target.generate(prompt, do_sample=False, max_new_tokens=20, assistant_model=drafter, tree_policy=policy,
                          return_dict_in_generate=True, **fixed_budget(policy, SMALL_BUDGET), **SMALL_TREES[policy])
    assert_drafted(out, accepting=False)  # a random drafter
    assert torch.equal(out.sequences, ref)


@pytest.mark.parametrize("policy", POLICIES)
def test_greedy_identity_and_acceptance_trained_drafter(target, trained_drafter, policy):
    prompt = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(99))
    ref = target.generate(prompt, do_sample=False, max_new_tokens=24)
    out = target.generate(prompt, do_sample=False, max_new_tokens=24, assistant_model=trained_drafter,
                          tree_policy=policy, return_dict_in_generate=True, **fixed_budget(policy, SMALL_BUDGET),
                          **SMALL_TREES[policy])
    assert_drafted(out)
    assert torch.equal(out.sequences, ref)
    tau = sum(out.accepted_lengths) / len(out.accepted_lengths)
    assert tau > 1.5, f"trained drafter accepted too little (tau={tau:.2f})"


def test_eagle3_mode_drafter_in_generate(target, prompt):
    drafter = make_drafter(target, seed=5, target_layers=[0, 1, 2], input_mode="eagle3").tie_to_target(
        target, embeddings=True)
    ref = target.generate(prompt, do_sample=False, max_new_tokens=16)
    out = target.generate(prompt, do_sample=False, max_new_tokens=16, assistant_model=drafter, tree_policy="eagle2",
                          tree_budget=SMALL_BUDGET, return_dict_in_generate=True, **SMALL_TREES["eagle2"])
    assert_drafted(out, accepting=False)  # a random drafter
    assert torch.equal(out.sequences, ref)


# ---------------------------------------------------------------------------------------------- model card
def test_model_card_renders_fields(target):
    config = TreeSpecDrafterConfig.for_target(target.config, target_layers=[0, 2, 3], input_mode="eagle3",
                                              draft_vocab_size=40, share_target_embeddings=True)
    card = make_card(
        config, base_model="HuggingFaceTB/SmolLM2-135M-Instruct", data="anon8231489123/ShareGPT_Vicuna_unfiltered",
        objective="TALF, tree depth 3, k = 4", draft_vocab_size=40,
        results={"MT-bench T=0": {"tau": 3.21, "speedup": 1.87}, "MT-bench T=1": {"tau": 2.64, "speedup": 1.52}},
        command="hf-treespec bench --drafter me/drafter --tree-policy salf", repo_id="me/drafter",
    )
    assert card.data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert card.data.library_name == "transformers" and card.data.license == "apache-2.0"
    assert "speculative-decoding" in card.data.tags
    assert card.data.datasets == ["anon8231489123/ShareGPT_Vicuna_unfiltered"]
    text = card.text
    assert 'AutoModel.from_pretrained("me/drafter")' in text
    assert 'tree_policy="salf"' in text and "drafter.tie_to_target(model)" in text
    assert "| MT-bench T=0 | 3.21 | 1.87 |" in text
    assert "hf-treespec bench --drafter me/drafter --tree-policy salf" in text
    assert "TALF, tree depth 3, k = 4" in text and "40 of the target's 64 tokens" in text
    assert "{{" not in card.content
    with pytest.raises(ValueError, match="draft_vocab_size"):
        make_card(config, base_model="x", data="d", objective="o", draft_vocab_size=64, results={"tau": 2.0},
                  command="c")
    with pytest.raises(ValueError, match="results"):
        make_card(config, base_model="x", data="d", objective="o", draft_vocab_size=40, results={}, command="c")


def test_packaged_card_template_matches_repository_copy():
    from pathlib import Path

    repo_copy = Path(__file__).resolve().parent.parent / "model_cards" / "drafter_card.md"
    assert template_path().read_text() == repo_copy.read_text()


def test_support_columns_searches_within_a_superset():
    """`support_columns`: the sorted positive columns of some row, searched among ``within`` when given; ``within``
    itself (or None) when every searched column is positive."""
    from hf_treespec.randomness import support_columns

    probs = torch.zeros(2, 10)
    probs[0, [1, 4]] = 0.5
    probs[1, [4, 8]] = 0.5
    assert torch.equal(support_columns(probs), torch.tensor([1, 4, 8]))
    within = torch.tensor([1, 2, 4, 8])
    assert torch.equal(support_columns(probs, within), torch.tensor([1, 4, 8]))
    dense = torch.full((1, 10), 0.1)
    assert support_columns(dense) is None and support_columns(dense, within) is within
