"""Trees built by the *target* at many training positions at once (TALF preprocessing, acceptance evaluation).

TALF (Algorithm 1 of the SALF & TALF paper) has the target grow a tree at every training position, with the same
policy a drafter uses at inference (EAGLE-2 beam, k=4, depth 3), and stores the target's next-token distribution at
every expanded node. Growing the trees one position at a time would cost a target forward per position and depth, so
the policies of ``hf_treespec.policies`` are run *in lockstep* over all positions instead:

- Every round, each unfinished policy's growth (``TreePolicy.grow``, a generator) advances to its next draft
  request. All requests of the round are answered by ONE target forward over the requested nodes of every position,
  reusing the KV cache of the sequence forward: each node attends to its position's prefix and to its own tree
  ancestors (a 4D float mask from :func:`hf_treespec.attention.float_mask`), at position id ``root + depth``.
- :class:`AnswerSource` is the policy's draft source: it turns the round's recorded target answer into the request's
  answer.

The number of rounds is the policy's number of draft calls (3 for EAGLE-2 depth 3). Answers keep the target's top
``answer_topk`` log-probs per node (the policies only rank the best few children; a full 49k-row table per node would
not fit in memory for hundreds of positions).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, PreTrainedModel

from hf_treespec.api import (
    float_mask, CACHE_KWARG, capture_hidden_states, DraftSource, StepContext, TreePolicy, Growth, grow_in_rounds,
    DraftTree, sliding_layers,
)


class AnswerSource(DraftSource):
    """A policy draft source (``logprobs(tree, nodes)``) whose answer to each request is the one recorded for it (the
    round's forward appends it to ``answers`` before the request is answered)."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.answers: list[tuple[torch.Tensor, torch.Tensor]] = []  # (values, token ids) [len(nodes), top]
        self.calls = 0

    def recorded(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next recorded answer, in request order."""
        if self.calls == len(self.answers):
            raise RuntimeError("a policy request was answered before the round's forward recorded its answer")
        self.calls += 1
        return self.answers[self.calls - 1]

    def logprobs(self, tree: DraftTree, nodes: torch.Tensor) -> torch.Tensor:
        values, ids = self.recorded()
        out = torch.full((ids.shape[0], self.vocab_size), float("-inf"), device=tree.device)
        return out.scatter_(1, ids.to(tree.device), values.to(tree.device))


@dataclass
class TreeRoot:
    """A tree to grow: the root token sits at ``position`` of batch row ``row`` of the sequence forward.

    ``logprobs`` is the target's top log-probs after the root, ``(values, token ids)`` of shape ``[top]``: the
    sequence forward computed them already.
    """

    row: int
    position: int
    token: int
    logprobs: tuple[torch.Tensor, torch.Tensor]


@dataclass
class TargetTree:
    """The expanded part of a target-built tree: every node here has a stored target distribution.

    ``tokens`` / ``parents`` / ``depth`` as in :class:`~hf_treespec.tree.DraftTree` (node 0 = root); ``hidden`` is
    ``[n - 1, H]``, the target's pre-norm last hidden state at nodes 1..n-1, from which ``lm_head(norm(hidden))``
    recomputes the node's next-token distribution (the root's is the sequence forward's at the root position).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depth: torch.Tensor
    hidden: torch.Tensor


@dataclass
class _Growing:
    root: TreeRoot
    source: AnswerSource
    growth: Growth
    columns: dict[int, int] = field(default_factory=dict)  # node uid -> KV column of its row
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # node uid -> pre-norm last hidden state
    answered: set[int] = field(default_factory=set)  # uids of expanded nodes
    tree: DraftTree | None = None


def topk_logprobs(logits: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, ids)`` of the ``top`` best log-probs of each row of ``logits`` (fp32 log-softmax first)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    values, ids = logprobs.topk(min(top, logprobs.shape[-1]), dim=-1)
    return values.cpu(), ids.cpu()


@torch.no_grad()
def grow_target_trees(
    model: PreTrainedModel,
    cache: DynamicCache,
    roots: list[TreeRoot],
    policy: TreePolicy,
    answer_topk: int = 64,
) -> list[TargetTree]:
    """Grows one tree per root with ``policy``, the target playing the drafter; one target forward per round.

    ``cache`` holds the sequence forward of the batch (right-padded rows; it is extended with the tree rows).
    """
    sliding = sorted(set(sliding_layers(cache)))
    if sliding:
        raise ValueError(
            f"{type(model).__name__} has sliding-window attention ({', '.join(sliding)} cache layers): growing "
            "target trees for TALF / GTO data over it is not supported (a window layer drops the rows the tree "
            "columns index). Prepare flat data (--tree-policy none) and train with EAGLE or HASS."
        )
    vocab = model.config.get_text_config().vocab_size
    states = []
    for root in roots:
        source = AnswerSource(vocab)
        growth = policy.grow(root.token, context=StepContext(root.token), capabilities=source.capabilities)
        states.append(_Growing(root, source, growth))

    def answer_round(indices: list[int], requests: list) -> list:
        asked = [(states[i], request.tree, request.nodes.cpu().long()) for i, request in zip(indices, requests)]
        _answer(model, cache, asked, answer_topk)
        return [request.answer(states[i].source) for i, request in zip(indices, requests)]

    drafts = grow_in_rounds([state.growth for state in states], answer_round)
    for state, draft in zip(states, drafts):
        state.tree = draft.tree
    return [_finish(state) for state in states]


def _answer(model, cache: DynamicCache, requests, answer_topk: int) -> None:
    """Answers one round of requests: root rows from the sequence forward, the others in one target forward."""
    entries: list[tuple[_Growing, DraftTree, int]] = [
        (state, tree, int(node)) for state, tree, nodes in requests for node in nodes if int(node) != 0
    ]
    answers: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
    if entries:
        answers = _forward_nodes(model, cache, entries, answer_topk)
    for state, tree, nodes in requests:
        values, ids = [], []
        for node in nodes.tolist():
            uid = int(tree.uids[node])
            value, idx = state.root.logprobs if node == 0 else answers[(id(state), uid)]
            values.append(value)
            ids.append(idx)
            state.answered.add(uid)
        state.source.answers.append((torch.stack(values), torch.stack(ids)))


def _forward_nodes(model, cache: DynamicCache, entries, answer_topk: int):
    """One target forward over tree nodes of many roots: each attends to its root's prefix and its ancestors."""
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    past = cache.get_seq_length()
    rows = max(entry[0].root.row for entry in entries) + 1
    rows = max(rows, _cache_batch(cache))
    per_row: list[list[tuple[_Growing, DraftTree, int]]] = [[] for _ in range(rows)]
    for entry in entries:
        per_row[entry[0].root.row].append(entry)
    width = max(len(items) for items in per_row)
    tokens = torch.zeros(rows, width, dtype=torch.long)
    positions = torch.zeros(rows, width, dtype=torch.long)
    visible = torch.zeros(rows, width, past + width, dtype=torch.bool)
    visible[:, torch.arange(width), past + torch.arange(width)] = True  # every row sees itself (padding included)
    for row, items in enumerate(per_row):
        for slot, (state, tree, node) in enumerate(items):
            tokens[row, slot] = tree.tokens[node]
            positions[row, slot] = state.root.position + int(tree.depth[node])
            visible[row, slot, : state.root.position + 1] = True
            ancestors = tree.path_to(node)[1:-1]  # strict ancestors below the root (the root is in the prefix)
            for ancestor in ancestors.tolist():
                column = state.columns.get(int(tree.uids[ancestor]))
                if column is None:
                    raise RuntimeError("the policy expanded a node whose ancestor the target never saw; only "
                                       "policies that grow trees from expanded nodes can run in lockstep.")
                visible[row, slot, column] = True
    mask = float_mask(visible, dtype)[0, 0][:, None]
    with capture_hidden_states(model, [-1]) as captured:
        out = model(
            input_ids=tokens.to(device), attention_mask=mask.to(device), position_ids=positions.to(device),
            use_cache=True, **{CACHE_KWARG: cache},
        )
    hidden = captured.hidden_states
    answers = {}
    for row, items in enumerate(per_row):
        if not items:
            continue
        values, ids = topk_logprobs(out.logits[row, : len(items)], answer_topk)
        for slot, (state, tree, node) in enumerate(items):
            uid = int(tree.uids[node])
            state.columns[uid] = past + slot
            state.hidden[uid] = hidden[row, slot].detach().cpu()
            answers[(id(state), uid)] = (values[slot], ids[slot])
    return answers


def _cache_batch(cache: DynamicCache) -> int:
    for layer in cache.layers:
        keys = getattr(layer, "keys", None)
        if keys is not None and keys.numel():
            return int(keys.shape[0])
    return 1


def _finish(state: _Growing) -> TargetTree:
    """The expanded nodes of the final tree (closed under parents: a node exists only once its parent expanded)."""
    tree = state.tree
    keep = torch.tensor([int(uid) in state.answered for uid in tree.uids.tolist()], dtype=torch.bool)
    if not bool(keep[0]):  # the policy never expanded the root: a root-only tree
        keep[0] = True
    tree = tree.select(keep)
    uids = tree.uids.tolist()[1:]
    width = next(iter(state.hidden.values())).shape[-1] if state.hidden else 0
    hidden = torch.stack([state.hidden[uid] for uid in uids]) if uids else torch.zeros(0, width)
    return TargetTree(tokens=tree.tokens.clone(), parents=tree.parents.clone(), depth=tree.depth.clone(),
                      hidden=hidden)
