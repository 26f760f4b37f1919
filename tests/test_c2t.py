"""``tree_policy="c2t"``: classifier save / load and errors, the tree on hand-made distributions, greedy identity,
and the C2T trainer (data labelling, negative sampling, loss goes down)."""

from __future__ import annotations

import pytest
import torch

from hf_treespec.step_context import StepContext
from hf_treespec.policies.base import DraftSource
from datasets import Dataset

from hf_treespec.policies import POLICIES
from hf_treespec.policies.c2t import C2TClassifier, C2TClassifierConfig, node_features, top_entropy
from hf_treespec.tree import DraftTree

from conftest import assert_drafted


def path_of(tree: DraftTree, node: int) -> tuple[int, ...]:
    return tuple(tree.paths()[node, 1 : int(tree.depth[node]) + 1].tolist())


class JointProbClassifier(C2TClassifier):
    """A hand-set classifier: confidence = sigmoid(40 * (joint_prob - 0.1) - 5 * (depth - 1)) (entropy ignored), so
    the expected tree can be worked out by hand."""

    def __init__(self):
        super().__init__(C2TClassifierConfig(hidden_size=2))
        with torch.no_grad():
            self.net[0].weight.copy_(torch.tensor([[40.0, 0.0, -5.0], [0.0, 0.0, 0.0]]))
            self.net[0].bias.copy_(torch.tensor([-4.0 + 5.0 + 100.0, 0.0]))
            self.net[2].weight.copy_(torch.tensor([[1.0, 0.0]]))
            self.net[2].bias.copy_(torch.tensor([-100.0]))


TABLES = {(): [0.6, 0.25, 0.1, 0.05], (0,): [0.5, 0.3, 0.15, 0.05], (1,): [0.9, 0.1, 0.0, 0.0],
          (0, 0): [0.95, 0.05, 0.0, 0.0]}


class Source(DraftSource):
    def __init__(self):
        self.calls = []

    def logprobs(self, tree, nodes):
        self.calls.append(nodes.numel())
        return torch.stack([torch.tensor(TABLES.get(path_of(tree, int(v)), [0.25] * 4)) for v in nodes]).log()


def test_hand_made_tree():
    """Confidence > 0.5 <=> 40 p - 5 (d - 1) - 4 > 0 <=> p > 0.1 + (d - 1) / 8. Depth 1 keeps 0 (.6) and 1 (.25);
    depth 2 needs p > .225: (0,0) .3 and (1,0) .225 is not above it, (0,1) .18 no; depth 3 needs p > .35: none
    ((0,0,0) = .285)."""
    policy = POLICIES.get("c2t")(c2t_classifier=JointProbClassifier(), tree_topk=4, c2t_topk=0)
    source = Source()
    tree = policy.build(source, 7, context=StepContext(7))
    assert [path_of(tree, v) for v in range(1, tree.num_nodes)] == [(0,), (1,), (0, 0)]
    assert source.calls == [1, 2, 1]
    # the second top-k keeps the layer's most confident: with c2t_topk=1 only (0,) then (0, 0)
    capped = POLICIES.get("c2t")(c2t_classifier=JointProbClassifier(), tree_topk=4, c2t_topk=1)
    tree = capped.build(Source(), 7, context=StepContext(7))
    assert [path_of(tree, v) for v in range(1, tree.num_nodes)] == [(0,), (0, 0)]
    # a lower threshold keeps more, the first top-k bounds what is scored at all
    low = POLICIES.get("c2t")(c2t_classifier=JointProbClassifier(), tree_topk=1, c2t_topk=0, c2t_threshold=0.01)
    tree = low.build(Source(), 7, context=StepContext(7))
    assert all(int(r) == 0 for r in tree.num_children()[tree.num_children() > 0] - 1)


def test_features():
    logq = torch.tensor([[0.5, 0.5, 0.0, 0.0]]).log()
    assert torch.allclose(top_entropy(logq, 1000), torch.tensor([0.6931472]))
    assert torch.allclose(top_entropy(logq, 1), torch.tensor([0.3465736]))
    f = node_features(torch.tensor([0.0, -1.0]), torch.tensor([1.0, 2.0]), torch.tensor([1, 2]))
    assert torch.allclose(f, torch.tensor([[1.0, 1.0, 1.0], [0.3678794, 2.0, 2.0]]))


def test_save_load_round_trip(tmp_path):
    model = C2TClassifier()
    model.fit_standardisation(torch.rand(50, 3))
    model.save_pretrained(tmp_path / "c2t")
    loaded = C2TClassifier.from_pretrained(tmp_path / "c2t")
    x = torch.rand(7, 3)
    assert torch.allclose(model(x), loaded(x)) and loaded.config.standardised
    assert sum(p.numel() for p in model.parameters()) == 3 * 48 + 48 + 48 + 1


@pytest.mark.parametrize("bad", [0.0, 1.0, -0.2, 1.5])
def test_threshold_out_of_range(bad):
    with pytest.raises(ValueError, match="c2t_threshold must be in"):
        POLICIES.get("c2t")(c2t_classifier=C2TClassifier(), c2t_threshold=bad)


def test_missing_classifier(tmp_path):
    with pytest.raises(ValueError, match="needs a trained confidence classifier.*train c2t"):
        POLICIES.get("c2t")()
    with pytest.raises(ValueError, match="not a C2T classifier folder"):
        POLICIES.get("c2t")(c2t_classifier=str(tmp_path))


def test_missing_classifier_through_generate(target, drafters, prompt):
    with pytest.raises(ValueError, match="needs a trained confidence classifier"):
        target.generate(prompt, max_new_tokens=3, assistant_model=drafters["perturbed"], tree_policy="c2t")


def test_bundled_classifier_is_found(tmp_path, target, drafters, prompt):
    """A drafter folder with c2t/ inside serves tree_policy='c2t' without c2t_classifier."""
    from hf_treespec.drafters.base import as_drafter

    drafter = drafters["perturbed"]
    JointProbClassifier().save_pretrained(tmp_path / "c2t")
    old = drafter.name_or_path
    try:
        drafter.name_or_path = str(tmp_path)
        found = POLICIES.get("c2t").defaults_from_drafter(as_drafter(drafter))
        assert found == {"c2t_classifier": str(tmp_path / "c2t")}
        ref = target.generate(prompt, do_sample=False, max_new_tokens=8)
        out = target.generate(prompt, do_sample=False, max_new_tokens=8, assistant_model=drafter, tree_policy="c2t",
                              return_dict_in_generate=True)
        assert_drafted(out)
        assert torch.equal(out.sequences, ref)
    finally:
        drafter.name_or_path = old


@pytest.mark.parametrize("beta", [0.05, 0.5, 0.95])
def test_greedy_generate_is_plain_greedy(target, drafters, prompt, beta):
    ref = target.generate(prompt, do_sample=False, max_new_tokens=20)
    out = target.generate(prompt, do_sample=False, max_new_tokens=20, assistant_model=drafters["perturbed"],
                          tree_policy="c2t", c2t_classifier=JointProbClassifier(), c2t_threshold=beta,
                          return_dict_in_generate=True)
    assert_drafted(out)
    assert torch.equal(out.sequences, ref)


# ------------------------------------------------------------------------------------------------------ trainer
def test_label_tree_and_ranks():
    from hf_treespec.trainers.objectives.c2t import label_tree, sibling_rank

    tree = DraftTree.root(9).add_children(torch.tensor([0, 0, 0]), torch.tensor([4, 5, 6]), torch.zeros(3))
    tree = tree.add_children(torch.tensor([1, 1, 2]), torch.tensor([7, 8, 7]), torch.zeros(3))
    argmax = torch.tensor([5, 0, 7, 0, 0, 0, 0])  # root -> 5 (node 2), node 2 -> 7 (node 6)
    assert label_tree(tree, argmax).tolist() == [True, False, True, False, False, False, True]
    assert sibling_rank(tree).tolist() == [0, 0, 1, 2, 0, 1, 0]


def toy_nodes(n: int = 4000, seed: int = 0) -> Dataset:
    gen = torch.Generator().manual_seed(seed)
    joint = torch.rand(n, generator=gen)
    entropy = 3 * torch.rand(n, generator=gen)
    depth = torch.randint(1, 6, (n,), generator=gen).float()
    label = (torch.rand(n, generator=gen) < joint**2 * (1 - entropy / 4)).long()
    return Dataset.from_dict({"features": torch.stack([joint, entropy, depth], -1).tolist(), "label": label.tolist()})


def test_negative_sampling():
    from hf_treespec.trainers.objectives.c2t import negative_sample

    data = toy_nodes()
    positives = sum(data["label"])
    sampled = negative_sample(data, 2.0)
    assert sum(sampled["label"]) == positives and len(sampled) == positives + round(2 * positives)


def test_trainer_lowers_the_loss(tmp_path):
    from hf_treespec.trainers.objectives.c2t import C2TConfig, C2TTrainer

    data = toy_nodes()
    model = C2TClassifier()
    args = C2TConfig(output_dir=str(tmp_path), num_train_epochs=8, per_device_train_batch_size=256,
                     negative_ratio=0, use_cpu=True, save_strategy="no", disable_tqdm=True, logging_steps=1000)
    trainer = C2TTrainer(model, args, train_dataset=data, eval_dataset=data)
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    after = trainer.evaluate()["eval_loss"]
    assert after < before - 0.05, (before, after)
    trainer.save_model(str(tmp_path / "out"))
    loaded = C2TClassifier.from_pretrained(tmp_path / "out")
    x = torch.tensor(data["features"][:5])
    assert torch.allclose(loaded(x), model(x))


def test_trainer_refuses_data_without_positives(tmp_path):
    from hf_treespec.trainers.objectives.c2t import C2TConfig, C2TTrainer

    data = Dataset.from_dict({"features": [[0.1, 1.0, 1.0]] * 4, "label": [0] * 4})
    with pytest.raises(ValueError, match="no accepted node"):
        C2TTrainer(C2TClassifier(), C2TConfig(output_dir=str(tmp_path), use_cpu=True), train_dataset=data)


def test_c2t_data_rows_on_a_tiny_model(target, drafters, prompt):
    """Real trees on a tiny target: roots every 4 tokens of the greedy trajectory, full EAGLE-2 size, accepted
    nodes form one path from the root (label_tree's rule is checked by hand in test_label_tree_and_ranks)."""
    from hf_treespec.trainers.objectives.c2t import C2TDataConfig, prompt_rows, rank_acceptance

    config = C2TDataConfig(tree_topk=3, tree_depth=3, max_new_tokens=10, root_every=4)
    rows = prompt_rows(target, hf_treespec_drafter(drafters["perturbed"]), prompt, config)
    ref = target.generate(prompt, do_sample=False, max_new_tokens=10)[0]
    by_root: dict[int, list[dict]] = {}
    for row in rows:
        by_root.setdefault(row["position"], []).append(row)
    assert sorted(by_root) == list(range(prompt.shape[1], ref.numel() - 1, 4))
    for t, nodes in by_root.items():
        assert len(nodes) == config.full_tree_nodes
        accepted = [r for r in nodes if r["label"]]
        assert sorted(r["depth"] for r in accepted) == list(range(1, len(accepted) + 1))
        assert all(0 <= r["rank"] < 3 for r in nodes)
    assert len(rank_acceptance(Dataset.from_list(rows))) == 3


def hf_treespec_drafter(model):
    from hf_treespec.drafters.base import as_drafter

    return as_drafter(model)


def test_c2t_data_chunks_resume_and_a_truncated_chunk_is_named_and_redone(target, drafters, prompt, tmp_path):
    """c2t-data writes resumable chunks: a rerun computes nothing when every chunk is finished, a truncated chunk is
    refused with its name on read and redone (kept aside as *.corrupt) on the next run, other settings are refused."""
    from hf_treespec.trainers.objectives.c2t import C2TDataConfig, generate_c2t_data, load_c2t_data
    from hf_treespec.trainers.data.chunks import CorruptChunkError

    config = C2TDataConfig(tree_topk=2, tree_depth=2, max_new_tokens=6, root_every=3)
    drafter = hf_treespec_drafter(drafters["perturbed"])
    prompts = [prompt, prompt[:, :-1], prompt[:, 1:]]
    first = generate_c2t_data(target, drafter, prompts, config, tmp_path, chunk_size=2, progress=False)
    assert sorted(p.name for p in tmp_path.glob("chunk-*")) == ["chunk-00000.jsonl", "chunk-00001.jsonl"]
    assert sorted(set(first["prompt"])) == [0, 1, 2]
    stamps = {p.name: p.stat().st_mtime_ns for p in tmp_path.glob("chunk-*")}
    again = generate_c2t_data(target, drafter, prompts, config, tmp_path, chunk_size=2, progress=False)
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.glob("chunk-*")} == stamps and again[:] == first[:]
    bad = tmp_path / "chunk-00001.jsonl"
    bad.write_bytes(bad.read_bytes()[:-30])
    with pytest.raises(CorruptChunkError, match="chunk-00001.jsonl is truncated.*train c2t-data"):
        load_c2t_data(tmp_path)
    redone = generate_c2t_data(target, drafter, prompts, config, tmp_path, chunk_size=2, progress=False)
    assert redone[:] == first[:] and (tmp_path / "chunk-00001.jsonl.corrupt").is_file()
    with pytest.raises(ValueError, match="different settings"):
        generate_c2t_data(target, drafter, prompts, C2TDataConfig(tree_topk=3, tree_depth=2, max_new_tokens=6,
                                                                  root_every=3), tmp_path, chunk_size=2)


# ------------------------------------------------------------------------------------------------ ablation knobs
def test_feature_subset_reads_only_its_columns(tmp_path):
    """A classifier of a feature subset (the paper's Table 1) takes the full [.., 3] rows, reads only its columns
    (canonical order whatever order the config names them in) and round-trips through save / load."""
    model = C2TClassifier(C2TClassifierConfig(features=("depth", "joint_prob")))
    assert model.config.features == ("joint_prob", "depth") and model.net[0].in_features == 2
    model.fit_standardisation(torch.rand(50, 3) * torch.tensor([1.0, 5.0, 10.0]))
    x = torch.rand(6, 3)
    changed = x.clone()
    changed[:, 1] += 7.0  # the entropy column, which this classifier does not read
    assert torch.equal(model(x), model(changed))
    changed[:, 2] += 1.0
    assert not torch.allclose(model(x), model(changed))
    model.save_pretrained(tmp_path / "pd")
    loaded = C2TClassifier.from_pretrained(tmp_path / "pd")
    assert loaded.config.features == ("joint_prob", "depth") and torch.allclose(loaded(x), model(x))
    with pytest.raises(ValueError, match=r"\[\.\.\., 3\] rows"):
        model(torch.rand(4, 2))


@pytest.mark.parametrize("bad", [(), ("joint_prob", "joint_prob"), ("logit",)])
def test_bad_feature_subsets(bad):
    with pytest.raises(ValueError, match="non-empty subset"):
        C2TClassifierConfig(features=bad)


def test_default_classifier_reads_all_three_features():
    """Defaults unchanged: all three features, and a shipped-style config (features listed) loads as before."""
    assert C2TClassifierConfig().features == ("joint_prob", "parent_entropy", "depth")
    assert C2TClassifier().net[0].in_features == 3


class EntropyClassifier(C2TClassifier):
    """Confidence = sigmoid(20 * (entropy - 0.5)): keeps a candidate iff its parent's entropy is above 0.5 nats."""

    def __init__(self, entropy_top: int = 1000):
        super().__init__(C2TClassifierConfig(hidden_size=1, features=("parent_entropy",), entropy_top=entropy_top))
        with torch.no_grad():
            self.net[0].weight.fill_(1.0)
            self.net[0].bias.fill_(0.0)
            self.net[2].weight.fill_(20.0)
            self.net[2].bias.fill_(-10.0)


def test_entropy_top_override():
    """The root's distribution [.6, .25, .1, .05] has entropy 1.04 nats over all 4 tokens but 0.31 over its top 1:
    the classifier's own top-N (1000) grows the first layer, c2t_entropy_top=1 prunes everything, and the default
    (None) is the classifier's N."""
    grown = POLICIES.get("c2t")(c2t_classifier=EntropyClassifier(), tree_topk=2, c2t_topk=0, tree_depth=1)
    assert grown.build(Source(), 7, context=StepContext(7)).num_nodes == 3
    cut = POLICIES.get("c2t")(c2t_classifier=EntropyClassifier(), tree_topk=2, c2t_topk=0, tree_depth=1,
                              c2t_entropy_top=1)
    assert cut.build(Source(), 7, context=StepContext(7)).num_nodes == 1
    own = POLICIES.get("c2t")(c2t_classifier=EntropyClassifier(entropy_top=1), tree_topk=2, tree_depth=1)
    assert own.build(Source(), 7, context=StepContext(7)).num_nodes == 1
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="c2t_entropy_top must be an int"):
            POLICIES.get("c2t")(c2t_classifier=EntropyClassifier(), c2t_entropy_top=bad)


def test_chain_mode_is_an_early_exit():
    """tree_topk=1 (the paper's chain mode): a single path of draft argmaxes that stops at the first candidate the
    classifier rejects (JointProbClassifier: depth 1 keeps p=.6, depth 2 needs p > .225: (0, 0) has .3, depth 3
    needs > .35: (0, 0, 0) has .285)."""
    policy = POLICIES.get("c2t")(c2t_classifier=JointProbClassifier(), tree_topk=1, tree_depth=5)
    tree = policy.build(Source(), 7, context=StepContext(7))
    assert tree.is_chain() and [path_of(tree, v) for v in range(1, tree.num_nodes)] == [(0,), (0, 0)]


def test_train_c2t_cli_features(tmp_path):
    """`hf-treespec train c2t --features` trains a subset classifier and records the subset in its summary."""
    import json

    from hf_treespec.cli import main
    from hf_treespec.trainers.data.chunks import write_chunk

    data = tmp_path / "data"
    data.mkdir()
    rows = toy_nodes(600)
    records = [{"features": f, "label": int(label), "rank": 0, "depth": int(f[2]), "expanded": 0, "prompt": i // 30,
                "position": i % 30} for i, (f, label) in enumerate(zip(rows["features"], rows["label"]))]
    (data / "c2t_data_config.json").write_text("{}")
    write_chunk(data / "chunk-00000.jsonl", records, 0, 20)
    out = tmp_path / "clf"
    assert main(["train", "c2t", "--data", str(data), "--output-dir", str(out), "--features", "joint_prob,depth",
                 "--num-train-epochs", "1", "--use-cpu", "True"]) == 0
    assert C2TClassifier.from_pretrained(out).config.features == ("joint_prob", "depth")
    assert json.loads((out / "training_summary.json").read_text())["features"] == ["joint_prob", "depth"]
