"""Draft trees a feature drafter grows at many training positions at once, and what the target says of their nodes.

GTO (docs/algorithms.md) needs, at every sampled position of a training batch, the tree the drafter would draft
there with the inference policy, and the target's probability of every tree node given its path. Both are batched:

- :func:`grow_drafter_trees` runs the inference policies of ``hf_treespec.policies`` *in lockstep* over all positions,
  as :mod:`.target_trees` does: every round, each unfinished policy's growth advances to its next draft request; ONE
  drafter forward then answers the requests of every position. Nodes attend to
  their root's prefix in the drafter's context pass and to their own tree ancestors of earlier rounds (a 4D float
  mask from :func:`hf_treespec.attention.float_mask`), at position id ``root column + depth``, reading their parent's
  output feature -- the layout of the inference adapter and of :func:`.unroll.unroll`.
- :func:`score_trees` runs the target once over the prefix (KV cache) and then over the trees' *internal* nodes
  (leaves need no target distribution), in chunks of whole trees, cropping the cache back to the prefix after each,
  and returns per node the target's probability of the node's token given its path, and whether it is the target's
  argmax there (the temperature-0 acceptance).

Answers keep each node's ``topk`` best draft log-probs: enough for policies that rank the best ``k`` children of a
node (``eagle2``, ``chain``); the policies read them through the ``topk_logprobs`` fast path of a draft source.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_treespec.api import (
    float_mask, CACHE_KWARG, output_cache, TreePolicy, grow_in_rounds, StepContext, DraftTree, sliding_layers,
)

from ..data.target_trees import AnswerSource


class TopkAnswerSource(AnswerSource):
    """:class:`~.target_trees.AnswerSource` that also answers ``topk_logprobs`` from the recorded sparse answers, so
    policies that rank children never build ``[nodes, vocab]`` rows."""

    capabilities = frozenset({"topk_logprobs"})

    def topk_logprobs(self, tree: DraftTree, nodes: torch.Tensor, k: int):
        values, ids = self.recorded()
        if k > values.shape[-1]:
            raise ValueError(f"the policy asks for {k} children per node but rollouts keep {values.shape[-1]}; raise "
                             "the rollout top-k.")
        return values[:, :k].to(tree.device), ids[:, :k].to(tree.device)


@dataclass
class _Rollout:
    row: int
    column: int  # drafter context column of the root (sequence position - 1)
    token: int
    source: TopkAnswerSource
    columns: torch.Tensor  # [uid capacity] KV column of every forwarded node (-1: not forwarded)

    def ensure(self, capacity: int) -> None:
        if self.columns.numel() < capacity:
            grown = torch.full((max(capacity, 2 * self.columns.numel()),), -1, dtype=torch.long)
            grown[: self.columns.numel()] = self.columns
            self.columns = grown


@torch.no_grad()
def grow_drafter_trees(
    drafter,
    input_ids: torch.Tensor,
    target_hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None,
    rows: torch.Tensor,
    positions: torch.Tensor,
    policy: TreePolicy,
    topk: int,
) -> list[DraftTree]:
    """One tree per root, grown by ``policy`` with ``drafter`` as the draft source, all roots in lockstep.

    Args:
        drafter: a :class:`~hf_treespec.drafters.TreeSpecDrafterModel` (tied to its target).
        input_ids / target_hidden_states / attention_mask: the drafter's context batch (as the collators emit it:
            column ``j`` reads sequence token ``j + 1`` with the target state ``j``).
        rows / positions: ``[P]`` batch row and *sequence* position of every root; the root token is sequence token
            ``positions[i]`` (drafter column ``positions[i] - 1``), as the last committed token at inference.
        policy: a deterministic tree policy (``eagle2`` with the decoding budget, depth and top-k).
        topk: draft log-probs kept per node (>= the policy's top-k).
    Returns:
        the trees (on the CPU, tokens in the target vocabulary), in root order.
    """
    context = drafter(input_ids=input_ids, target_hidden_states=target_hidden_states, attention_mask=attention_mask,
                      use_cache=True)
    cache = context.cache
    columns = (positions - 1).to(input_ids.device)
    rows_dev = rows.to(input_ids.device)
    root_values, root_ids = _top(drafter, context.logits[rows_dev, columns], topk)
    tokens = input_ids[rows_dev, columns].cpu()
    vocab = int(drafter.config.vocab_size)
    states = [
        _Rollout(int(r), int(c), int(t), TopkAnswerSource(vocab), torch.full((64,), -1, dtype=torch.long))
        for r, c, t in zip(rows.tolist(), columns.tolist(), tokens.tolist())
    ]
    # drafter output features of forwarded nodes, by row and KV column (context columns: the context pass)
    features = context.hidden_states
    context_len = input_ids.shape[1]
    device = torch.device("cpu")
    growths = [policy.grow(state.token, context=StepContext(state.token, device=device),
                           capabilities=state.source.capabilities) for state in states]

    def answer_round(indices: list[int], requests: list) -> list:
        nonlocal features
        asked = [(i, request.tree, request.nodes.cpu().long()) for i, request in zip(indices, requests)]
        features = _expand(drafter, cache, features, context_len, states, asked, root_values, root_ids, topk)
        return [request.answer(states[i].source) for i, request in zip(indices, requests)]

    return [draft.tree for draft in grow_in_rounds(growths, answer_round)]


def _top(drafter, logits: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Best ``topk`` draft log-probs per row, token ids mapped to the target vocabulary (CPU)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    values, ids = logp.topk(min(topk, logp.shape[-1]), dim=-1)
    return values.cpu(), drafter.d2t[ids].cpu()


def _expand(drafter, cache, features, context_len, states, requests, root_values, root_ids, topk) -> torch.Tensor:
    """Answers one round of requests: root rows from the context pass, the other nodes in one drafter forward over
    every row. Returns ``features`` extended with the new columns' output features."""
    past = cache.get_seq_length()
    batch = features.shape[0]
    per_row: list[list[tuple[int, DraftTree, torch.Tensor]]] = [[] for _ in range(batch)]
    for index, tree, nodes in requests:
        per_row[states[index].row].append((index, tree, nodes[nodes != 0]))
    width = max(sum(int(nodes.numel()) for _, _, nodes in items) for items in per_row)
    blocks: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # request -> answers of its non-root nodes
    if width:
        tokens = torch.zeros(batch, width, dtype=torch.long)
        positions = torch.zeros(batch, width, dtype=torch.long)
        parent_columns = torch.zeros(batch, width, dtype=torch.long)
        visible = torch.zeros(batch, width, past + width, dtype=torch.bool)
        visible[:, torch.arange(width), past + torch.arange(width)] = True  # padding slots see themselves
        for row, items in enumerate(per_row):
            offset = 0
            for index, tree, nodes in items:
                state, count = states[index], int(nodes.numel())
                if not count:
                    continue
                slots = torch.arange(offset, offset + count)
                state.ensure(tree.next_uid)
                state.columns[tree.uids[nodes]] = past + slots
                tokens[row, slots] = tree.tokens[nodes]
                positions[row, slots] = state.column + tree.depth[nodes]
                parents = tree.parents[nodes]
                parent_columns[row, slots] = torch.where(parents == 0, torch.tensor(state.column),
                                                         state.columns[tree.uids[parents]])
                if bool((parent_columns[row, slots] < 0).any()):
                    raise RuntimeError("the policy expanded a node whose parent the drafter never saw; only policies "
                                       "that grow trees from expanded nodes can run in lockstep.")
                visible[row, slots, : state.column + 1] = True
                anc = tree.ancestor_mask()[nodes][:, 1:]  # ancestors below the root (the root is in the prefix)
                i, j = anc.nonzero(as_tuple=True)
                visible[row, slots[i], state.columns[tree.uids[j + 1]]] = True
                offset += count
        device = features.device
        parent_features = features.gather(1, parent_columns.to(device)[..., None].expand(-1, -1, features.shape[-1]))
        mask = float_mask(visible.to(device), parent_features.dtype)[0, 0][:, None]
        out = drafter(input_ids=tokens.to(device), features=parent_features, attention_mask=mask,
                      position_ids=positions.to(device), cache=cache, use_cache=True)
        # KV columns past.. hold the new nodes; keep features aligned with KV columns (context columns first)
        if features.shape[1] != past:
            raise RuntimeError("drafter features out of step with the drafter cache columns")
        features = torch.cat([features, out.hidden_states], dim=1)
        values, ids = _top(drafter, out.logits, topk)
        for row, items in enumerate(per_row):
            offset = 0
            for index, tree, nodes in items:
                count = int(nodes.numel())
                blocks[index] = (values[row, offset:offset + count], ids[row, offset:offset + count])
                offset += count
    for index, tree, nodes in requests:
        is_root = nodes == 0
        answer_values = torch.empty(nodes.numel(), root_values.shape[-1])
        answer_ids = torch.empty(nodes.numel(), root_ids.shape[-1], dtype=torch.long)
        answer_values[is_root], answer_ids[is_root] = root_values[index], root_ids[index]
        if index in blocks:
            answer_values[~is_root], answer_ids[~is_root] = blocks[index]
        states[index].source.answers.append((answer_values, answer_ids))
    return features


# ---------------------------------------------------------------------------------------------- target scoring
@dataclass
class NodeAcceptance:
    """Per tree node (root: 1 / True): the target's probability of the node's token given its path, at the scoring
    temperature (``probs``; None at temperature 0), and whether the token is the target's argmax there (``greedy``)."""

    probs: torch.Tensor | None
    greedy: torch.Tensor

    def at(self, temperature: float) -> torch.Tensor:
        """The acceptance GTO scores: indicators at temperature 0, probabilities otherwise."""
        return self.greedy.float() if temperature == 0 or self.probs is None else self.probs


@torch.no_grad()
def score_trees(
    target,
    sequence_ids: torch.Tensor,
    lengths: torch.Tensor,
    trees: list[DraftTree],
    rows: torch.Tensor,
    positions: torch.Tensor,
    temperature: float = 1.0,
    chunk_tokens: int = 512,
) -> list[NodeAcceptance]:
    """Target acceptance of every node of ``trees`` (tree ``i`` is rooted at sequence position ``positions[i]`` of
    row ``rows[i]``; its root token is ``sequence_ids[row, position]``).

    One target forward over the prefix up to the last root, then forwards over the internal nodes of whole trees, at
    most ``chunk_tokens`` per row each (bounds the ``[rows, chunk, vocab]`` logits and the 4D mask).
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}.")
    device = next(target.parameters()).device
    prefix = int(positions.max()) + 1
    ids = sequence_ids[:, :prefix].to(device)
    attention = (torch.arange(prefix)[None, :] < lengths[:, None]).long().to(device)
    keep = torch.unique(positions)
    out = target(input_ids=ids, attention_mask=attention, use_cache=True, logits_to_keep=keep.to(device))
    cache = output_cache(out)
    if sliding_layers(cache):
        raise ValueError(f"GTO scores trees with target forwards over the prefix cache; {type(target).__name__}'s "
                         "sliding-window layers drop the rows those trees attend to, so sliding-window targets are "
                         "not supported by GTO.")
    where = torch.searchsorted(keep, positions)
    root_logits = out.logits[rows.to(device), where.to(device)]  # [P, V]
    results: list[NodeAcceptance | None] = [None] * len(trees)
    scores = [_Scores(tree) for tree in trees]
    for index, tree in enumerate(trees):
        scores[index].fill(tree.parents == 0, root_logits[index], None, tree, temperature)
    queues: list[list[int]] = [[] for _ in range(sequence_ids.shape[0])]
    for index, row in enumerate(rows.tolist()):
        if scores[index].internal.numel():
            queues[row].append(index)
    while any(queues):
        chunk: list[list[int]] = []
        for queue in queues:
            taken, used = [], 0
            while queue and (not taken or used + scores[queue[0]].internal.numel() <= chunk_tokens):
                used += scores[queue[0]].internal.numel()
                taken.append(queue.pop(0))
            chunk.append(taken)
        _forward_internal(target, cache, prefix, chunk, trees, scores, positions, temperature, device)
    for index, score in enumerate(scores):
        results[index] = score.result(temperature)
    return results


class _Scores:
    """Acceptance of one tree's nodes, filled parent by parent (root children from the prefix forward)."""

    def __init__(self, tree: DraftTree):
        n = tree.num_nodes
        self.internal = ((tree.num_children() > 0) & (torch.arange(n) > 0)).nonzero().squeeze(-1)
        self.probs = torch.ones(n)
        self.greedy = torch.ones(n, dtype=torch.bool)

    def fill(self, children: torch.Tensor, logits: torch.Tensor, parent_rows: torch.Tensor | None, tree: DraftTree,
             temperature: float) -> None:
        """``logits``: ``[V]`` (one parent) or ``[len(parents), V]`` with ``parent_rows`` mapping children to rows."""
        nodes = children.nonzero().squeeze(-1)
        if nodes.numel() == 0:
            return
        table = logits if logits.dim() == 2 else logits[None]
        which = parent_rows if parent_rows is not None else torch.zeros(nodes.numel(), dtype=torch.long)
        table = table.float()
        token = tree.tokens[nodes].to(table.device)
        rows = which.to(table.device)
        self.greedy[nodes] = (table.argmax(-1)[rows] == token).cpu()
        if temperature > 0:
            logz = torch.logsumexp(table / temperature, dim=-1)[rows]
            self.probs[nodes] = (table[rows, token] / temperature - logz).exp().cpu()

    def result(self, temperature: float) -> NodeAcceptance:
        return NodeAcceptance(self.probs if temperature > 0 else None, self.greedy)


def _forward_internal(target, cache, prefix, chunk, trees, scores, positions, temperature, device) -> None:
    batch = len(chunk)
    width = max(sum(int(scores[i].internal.numel()) for i in taken) for taken in chunk)
    tokens = torch.zeros(batch, width, dtype=torch.long)
    pos = torch.zeros(batch, width, dtype=torch.long)
    visible = torch.zeros(batch, width, prefix + width, dtype=torch.bool)
    visible[:, torch.arange(width), prefix + torch.arange(width)] = True
    placed: list[tuple[int, int, int]] = []  # (tree index, row, first slot)
    for row, taken in enumerate(chunk):
        offset = 0
        for index in taken:
            tree, internal = trees[index], scores[index].internal
            count = int(internal.numel())
            slots = torch.arange(offset, offset + count)
            tokens[row, slots] = tree.tokens[internal]
            pos[row, slots] = int(positions[index]) + tree.depth[internal]
            visible[row, slots, : int(positions[index]) + 1] = True
            # internal nodes' ancestors below the root are internal too: one block per tree
            visible[row, offset:offset + count, prefix + offset:prefix + offset + count] = \
                tree.ancestor_mask()[internal][:, internal]
            placed.append((index, row, offset))
            offset += count
    dtype = next(target.parameters()).dtype
    mask = float_mask(visible.to(device), dtype)[0, 0][:, None]
    out = target(input_ids=tokens.to(device), attention_mask=mask, position_ids=pos.to(device),
                 use_cache=True, **{CACHE_KWARG: cache})
    cache.crop(-width)
    for index, row, offset in placed:
        tree, score = trees[index], scores[index]
        slot_of = torch.full((tree.num_nodes,), -1, dtype=torch.long)
        slot_of[score.internal] = torch.arange(offset, offset + score.internal.numel())
        children = torch.zeros(tree.num_nodes, dtype=torch.bool)
        children[1:] = slot_of[tree.parents[1:]] >= 0
        nodes = children.nonzero().squeeze(-1)
        score.fill(children, out.logits[row], slot_of[tree.parents[nodes]], tree, temperature)
