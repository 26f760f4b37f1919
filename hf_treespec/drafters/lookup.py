"""Prompt-lookup drafting as a tree drafter: n-gram matches in the context propose the next tokens, for free.

transformers' prompt lookup decoding drafts one chain from the first match. Here every tree node looks up the
longest n-gram suffix of its own path in the context and proposes *all* continuations seen after it, weighted by
count, so a tree policy can verify several candidate continuations in one target forward. No model runs while
drafting, which is what matters on CPU where a drafter forward costs a sizeable fraction of a target forward.
"""

from __future__ import annotations

import torch

from ..tree import DraftTree
from .base import Drafter, TargetFeatures


class PromptLookupDrafter(Drafter):
    """Drafts from n-gram matches in the committed tokens (prompt + generated so far).

    ``config`` is the target's config: ``generate`` validates ``assistant_model.config`` (vocabulary size).
    """

    def __init__(self, config, max_ngram_size: int = 3, min_ngram_size: int = 1):
        if not 1 <= min_ngram_size <= max_ngram_size:
            raise ValueError(f"need 1 <= min_ngram_size <= max_ngram_size, got {min_ngram_size}, {max_ngram_size}")
        self.config = config
        self.max_ngram_size = max_ngram_size
        self.min_ngram_size = min_ngram_size
        self.context = torch.zeros(0, dtype=torch.long)

    @classmethod
    def accepts(cls, model) -> bool:
        return isinstance(model, cls)

    @property
    def vocab_size(self) -> int:
        return int(self.config.get_text_config().vocab_size)

    def start(self, prefix_ids: torch.Tensor, features: TargetFeatures | None = None) -> None:
        self.context = prefix_ids.long().cpu()

    def expand(self, tree: DraftTree, nodes: torch.Tensor) -> torch.Tensor:
        """Log-counts of the tokens that followed each node's longest matching suffix; -inf where none did."""
        nodes = nodes.cpu()
        haystack = torch.cat([self.context, tree.tokens[:1].cpu()])  # every committed token, root included
        n_max = self.max_ngram_size
        # each node's sequence, right-aligned: the last n_max context tokens + its path (root first)
        paths = tree.paths()[nodes].cpu()
        depth = tree.depth[nodes].cpu()
        pad = torch.full((n_max,), -1, dtype=torch.long)
        pad[n_max - min(n_max, self.context.numel()):] = self.context[-n_max:] if self.context.numel() else pad[:0]
        seqs = torch.cat([pad.expand(nodes.numel(), -1), paths], dim=1)
        end = n_max + depth + 1  # exclusive end of each node's sequence
        vocab = self.vocab_size
        keys = []  # row * vocab + proposed token, one per hit
        found = torch.zeros(nodes.numel(), dtype=torch.bool)
        for n in range(n_max, self.min_ngram_size - 1, -1):
            if haystack.numel() <= n:
                continue
            suffix = seqs.gather(1, end[:, None] - n + torch.arange(n))  # [m, n]
            windows = haystack.unfold(0, n, 1)[:-1]  # [W, n], each followed by haystack[n + i]
            hits = (suffix[:, None, :] == windows[None]).all(-1) & (suffix >= 0).all(-1, keepdim=True)
            rows = hits.any(-1) & ~found  # longest n-gram wins
            if not bool(rows.any()):
                continue
            hit_rows, hit_pos = (hits & rows[:, None]).nonzero(as_tuple=True)
            keys.append(hit_rows * vocab + haystack[hit_pos + n])
            found |= rows
        # log-counts written only where a token was seen: no full-vocabulary arithmetic on the hot path
        scores = torch.full((nodes.numel() * vocab,), float("-inf"))  # log 0: no proposal
        if keys:
            unique, counts = torch.cat(keys).unique(return_counts=True)
            scores[unique] = counts.float().log()
        return scores.view(nodes.numel(), vocab)

    def commit(self, tree: DraftTree, accepted: torch.Tensor, features: TargetFeatures | None = None) -> None:
        self.context = torch.cat([self.context, tree.tokens[accepted].cpu()])


def prompt_lookup(model, max_ngram_size: int = 3, min_ngram_size: int = 1) -> PromptLookupDrafter:
    """A prompt-lookup tree drafter for ``model`` (pass it as ``assistant_model=``)."""
    return PromptLookupDrafter(model.config, max_ngram_size=max_ngram_size, min_ngram_size=min_ngram_size)
