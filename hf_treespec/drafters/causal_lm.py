"""Classic small-model drafting: any causal LM sharing the target's vocabulary, with its own KV cache."""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel

from ..attention import check_tree_attention
from ..kv.tree_kv import TreeKV
from ..compat import CACHE_KWARG
from ..kv.stacked import RowRequest, stack_rows, unstack_new_rows
from ..tree import DraftTree
from ..kv.window import TreeWindows, prepare, tree_inputs
from .base import DRAFTER_ADAPTERS, Drafter, TargetFeatures


@DRAFTER_ADAPTERS.register("causal_lm")
class CausalLMDrafter(Drafter):
    """Feeds tree nodes through the assistant with tree attention; every node expanded in one call is one forward.

    The generic adapter (priority 0): any ``PreTrainedModel`` with an LM head; narrower adapters rank above it."""

    def __init__(self, model: PreTrainedModel):
        check_tree_attention(model, role="drafter")
        self.model = model
        self.kv: TreeKV | None = None
        self.windows: TreeWindows | None = None

    @classmethod
    def accepts(cls, model) -> bool:
        return isinstance(model, PreTrainedModel) and hasattr(model, "get_output_embeddings") and \
            model.get_output_embeddings() is not None

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.get_text_config().vocab_size)

    @property
    def _dtype(self) -> torch.dtype:
        return self.model.dtype

    @torch.no_grad()
    def start(self, prefix_ids, features: TargetFeatures | None = None) -> None:
        cache = DynamicCache(config=self.model.config)
        self.windows = prepare(self.model, cache, role="drafter")  # sliding layers full-length, window in the mask
        self.kv = TreeKV(cache)
        self.kv.pending = prefix_ids.long().cpu()

    @torch.no_grad()
    def expand(self, tree: DraftTree, nodes: torch.Tensor) -> torch.Tensor:
        ids, positions, mask = tree_inputs(self.kv, tree, nodes, self._dtype, self.model.device, self.windows)
        num_nodes = int(nodes.numel())
        out = self.model(
            input_ids=ids,
            position_ids=positions,
            attention_mask=mask,
            **{CACHE_KWARG: self.kv.cache},
            use_cache=True,
            logits_to_keep=num_nodes,
        )
        self.kv.fed(tree, nodes)
        return out.logits[0, -num_nodes:].float()

    batches_rows = True

    @classmethod
    @torch.no_grad()
    def expand_rows(cls, requests: list[tuple["CausalLMDrafter", DraftTree, torch.Tensor]]) -> list[torch.Tensor]:
        """Every row's nodes in ONE forward over the rows' stacked caches (`hf_treespec.kv.stacked`). A drafter with
        sliding-window layers expands row by row (its windows live in each row's own mask)."""
        if len(requests) == 1 or any(drafter.windows is not None for drafter, _, _ in requests):
            return super().expand_rows(requests)
        model = requests[0][0].model
        stacked = stack_rows([RowRequest(d.kv, *d.kv.host_inputs(tree, nodes)) for d, tree, nodes in requests],
                             model.dtype, model.device)
        counts = [int(nodes.numel()) for _, _, nodes in requests]
        out = model(input_ids=stacked.ids, position_ids=stacked.positions, attention_mask=stacked.mask,
                    **{CACHE_KWARG: stacked.cache}, use_cache=True, logits_to_keep=max(counts))
        unstack_new_rows(stacked, [d.kv.cache for d, _, _ in requests])
        logits = out.logits.float()
        for drafter, tree, nodes in requests:
            drafter.kv.fed(tree, nodes)
        return [logits[row, logits.shape[1] - count :] for row, count in enumerate(counts)]

    def commit(self, tree, accepted, features=None) -> None:
        self.kv.commit(tree, accepted)
