"""Training data for feature drafters: target hidden states (and TALF target trees) extracted once, stored in chunks.

``prepare_dataset`` runs the target (no grad, batched by length) over chat-templated conversations (or the token ids
of ``train regenerate`` records, used as they are) and writes, per
conversation, the token ids, the assistant loss mask and the hidden states the drafter reads (``target_layers``) as a
``datasets`` Arrow dataset. Work is split in chunks of ``chunk_size`` conversations, each written to a temporary
folder and renamed into place when complete: a rerun skips finished chunks, and a crash loses at most one chunk.

Soft labels are not stored as 49k-wide distributions. What is stored recomputes them with one matmul at train time:
the target's *pre-norm last hidden state* (``logits = lm_head(norm(h))``, see :class:`~.losses.TargetHead`); it is
the feature column itself when ``-1`` is among ``target_layers``, else a separate column.

With a tree policy (TALF), the target also grows a tree at ``tree_positions`` sampled positions per conversation
(all positions with ``None``) and the expanded nodes' tokens, parents and pre-norm states are stored: the trees are
built once and reused every epoch (:mod:`.target_trees`). Target-argmax token counts for ``build_draft_vocab`` come
from the same pass (``token_counts.pt`` per chunk; :func:`load_prepared` sums them).
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch
from tqdm.auto import tqdm

from hf_treespec.api import none_or, option, output_cache, capture_hidden_states, POLICIES, TreePolicy

from .chat import pretokenized, to_messages, tokenize_conversation
from .target_trees import TreeRoot, grow_target_trees, topk_logprobs

CONFIG_FILE = "prepare_config.json"
COUNTS_FILE = "token_counts.pt"
CHUNK_FILE = "chunk.json"
CHUNK_PREFIX = "chunk-"
STORAGE_DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float16": torch.float16,
                                          "float32": torch.float32}


#: draft nodes of a target tree whose policy would otherwise size it per machine (the N = 60 of EAGLE-2 and SALF)
TARGET_TREE_BUDGET = 60


@dataclass
class PrepareConfig:
    """What ``prepare_dataset`` extracts. Saved next to the chunks; a rerun must use the same values.

    Args:
        target_layers: target layers the drafter reads (``-1`` = pre-norm last state), as in the drafter config.
        max_length: conversations are truncated to this many tokens.
        storage_dtype: dtype of the stored hidden states (``"bfloat16"`` halves the size of fp32).
        chunk_size: conversations per chunk (the unit of resumption).
        batch_tokens: padded tokens per target forward (batches are formed by length inside a chunk).
        tree_policy: policy the target grows TALF trees with (a ``hf_treespec`` policy name), or None for no trees.
        tree_params: the policy's parameters (EAGLE-2 for TALF: ``tree_topk=4, tree_depth=3``).
        tree_positions: tree roots sampled per conversation (None = every position whose next token is an assistant
            token). Each root costs ``expanded nodes`` target tokens, so this bounds the preprocessing cost.
        answer_topk: target log-probs kept per node for the policy to rank children (>= the policy's top-k).
        seed: sampling of tree roots.
    """

    target_layers: list[int] = field(default_factory=lambda: [-1], metadata=option(
        "target layers the drafter reads", hidden=True))  # the command resolves them from --input-mode
    max_length: int = field(default=2048, metadata=option("truncate conversations to this many tokens"))
    storage_dtype: str = field(default="bfloat16", metadata=option(
        "dtype of the stored hidden states", choices=tuple(STORAGE_DTYPES)))
    chunk_size: int = field(default=64, metadata=option("conversations per resumable chunk"))
    batch_tokens: int = field(default=4096, metadata=option("padded tokens per target forward"))
    tree_policy: str | None = field(default=None, metadata=option(
        "policy the target grows TALF trees with ('none' for EAGLE/HASS-only data; 'chain' for evaluation data)",
        parse=none_or(str)))
    tree_params: dict[str, Any] = field(default_factory=dict, metadata=option(
        "the policy's parameters", hidden=True))  # the command's --tree-topk / --tree-depth
    tree_positions: int | None = field(default=64, metadata=option(
        "tree roots sampled per conversation, or 'all' (cost: ~expanded nodes target tokens each)",
        parse=none_or(int, "all")))
    answer_topk: int = field(default=64, metadata=option("target log-probs kept per tree node"))
    seed: int = field(default=0, metadata=option("sampling of tree roots"))
    target: str = field(default="", metadata=option("recorded: the target", hidden=True))

    def __post_init__(self) -> None:
        self.target_layers = [int(i) for i in self.target_layers]
        if not self.target_layers or len(set(self.target_layers)) != len(self.target_layers):
            raise ValueError(f"target_layers must be distinct layer indices, got {self.target_layers}.")
        if self.storage_dtype not in STORAGE_DTYPES:
            raise ValueError(f"storage_dtype must be one of {sorted(STORAGE_DTYPES)}, got {self.storage_dtype!r}.")
        for name in ("max_length", "chunk_size", "batch_tokens", "answer_topk"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
        if self.tree_positions is not None and self.tree_positions < 1:
            raise ValueError("tree_positions must be >= 1, or None for every position.")
        if self.tree_policy is not None:
            self.make_policy()  # unknown names / parameters fail here, before any target forward

    @property
    def stores_last_hidden(self) -> bool:
        """Whether the label source (pre-norm last state) needs its own column (-1 not among the features)."""
        return -1 not in self.target_layers

    def make_policy(self) -> TreePolicy | None:
        """The policy that grows the target trees. A policy whose ``tree_budget`` defaults to ``"auto"`` (sized by
        the decoding machine's measured cost) gets the papers' fixed `TARGET_TREE_BUDGET` unless ``tree_params``
        names one: a training tree has no machine to be sized for."""
        if self.tree_policy is None:
            return None
        cls = POLICIES.get(self.tree_policy)
        fixed = {"tree_budget": TARGET_TREE_BUDGET} if cls.defaults.get("tree_budget") == "auto" else {}
        return cls(do_sample=False, **{**fixed, **self.tree_params})


def encode_tensor(tensor: torch.Tensor, dtype: torch.dtype) -> bytes:
    """Raw bytes of ``tensor`` in ``dtype`` (Arrow has no bfloat16 type; bytes also avoid per-element overhead)."""
    return tensor.detach().to(dtype).contiguous().cpu().view(torch.uint8).numpy().tobytes()


def decode_tensor(data: bytes, dtype: torch.dtype, width: int) -> torch.Tensor:
    """Inverse of :func:`encode_tensor`: ``[rows, width]``."""
    if not data:
        return torch.zeros(0, width, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=dtype).view(-1, width)


def features_schema():
    from datasets import Features, Sequence, Value

    return Features({
        "id": Value("string"),
        "input_ids": Sequence(Value("int32")),
        "loss_mask": Sequence(Value("int8")),
        "hidden_states": Value("binary"),
        "last_hidden_state": Value("binary"),
        "tree_roots": Sequence(Value("int32")),
        "tree_tokens": Sequence(Sequence(Value("int32"))),
        "tree_parents": Sequence(Sequence(Value("int32"))),
        "tree_hidden": Value("binary"),
    })


# ------------------------------------------------------------------------------------------------------ prepare
def prepare_dataset(
    model,
    tokenizer,
    conversations: Iterable[Mapping[str, Any] | list[Mapping[str, str]]],
    output_dir: str | os.PathLike,
    config: PrepareConfig | None = None,
    *,
    num_conversations: int | None = None,
    progress: bool = True,
) -> Path:
    """Extracts training data for a feature drafter into ``output_dir`` (resumable; see the module docstring).

    ``conversations`` yields ShareGPT records or lists of chat messages; the first ``num_conversations`` are used
    (all with None). Returns ``output_dir``; load it with :func:`load_prepared`.
    """
    config = config or PrepareConfig()
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    _check_or_write_config(output_dir, config)
    policy = config.make_policy()
    records = conversations if num_conversations is None else itertools.islice(conversations, num_conversations)
    total_chunks = None if num_conversations is None else -(-num_conversations // config.chunk_size)
    chunks = _batched(enumerate(records), config.chunk_size)
    bar = tqdm(total=num_conversations, desc="prepare", unit="conv", disable=not progress)
    written = skipped = 0
    try:
        for index, chunk in enumerate(chunks):
            folder = output_dir / f"{CHUNK_PREFIX}{index:05d}"
            if _chunk_done(folder, len(chunk)):
                skipped += 1
                bar.update(len(chunk))
                continue
            _write_chunk(model, tokenizer, chunk, folder, config, policy, bar)
            written += 1
            bar.set_postfix(chunks=f"{written + skipped}/{total_chunks or '?'}", skipped=skipped)
    finally:
        bar.close()
    return output_dir


def _batched(iterable, size: int):
    iterator = iter(iterable)
    while chunk := list(itertools.islice(iterator, size)):
        yield chunk


def _check_or_write_config(output_dir: Path, config: PrepareConfig) -> None:
    path = output_dir / CONFIG_FILE
    current = asdict(config)
    if path.is_file():
        saved = json.loads(path.read_text())
        if saved != json.loads(json.dumps(current)):
            diff = {k: (saved.get(k), v) for k, v in current.items() if saved.get(k) != json.loads(json.dumps(v))}
            raise ValueError(f"{output_dir} was prepared with different settings {diff} (saved, now); use another "
                             "output folder or the same settings to resume.")
        return
    path.write_text(json.dumps(current, indent=2) + "\n")


def _chunk_done(folder: Path, records: int | None = None) -> bool:
    """Finished chunks are complete folders (renamed into place last); ``records`` also checks a chunk cut short by
    an earlier, smaller ``num_conversations`` is redone when more conversations are asked for now."""
    info = folder / CHUNK_FILE
    if not (info.is_file() and (folder / COUNTS_FILE).is_file()):
        return False
    return records is None or json.loads(info.read_text())["records"] == records


def _write_chunk(model, tokenizer, chunk, folder: Path, config: PrepareConfig, policy, bar) -> None:
    from datasets import Dataset

    items = []
    vocab = model.config.get_text_config().vocab_size
    for index, record in chunk:
        tokens = pretokenized(record, config.max_length, vocab)  # `train regenerate` records keep their ids
        if tokens is None:
            messages = to_messages(record)
            if not messages:
                continue
            tokens = tokenize_conversation(tokenizer, messages, config.max_length)
        ids, mask = tokens
        if len(ids) < 3 or not any(mask[2:]):
            continue
        record_id = str(record.get("id", index)) if isinstance(record, Mapping) else str(index)
        items.append({"index": index, "id": record_id, "input_ids": ids, "loss_mask": mask})
    counts = torch.zeros(vocab, dtype=torch.long)
    rows: dict[int, dict[str, Any]] = {}
    bar.update(len(chunk) - len(items))  # conversations without an assistant turn to learn from
    for batch in _length_batches(items, config.batch_tokens):
        for item, row in zip(batch, _extract_batch(model, batch, config, policy, counts)):
            rows[item["index"]] = row
        bar.update(len(batch))
    ordered = [rows[item["index"]] for item in items]  # conversation order, whatever the batching
    columns = {name: [row[name] for row in ordered] for name in features_schema()}
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    Dataset.from_dict(columns, features=features_schema()).save_to_disk(str(tmp))
    torch.save(counts, tmp / COUNTS_FILE)
    tokens = sum(len(item["input_ids"]) for item in items)
    (tmp / CHUNK_FILE).write_text(json.dumps({"records": len(chunk), "kept": len(items), "tokens": tokens}) + "\n")
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)


def _length_batches(items: list[dict], batch_tokens: int) -> list[list[dict]]:
    """Longest first, as many per batch as fit in ``batch_tokens`` padded tokens (at least one)."""
    batches: list[list[dict]] = []
    for item in sorted(items, key=lambda it: -len(it["input_ids"])):
        if batches and (len(batches[-1]) + 1) * len(batches[-1][0]["input_ids"]) <= batch_tokens:
            batches[-1].append(item)
        else:
            batches.append([item])
    return batches


@torch.no_grad()
def _extract_batch(model, batch: list[dict], config: PrepareConfig, policy, counts: torch.Tensor) -> list[dict]:
    device = next(model.parameters()).device
    dtype = STORAGE_DTYPES[config.storage_dtype]
    lengths = [len(item["input_ids"]) for item in batch]
    width = max(lengths)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    attention = torch.zeros(len(batch), width, dtype=torch.long)
    for row, item in enumerate(batch):
        ids[row, : lengths[row]] = torch.tensor(item["input_ids"])
        attention[row, : lengths[row]] = 1
    layers = list(config.target_layers) + ([-1] if config.stores_last_hidden else [])
    with capture_hidden_states(model, layers) as captured:
        out = model(input_ids=ids.to(device), attention_mask=attention.to(device), use_cache=policy is not None)
    states = captured.hidden_states
    hidden_size = model.config.get_text_config().hidden_size
    features = states[..., : len(config.target_layers) * hidden_size]
    last = states[..., -hidden_size:]
    argmax = out.logits.argmax(-1).cpu()
    results, roots = [], []
    for row, item in enumerate(batch):
        n = lengths[row]
        mask = torch.tensor(item["loss_mask"], dtype=torch.bool)
        scored = mask[1:n]  # position t predicts token t + 1
        counts += torch.bincount(argmax[row, : n - 1][scored], minlength=counts.numel())
        results.append({
            "id": item["id"],
            "input_ids": item["input_ids"],
            "loss_mask": item["loss_mask"],
            "hidden_states": encode_tensor(features[row, :n], dtype),
            "last_hidden_state": encode_tensor(last[row, :n], dtype) if config.stores_last_hidden else b"",
            "tree_roots": [], "tree_tokens": [], "tree_parents": [], "tree_hidden": b"",
        })
        if policy is not None:
            for position in _root_positions(mask, config, item["index"]):
                roots.append(TreeRoot(row=row, position=position, token=int(ids[row, position]),
                                      logprobs=topk_logprobs(out.logits[row, position], config.answer_topk)))
    if policy is not None and roots:
        trees = grow_target_trees(model, output_cache(out), roots, policy, config.answer_topk)
        by_row: dict[int, list] = {}
        for root, tree in zip(roots, trees):
            by_row.setdefault(root.row, []).append((root, tree))
        for row, pairs in by_row.items():
            result = results[row]
            result["tree_roots"] = [root.position for root, _ in pairs]
            result["tree_tokens"] = [tree.tokens.tolist() for _, tree in pairs]
            result["tree_parents"] = [tree.parents.tolist() for _, tree in pairs]
            hidden = [tree.hidden for _, tree in pairs if tree.hidden.numel()]
            result["tree_hidden"] = encode_tensor(torch.cat(hidden), dtype) if hidden else b""
    return results


def _root_positions(mask: torch.Tensor, config: PrepareConfig, index: int) -> list[int]:
    """Tree roots: positions s >= 1 (the drafter reads the state at s - 1) whose next token is an assistant token."""
    candidates = (mask[2:].nonzero().squeeze(-1) + 1).tolist()
    if config.tree_positions is None or len(candidates) <= config.tree_positions:
        return candidates
    generator = torch.Generator().manual_seed(config.seed * 1_000_003 + index)
    picked = torch.randperm(len(candidates), generator=generator)[: config.tree_positions]
    return sorted(candidates[i] for i in picked.tolist())


# --------------------------------------------------------------------------------------------------------- load
@dataclass
class PreparedData:
    """Prepared folder(s): the concatenated chunks, the settings they were made with and the argmax token counts."""

    dataset: Any
    config: PrepareConfig
    token_counts: torch.Tensor
    hidden_size: int
    sources: tuple[str, ...] = ()  # the folders it was loaded from, for messages

    @property
    def feature_size(self) -> int:
        return len(self.config.target_layers) * self.hidden_size

    @property
    def num_tokens(self) -> int:
        return int(sum(len(ids) for ids in self.dataset["input_ids"]))


#: Settings that decide what a prepared row holds; folders trained on together must agree on them.
MERGEABLE_KEYS = ("target", "target_layers", "storage_dtype", "tree_policy", "tree_params", "answer_topk")


def load_prepared(paths: str | os.PathLike | Iterable[str | os.PathLike]) -> PreparedData:
    """Loads every finished chunk of one or more ``prepare_dataset`` folders (unfinished chunks are ignored).

    Several folders (e.g. ShareGPT's answers and the target's own from ``train regenerate``) train together when they
    hold the same kind of rows (:data:`MERGEABLE_KEYS`); their argmax token counts add up. Lengths, chunking and tree
    sampling may differ. The first folder's settings describe the result.
    """
    from datasets import concatenate_datasets, load_from_disk

    paths = [Path(paths)] if isinstance(paths, (str, os.PathLike)) else [Path(p) for p in paths]
    if not paths:
        raise ValueError("no prepared data folder given.")
    config, parts, counts = None, [], None
    for path in paths:
        this = _read_config(path)
        if config is not None:
            for key in MERGEABLE_KEYS:
                if getattr(this, key) != getattr(config, key):
                    raise ValueError(f"{path} was prepared with {key}={getattr(this, key)!r}, {paths[0]} with "
                                     f"{getattr(config, key)!r}: folders trained together must agree on "
                                     f"{', '.join(MERGEABLE_KEYS)}.")
        config = config or this
        folders = sorted(p for p in path.glob(f"{CHUNK_PREFIX}*")
                         if p.is_dir() and not p.name.endswith(".tmp") and _chunk_done(p))
        if not folders:
            raise ValueError(f"{path} has no finished chunks yet.")
        parts += [load_from_disk(str(folder)) for folder in folders]
        folder_counts = sum(torch.load(folder / COUNTS_FILE) for folder in folders)
        counts = folder_counts if counts is None else counts + folder_counts
    dataset = concatenate_datasets([p for p in parts if len(p)]) if any(len(p) for p in parts) else parts[0]
    hidden_size = _hidden_size(dataset, config)
    return PreparedData(dataset=dataset, config=config, token_counts=counts, hidden_size=hidden_size,
                        sources=tuple(map(str, paths)))


def _read_config(path: Path) -> PrepareConfig:
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        raise FileNotFoundError(f"{path} is not a prepared data folder (no {CONFIG_FILE}); run "
                                "`hf-treespec train prepare` first.")
    return PrepareConfig(**json.loads(config_path.read_text()))


def _hidden_size(dataset, config: PrepareConfig) -> int:
    if len(dataset) == 0:
        return 0
    row = dataset[0]
    element = torch.finfo(STORAGE_DTYPES[config.storage_dtype]).bits // 8
    return len(row["hidden_states"]) // (element * len(row["input_ids"]) * len(config.target_layers))
