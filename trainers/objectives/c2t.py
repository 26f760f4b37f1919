"""C2T classifier: training data from full EAGLE-2 trees labelled by the target, and `C2TTrainer` (the C2T paper,
Appendix B).

Data. For every prompt the target's greedy trajectory is generated; a root is taken every ``root_every`` tokens.
At each root the drafter (restarted on the root's context) grows the *full* EAGLE-2 tree (``tree_topk`` children
per beam node, ``tree_depth`` levels, no final rerank) and the target scores every tree node in one tree forward.
A node's label is 1 iff greedy verification accepts it: each token on its path is the target's argmax after the
path before it. Features per node are :func:`hf_treespec.policies.c2t.node_features` (joint draft probability,
entropy of the parent's draft distribution over its top 1000 tokens, depth), exactly what the ``c2t`` policy feeds
the classifier; the node's rank among its siblings is kept too (``hf-treespec train static-shape`` turns it into
Sequoia's per-rank acceptance).

Training. Positives are rare (a few accepted nodes per tree of hundreds), so every positive is kept and negatives
are subsampled to ``negative_ratio`` per positive (negative sampling); the loss is binary cross-entropy.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
from transformers import DynamicCache, GenerationConfig, Trainer, TrainingArguments

from hf_treespec.api import (
    option, keep_rows, CACHE_KWARG, TargetFeatures, as_drafter, capture_hidden_states, process_tree_logits,
    POLICIES, C2TClassifier, node_features, top_entropy, StepContext, DraftSource, DraftTree,
)

from ..data.chunks import ChunkFolder, batched, write_chunk
from .small_model import SmallModelTrainerMixin
from .trainer import pin_memory_field
from ..data.nde_data import TargetOracle

COLUMNS = ("features", "label", "rank", "depth", "expanded", "prompt", "position")


@dataclass
class C2TDataConfig:
    """Settings of ``c2t-data``: the EAGLE-2 tree (the paper's: top-k 10, depth 11, no rerank) and where roots are
    taken."""

    tree_topk: int = field(default=10, metadata=option("children per expanded node (the paper's 10)"))
    tree_depth: int = field(default=11, metadata=option("the C2T paper's training trees are 11 deep"))
    max_new_tokens: int = field(default=64, metadata=option("greedy trajectory length per prompt"))
    root_every: int = field(default=16, metadata=option("a tree root every N generated tokens"))
    entropy_top: int = field(default=1000, metadata=option("the parent entropy feature is over this many top tokens"))

    def __post_init__(self) -> None:
        if min(self.tree_topk, self.tree_depth, self.max_new_tokens, self.root_every, self.entropy_top) < 1:
            raise ValueError("tree_topk, tree_depth, max_new_tokens, root_every and entropy_top must be >= 1.")

    @property
    def full_tree_nodes(self) -> int:
        return self.tree_topk + (self.tree_depth - 1) * self.tree_topk**2


class _RecordingSource(DraftSource):
    """A draft source that also remembers the top-1000 entropy of every node it expanded."""

    def __init__(self, drafter, processors, prefix_ids: torch.Tensor, entropy_top: int):
        self.drafter, self.processors, self.prefix_ids, self.entropy_top = drafter, processors, prefix_ids, entropy_top
        self.entropy: dict[int, float] = {}  # node uid -> entropy

    def logprobs(self, tree: DraftTree, nodes: torch.Tensor) -> torch.Tensor:
        logits = process_tree_logits(self.processors, self.prefix_ids, tree, nodes, self.drafter.expand(tree, nodes))
        logq = torch.log_softmax(logits, -1)
        for uid, h in zip(tree.uids[nodes].tolist(), top_entropy(logq, self.entropy_top).tolist()):
            self.entropy[uid] = h
        return logq


def label_tree(tree: DraftTree, target_argmax: torch.Tensor) -> torch.Tensor:
    """``[n]`` bool: node accepted by greedy verification (root True). Parents precede children, so one pass over
    depths suffices (a vectorised step per depth, not per node)."""
    accepted = torch.zeros(tree.num_nodes, dtype=torch.bool, device=tree.device)
    accepted[0] = True
    parents = tree.parents.clamp(min=0)
    match = target_argmax[parents] == tree.tokens
    for _ in range(tree.max_depth):
        accepted = accepted | (accepted[parents] & match & (tree.parents >= 0))
    return accepted


def sibling_rank(tree: DraftTree) -> torch.Tensor:
    """``[n]`` position of each node among its parent's children (draft-rank order; root 0)."""
    n = tree.num_nodes
    same = (tree.parents[:, None] == tree.parents[None, :]) & (torch.arange(n)[None, :] < torch.arange(n)[:, None])
    return same.sum(-1)


@torch.no_grad()
def prompt_rows(model, drafter, prompt_ids: torch.Tensor, config: C2TDataConfig, prompt_index: int = 0
                ) -> list[dict[str, Any]]:
    """Labelled nodes of every root of one prompt's greedy trajectory."""
    device = model.device
    prompt_ids = prompt_ids.to(device)
    gen = GenerationConfig(do_sample=False, max_new_tokens=config.max_new_tokens, num_beams=1)
    sequence = model.generate(prompt_ids, generation_config=gen)[0]
    prompt_length = prompt_ids.shape[1]
    roots = list(range(prompt_length, sequence.numel() - 1, config.root_every))
    if not roots:
        return []
    processors = model._get_logits_processor(gen, input_ids_seq_length=prompt_length, device=device)
    layers = tuple(drafter.target_layers or ())
    cache = DynamicCache(config=model.config)
    end = roots[-1]
    with capture_hidden_states(model, layers) if layers else _null() as states:
        model.get_decoder()(input_ids=sequence[None, :end], position_ids=torch.arange(end, device=device)[None],
                            use_cache=True, **{CACHE_KWARG: cache})
    drafter_states = states.joined(len(layers))[0] if layers else None
    policy = POLICIES.get("eagle2")(tree_topk=config.tree_topk, tree_depth=config.tree_depth,
                                    tree_budget=config.full_tree_nodes)
    rows = []
    for t in reversed(roots):
        keep_rows(cache, t, torch.zeros(0, dtype=torch.long))
        prefix = sequence[None, : t + 1]
        drafter.start(sequence[:t], TargetFeatures(drafter_states[:t]) if layers else None)
        source = _RecordingSource(drafter, processors, prefix, config.entropy_top)
        tree = policy.build(source, int(sequence[t]), context=StepContext(int(sequence[t]), device=device))
        target = TargetOracle(model, processors, cache, t, prefix)
        argmax = target(tree, torch.arange(tree.num_nodes, device=device)).argmax(-1)
        labels = label_tree(tree, argmax)
        parent_uid = tree.uids[tree.parents.clamp(min=0)]
        entropy = torch.tensor([source.entropy[u] for u in parent_uid.tolist()])
        feats = node_features(tree.scores, entropy, tree.depth)
        ranks, expanded = sibling_rank(tree), tree.num_children() > 0
        for v in range(1, tree.num_nodes):
            rows.append({"features": feats[v].tolist(), "label": int(labels[v]), "rank": int(ranks[v]),
                         "depth": int(tree.depth[v]), "expanded": int(expanded[v]), "prompt": prompt_index,
                         "position": t})
    return rows


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


DATA_CONFIG_FILE = "c2t_data_config.json"
DATA_COMMAND = "train c2t-data"


def _data_folder(path) -> ChunkFolder:
    return ChunkFolder(Path(path), DATA_COMMAND, DATA_CONFIG_FILE)


def generate_c2t_data(model, drafter_model, prompts: Sequence[torch.Tensor], config: C2TDataConfig,
                      output_dir: str | os.PathLike, *, chunk_size: int = 10,
                      settings: dict[str, Any] | None = None, progress: bool = True):
    """Labelled tree nodes (columns :data:`COLUMNS`) of ``prompts`` (``[1, L]`` ids), written to ``output_dir`` in
    resumable chunks of ``chunk_size`` prompts (a rerun skips finished chunks and redoes corrupt ones; ``settings``
    are saved beside ``config`` and must match on a rerun). Returns the whole folder as a ``datasets.Dataset``."""
    from tqdm.auto import tqdm

    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}.")
    folder = _data_folder(output_dir)
    folder.check_or_write_config({**asdict(config), "chunk_size": chunk_size, **(settings or {})})
    drafter = as_drafter(drafter_model)
    bar = tqdm(total=len(prompts), desc="c2t-data", unit="prompt", disable=not progress)
    try:
        for index, chunk in enumerate(batched(prompts, chunk_size)):
            path = folder.chunk_path(index)
            if folder.finished_prompts(path) == len(chunk):
                bar.update(len(chunk))
                continue
            if path.is_file() and (message := folder.set_aside(path)):
                tqdm.write(message)
            rows = []
            for offset, prompt in enumerate(chunk):
                rows += prompt_rows(model, drafter, prompt, config, index * chunk_size + offset)
                bar.update(1)
            write_chunk(path, rows, index, len(chunk))
    finally:
        bar.close()
    return load_c2t_data(output_dir)


def load_c2t_data(path: str | os.PathLike):
    """A ``c2t-data`` folder as one ``datasets.Dataset`` (every chunk validated; a bad one is named)."""
    from datasets import Dataset

    rows = list(_data_folder(path).iter_records())
    return Dataset.from_dict({c: [r[c] for r in rows] for c in COLUMNS})


def rank_acceptance(dataset, max_rank: int | None = None) -> list[float]:
    """Sequoia's per-rank acceptance a_r from labelled full trees: accepted rank-r children / accepted expanded
    parents (every expanded node of a full EAGLE-2 tree has the same top-k children)."""
    data = dataset.with_format("torch")[:]
    label, rank = data["label"].bool(), data["rank"]
    # expanded parents the target reached: the root of every tree, plus accepted nodes that have children
    roots = len({(int(p), int(q)) for p, q in zip(data["prompt"], data["position"])})
    reached = roots + int((label & data["expanded"].bool()).sum())
    top = int(rank.max()) + 1 if max_rank is None else max_rank
    return [float((label & (rank == r)).sum()) / max(reached, 1) for r in range(top)]


def negative_sample(dataset, ratio: float, seed: int = 0):
    """Every positive and ``ratio`` negatives per positive (drawn without replacement, fixed seed)."""
    labels = torch.tensor(dataset["label"])
    pos = labels.nonzero().flatten()
    neg = (labels == 0).nonzero().flatten()
    count = min(neg.numel(), int(round(ratio * pos.numel())))
    gen = torch.Generator().manual_seed(seed)
    chosen = neg[torch.randperm(neg.numel(), generator=gen)[:count]]
    return dataset.select(torch.cat([pos, chosen]).sort().values.tolist())


@dataclass
class C2TConfig(TrainingArguments):
    """``TrainingArguments`` with C2T's settings (Appendix B.2: batch 1024, Adam, 10 epochs, BCE)."""

    negative_ratio: float = field(default=4.0, metadata={"help": "negatives kept per positive (0 = keep all)"})
    learning_rate: float = field(default=1e-2, metadata={"help": "peak learning rate"})
    num_train_epochs: float = field(default=10.0, metadata={"help": "epochs"})
    per_device_train_batch_size: int = field(default=1024, metadata={"help": "nodes per step"})
    per_device_eval_batch_size: int = field(default=1024, metadata={"help": "nodes per eval step"})
    weight_decay: float = field(default=0.0, metadata={"help": "weight decay"})
    remove_unused_columns: bool = field(default=False, metadata={"help": "the collator reads named columns"})
    prediction_loss_only: bool = field(default=True, metadata={"help": "evaluation reports the loss"})
    dataloader_pin_memory: bool = pin_memory_field()
    report_to: None | str | list[str] = field(default="none", metadata={"help": "experiment trackers"})
    save_strategy: str = field(default="no", metadata={"help": "the classifier is saved once, at the end"})
    logging_steps: float = field(default=50, metadata={"help": "log every N steps"})
    disable_tqdm: bool | None = field(default=True, metadata={"help": "no progress bar (a run takes seconds)"})
    seed_negatives: int = field(default=0, metadata={"help": "seed of the negative sampling"})

    def __post_init__(self):
        super().__post_init__()
        if self.negative_ratio < 0:
            raise ValueError("negative_ratio must be >= 0.")


def collate(rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    return {"features": torch.tensor([r["features"] for r in rows], dtype=torch.float32),
            "labels": torch.tensor([r["label"] for r in rows], dtype=torch.float32)}


class C2TTrainer(SmallModelTrainerMixin, Trainer):
    """Trains a :class:`~hf_treespec.policies.c2t.C2TClassifier` with BCE on (negative-sampled) labelled nodes.

    Fits the classifier's feature standardisation on the training rows first; ``save_model`` writes the classifier
    folder that ``c2t_classifier=`` loads (or that ships as ``<drafter>/c2t/``)."""

    def __init__(self, model: C2TClassifier, args: C2TConfig | None = None, *, train_dataset=None, eval_dataset=None,
                 data_collator=None, **kwargs):
        args = args or C2TConfig(output_dir="c2t-classifier")
        if not isinstance(args, C2TConfig):
            raise TypeError(f"C2TTrainer needs a C2TConfig, got {type(args).__name__}.")
        if not isinstance(model, C2TClassifier):
            raise TypeError(f"C2TTrainer trains a C2TClassifier, got {type(model).__name__}.")
        if train_dataset is not None:
            if sum(train_dataset["label"]) == 0:
                raise ValueError("the training data has no accepted node (label 1): generate more c2t-data.")
            if args.negative_ratio > 0:
                train_dataset = negative_sample(train_dataset, args.negative_ratio, args.seed_negatives)
            if not model.config.standardised:
                model.fit_standardisation(torch.tensor(train_dataset["features"], dtype=torch.float32))
        super().__init__(model=model, args=args, data_collator=data_collator or collate, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, **kwargs)

    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        logits = model(inputs["features"])
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, inputs["labels"])
        return (loss, {"logits": logits.detach()}) if return_outputs else loss

