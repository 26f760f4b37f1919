"""`FeatureDrafter`: drives a :class:`TreeSpecDrafterModel` (EAGLE-style feature drafter) inside tree speculation.

Drafter stream. Position t pairs token ``x_t`` with a feature: the target's hidden state at ``t - 1`` for committed
tokens, the drafter's own output feature at the parent for tree nodes; the tree root takes the target's hidden state of
the last committed token. The first prompt token has no predecessor, so the stream starts at the second one (EAGLE).

Bookkeeping per step (one DynamicCache laid out by :class:`~hf_treespec.kv.tree_kv.TreeKV`):

- ``expand`` feeds the pending committed chain (with true target features) and the requested nodes in ONE forward,
  tree attention from TreeKV's 4D mask; output features are stored per node *uid* so children find their parent's.
- ``commit`` keeps the root's row (it was fed with its true feature) and drops every other tree row: accepted drafts
  were fed with drafter features, so they are re-fed next step, as a causal chain in front of the next root, with the
  TRUE target features the verification forward produced (EAGLE's re-feed).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from ..attention import check_tree_attention
from ..kv.tree_kv import TreeKV, to_device
from ..compiled.preallocated import preallocate
from ..tree import DraftTree, host_longs
from ..kv.stacked import RowRequest, stack_rows, unstack_new_rows
from .base import DRAFTER_ADAPTERS, Drafter, TargetFeatures
from .feature import TreeSpecDrafterModel

#: rows a compiled drafter's cache holds beyond the prompt before it grows (doubling, eagerly, no recompile)
COMPILED_HEADROOM = 256


# "Auxiliary hidden states" is what EAGLE-3 servers call target features.
@DRAFTER_ADAPTERS.register("aux_hidden_states")
class FeatureDrafter(Drafter):
    """Tree drafting with a feature drafter; logits come back in the target vocabulary (-inf outside the draft's)."""

    #: a TreeSpecDrafterModel is also a causal LM with an LM head, which ``causal_lm`` (priority 0) would accept
    priority = 10

    def __init__(self, model: TreeSpecDrafterModel):
        if not model.is_attached:
            raise ValueError(
                "this TreeSpecDrafterModel shares the target's embeddings / LM head, which are not attached: call "
                "drafter.tie_to_target(model) before generate."
            )
        check_tree_attention(model, role="drafter")
        self.model = model
        self.target_layers = tuple(model.config.target_layers)
        self.kv: TreeKV | None = None
        # raw target features of kv.pending tokens, row-aligned, as the chunks commits added: joined only when a step
        # drafts, so a run of draft-free steps (auto sizing) never copies the growing chain
        self._pending_raw: list[torch.Tensor] = []
        self._pending_feature: torch.Tensor | None = None  # ... projected (`_project`)
        self._root_raw: torch.Tensor | None = None  # raw target feature paired with the next tree root
        self._root_feature: torch.Tensor | None = None  # ... projected
        self._node_features = torch.zeros(0)  # [uid capacity, hidden] drafter output feature per expanded node
        self._node_known: set[int] = set()  # uids holding an output feature (host bookkeeping)
        self._device, self._dtype = model.device, model.dtype
        self._compiled = None  # a CompiledDrafterForward when the target runs compiled (`use_compiled`)

    def use_compiled(self, settings, batch: int = 1) -> None:
        """The expansions run through the drafter's compiled forward, a batch's stacked rounds through its batch
        graphs (warmed up for ``batch`` rows): a step drafts with several forwards, each costing about as much in
        fixed overhead as its arithmetic."""
        from ..compiled import CompiledDrafterForward, compiled_forward_for

        compiled = compiled_forward_for(self.model, settings, CompiledDrafterForward)
        compiled.warm_up()
        if batch > 1:
            compiled.warm_up(batch)
        self._compiled = compiled if compiled.failure is None else None

    @property
    def draft_support(self) -> torch.Tensor | None:
        return self.model.draft_columns()

    @classmethod
    def accepts(cls, model) -> bool:
        return isinstance(model, TreeSpecDrafterModel)

    @classmethod
    def attach(cls, model: TreeSpecDrafterModel, target) -> None:
        """Checks that ``model`` was built for ``target`` (vocabulary, hidden size, layers it reads) and ties the
        target's embeddings / LM head when the checkpoint shares them, so ``assistant_model=drafter`` is enough."""
        text = target.config.get_text_config()
        config = model.config
        problems = []
        if int(config.vocab_size) != int(text.vocab_size):
            problems.append(f"vocabulary {config.vocab_size} tokens vs the target's {text.vocab_size}")
        if int(config.target_hidden_size) != int(text.hidden_size):
            problems.append(f"target_hidden_size {config.target_hidden_size} vs the target's hidden_size "
                            f"{text.hidden_size}")
        num_layers = int(text.num_hidden_layers)
        outside = [i for i in config.target_layers if not -num_layers <= i < num_layers]
        if outside:
            problems.append(f"target_layers {outside} outside the target's {num_layers} layers")
        if problems:
            raise ValueError(
                "this TreeSpecDrafterModel was not built for this target: " + "; ".join(problems) + ". Use the "
                "drafter trained for this target model (its config records the target's sizes)."
            )
        if not model.is_attached:
            model.tie_to_target(target)

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    # ----------------------------------------------------------------------------------------------- helpers
    def _raw_features(self, features: TargetFeatures | None, rows: int) -> torch.Tensor:
        states = None if features is None else features.hidden_states
        if states is None:
            raise ValueError(
                f"the feature drafter needs the target's hidden states at layers {list(self.target_layers)}; the "
                "generate loop captures them when drafter.target_layers is set. Pass TargetFeatures(hidden_states=...) "
                "when driving the drafter by hand."
            )
        if tuple(states.shape) != (rows, self.model.config.feature_size):
            raise ValueError(
                f"expected target hidden states of shape {(rows, self.model.config.feature_size)} (one row per "
                f"token, layers {list(self.target_layers)} concatenated), got {tuple(states.shape)}."
            )
        return states.to(self._device)

    def _set_root(self, raw: torch.Tensor) -> None:
        # projected only when the next step drafts: a draft-free step (auto sizing) never pays for it
        self._root_raw = raw
        self._root_feature: torch.Tensor | None = None

    def _add_pending(self, raw: torch.Tensor) -> None:
        self._pending_raw.append(raw)
        self._pending_feature = None

    @staticmethod
    def _project(drafters: list["FeatureDrafter"]) -> None:
        """Projects the target features the rows' next forward reads and nobody projected yet (each row's pending
        chain and root) in ONE call of the drafter's projection: an eager call cost 0.13 ms for one row and 0.14 ms
        for four (SmolLM2-135M's drafter, bf16, 2-core EPYC), and a batch's first round used to make two per row."""
        parts, owners = [], []
        for drafter in drafters:
            if drafter._pending_raw and drafter._pending_feature is None:  # joined once, only when unprojected
                chain = torch.cat(drafter._pending_raw)
                if len(chain):
                    parts.append(chain)
                    owners.append((drafter, True))
            if drafter._root_feature is None:
                parts.append(drafter._root_raw[None])
                owners.append((drafter, False))
        if not parts:
            return
        first = drafters[0]
        linears = None if first._compiled is None else first._compiled.linears
        projected = first.model.project_features(torch.cat(parts), None if linears is None else linears.eager)
        projected = projected.split([len(part) for part in parts])
        for (drafter, pending), rows in zip(owners, projected):
            if pending:
                drafter._pending_feature = rows
            else:
                drafter._root_feature = rows[0]

    def _reset_nodes(self) -> None:
        # which uids hold an output feature: host bookkeeping, so checking a parent never waits for the device
        self._node_known = set()

    def _ensure_capacity(self, num_uids: int) -> None:
        have = self._node_features.shape[0]
        if have >= num_uids:
            return
        size = max(num_uids, 2 * have, 64)
        grown = torch.zeros(size, self.model.config.hidden_size, dtype=self._dtype, device=self._device)
        grown[:have] = self._node_features
        self._node_features = grown

    def _started(self) -> TreeKV:
        if self.kv is None:
            raise RuntimeError("FeatureDrafter.start(prefix_ids, features) must run before expand / commit.")
        return self.kv

    # ------------------------------------------------------------------------------------------- life cycle
    @torch.no_grad()
    def start(self, prefix_ids: torch.Tensor, features: TargetFeatures | None = None) -> None:
        self._device, self._dtype = self.model.device, self.model.dtype  # read once per generation (cheap after)
        raw = self._raw_features(features, int(prefix_ids.numel()))
        self.kv = TreeKV(DynamicCache(config=self.model.config))
        if self._compiled is not None:
            preallocate(self.kv.cache, int(prefix_ids.numel()) + COMPILED_HEADROOM)
        self.kv.pending = prefix_ids[1:].long().cpu()
        self._pending_raw, self._pending_feature = [raw[:-1]], None
        self._set_root(raw[-1])
        self._node_features = torch.zeros(0, self.model.config.hidden_size, dtype=self._dtype, device=self._device)
        self._reset_nodes()

    @torch.no_grad()
    def expand(self, tree: DraftTree, nodes: torch.Tensor) -> torch.Tensor:
        kv = self._started()
        nodes = nodes.cpu()
        num_pending, num_nodes = int(kv.pending.numel()), int(nodes.numel())
        # one host-to-device copy for the forward's inputs and the feature-table indices
        host = self._node_indices(tree, nodes)
        ids, positions, mask, *indices = kv.inputs_for(tree, nodes, self._dtype, device=self._device, extra=host)
        features = self._input_features(*indices[:2], int(host[0].sum()))[None]
        if self._compiled is not None:  # every row's logits (a fixed logits_to_keep would be a graph per count)
            logits, hidden = self._compiled(ids, positions, mask, kv.cache, features=features)
            logits = logits[:, num_pending:]
        else:
            out = self.model(input_ids=ids, features=features, position_ids=positions, attention_mask=mask,
                             cache=kv.cache, use_cache=True, logits_to_keep=num_nodes)
            logits, hidden = out.logits, out.hidden_states
        self._fed(tree, nodes, indices[2], hidden[0, num_pending:])
        return self.model.target_logits(logits[0].float())

    batches_rows = True

    @classmethod
    @torch.no_grad()
    def expand_rows(cls, requests: list[tuple["FeatureDrafter", DraftTree, torch.Tensor]]) -> list[torch.Tensor]:
        """Every row's nodes in ONE forward over the rows' stacked caches (`hf_treespec.kv.stacked`); each row's
        input features (its pending chain's target features, its nodes' parents' outputs) are its own."""
        if len(requests) == 1:
            return super().expand_rows(requests)
        first = requests[0][0]
        requests = [(drafter, tree, nodes.cpu()) for drafter, tree, nodes in requests]
        rows, features, node_uids = [], [], []
        cls._project([drafter for drafter, _, _ in requests])
        for drafter, tree, nodes in requests:
            drafter._started()
            host = drafter._node_indices(tree, nodes)
            is_root, parent_uids, uids = to_device(first._device, *host)
            roots = int(host[0].sum())  # counted on the host copy: no read of the device flags
            rows.append(RowRequest(drafter.kv, *drafter.kv.host_inputs(tree, nodes)))
            features.append(drafter._input_features(is_root, parent_uids, roots))
            node_uids.append(uids)
        stacked = stack_rows(rows, first._dtype, first._device,
                             None if first._compiled is None else first._stacked_cache)
        width = stacked.width
        joined = features[0].new_zeros(len(rows), width, features[0].shape[-1])
        for row, row_features in enumerate(features):
            joined[row, width - row_features.shape[0] :] = row_features
        counts = [int(nodes.numel()) for _, _, nodes in requests]
        if first._compiled is not None:  # the rows' round through the drafter's batch graphs, every row's logits
            logits, hidden = first._compiled(stacked.ids, stacked.positions, stacked.mask, stacked.cache,
                                             features=joined)
        else:
            out = first.model(input_ids=stacked.ids, features=joined, position_ids=stacked.positions,
                              attention_mask=stacked.mask, cache=stacked.cache, use_cache=True,
                              logits_to_keep=max(counts))
            logits, hidden = out.logits, out.hidden_states
        unstack_new_rows(stacked, [drafter.kv.cache for drafter, _, _ in requests])
        logits = logits.float()
        results = []
        for row, ((drafter, tree, nodes), count) in enumerate(zip(requests, counts)):
            drafter._fed(tree, nodes, node_uids[row], hidden[row, width - count :])
            results.append(drafter.model.target_logits(logits[row, logits.shape[1] - count :]))
        return results

    def _stacked_cache(self, rows: int) -> DynamicCache:
        """An empty cache for a stacked round of ``rows`` through the compiled drafter (a free row kept)."""
        cache = DynamicCache(config=self.model.config)
        preallocate(cache, rows + 1)
        return cache

    def _node_indices(self, tree: DraftTree, nodes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Host ``(is_root, parent uids, node uids)`` of ``nodes``, after checking that every parent was expanded
        (its output feature is the node's input) and marking the nodes as expanded."""
        parents, uids, listed = tree.parents.tolist(), tree.uids.tolist(), nodes.tolist()
        is_root = [parents[node] < 0 for node in listed]
        parent_uids = [0 if root else uids[parents[node]] for node, root in zip(listed, is_root)]
        node_uids = [uids[node] for node in listed]
        self._ensure_capacity(tree.next_uid)
        known = self._node_known
        if not all(root or uid in known for root, uid in zip(is_root, parent_uids)):
            raise RuntimeError("expand: every node's parent must have been expanded earlier (its output feature is "
                               "the node's input).")
        known.update(node_uids)
        return torch.tensor(is_root, dtype=torch.bool), host_longs(parent_uids), host_longs(node_uids)

    def _input_features(self, is_root: torch.Tensor, parent_uids: torch.Tensor, roots: int) -> torch.Tensor:
        """``[pending + nodes, hidden]`` input features on the device: the pending chain's projected target
        features, then each node's parent output (the root's: its target feature); projected by `_project`.
        ``roots``: how many of the nodes are the root (a host count: no read of the device indices)."""
        self._project([self])
        if roots == is_root.numel() == 1:  # the root alone (a round's usual first request): no gather
            node_features = self._root_feature[None]
        elif roots == 0:
            node_features = self._node_features.index_select(0, parent_uids)
        else:
            node_features = torch.where(is_root[:, None], self._root_feature, self._node_features[parent_uids])
        if not self.kv.pending.numel():
            return node_features
        return torch.cat([self._pending_feature, node_features])

    def _fed(self, tree: DraftTree, nodes: torch.Tensor, node_uids: torch.Tensor, outputs: torch.Tensor) -> None:
        """Records the forward that fed the pending chain and ``nodes`` (their output features ``outputs``)."""
        self.kv.fed(tree, nodes)
        self._pending_raw, self._pending_feature = [], None
        self._node_features[node_uids] = outputs

    @torch.no_grad()
    def commit(self, tree: DraftTree, accepted: torch.Tensor, features: TargetFeatures | None = None) -> None:
        kv = self._started()
        raw = self._raw_features(features, int(accepted.numel()))
        expanded = not kv.holds_no_tree_rows  # nodes were fed this step (a draft-free step feeds none)
        pending_before = int(kv.pending.numel())
        kv.commit(tree, accepted[:1])  # keeps the root's row when it was fed: its input feature was the true one
        if int(kv.pending.numel()) > pending_before:  # root never fed: it joins the pending chain
            self._add_pending(self._root_raw[None])
        if accepted.numel() > 1:  # accepted[i + 1] pairs with the target state at accepted[i]
            kv.pending = torch.cat([kv.pending, tree.tokens[accepted[1:].cpu()]])
            self._add_pending(raw[:-1])
        self._set_root(raw[-1])
        if expanded:  # their output features are forgotten (none is known after a draft-free step)
            self._reset_nodes()
