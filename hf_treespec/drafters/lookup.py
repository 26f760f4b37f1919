"""Prompt-lookup drafting as a tree drafter: n-gram matches in the context propose the next tokens, for free.

transformers' prompt lookup decoding drafts one chain from the first match. Here every tree node looks up the
longest n-gram suffix of its own path in the context and proposes *all* continuations seen after it, weighted by
count, so a tree policy can verify several candidate continuations in one target forward. No model runs while
drafting, which is what matters on CPU where a drafter forward costs a sizeable fraction of a target forward.

The context is indexed once, as it grows (`NgramIndex`: n-gram -> counts of the tokens that followed it), so a lookup
is a few hash probes per node rather than a scan of the whole context per call. On CPU a drafting step then costs
microseconds, where the tensor scan cost about half a millisecond per call, most of it per-op dispatch.
"""

from __future__ import annotations

from collections import Counter

import torch

from ..tree import DraftTree
from .base import Drafter, TargetFeatures


class NgramIndex:
    """Counts, for every n-gram of the indexed tokens (``min_n <= n <= max_n``), the tokens that followed it.

    Append-only: committed tokens never change, so each token is indexed once (``max_n - min_n + 1`` dict updates).
    """

    def __init__(self, max_n: int, min_n: int = 1):
        self.max_n = max_n
        self.min_n = min_n
        self.tokens: list[int] = []
        self.followers: dict[tuple[int, ...], Counter] = {}

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            end = len(self.tokens)
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self.followers.setdefault(tuple(self.tokens[end - n : end]), Counter())[token] += 1
            self.tokens.append(token)

    def continuations(self, suffix: list[int], next_token: int | None = None) -> Counter | None:
        """Counts of what followed the longest n-gram suffix of ``suffix`` that occurs (None when none does).

        ``next_token`` is a token known to follow the indexed tokens without being indexed yet (the step's root): it
        counts as one more occurrence after the n-grams that end the indexed tokens.
        """
        tail = self.tokens[-self.max_n :]
        for n in range(min(self.max_n, len(suffix)), self.min_n - 1, -1):
            key = tuple(suffix[-n:])
            seen = self.followers.get(key)
            if next_token is not None and len(tail) >= n and key == tuple(tail[-n:]):
                seen = Counter(seen or ())
                seen[next_token] += 1
            if seen:
                return seen
        return None


def _rank(item: tuple[int, int]) -> tuple[int, int]:
    """Sort key of a (token, count) continuation: most frequent first, ties to the lowest token id (as ``argmax``)."""
    return -item[1], item[0]


def _best(counts: Counter) -> tuple[int, int]:
    """(token, count) of the most frequent continuation."""
    return min(counts.items(), key=_rank)


class PromptLookupDrafter(Drafter):
    """Drafts from n-gram matches in the committed tokens (prompt + generated so far).

    ``config`` is the target's config: ``generate`` validates ``assistant_model.config`` (vocabulary size).
    """

    capabilities = frozenset({"greedy_chain", "topk_logprobs"})

    def __init__(self, config, max_ngram_size: int = 3, min_ngram_size: int = 1):
        if not 1 <= min_ngram_size <= max_ngram_size:
            raise ValueError(f"need 1 <= min_ngram_size <= max_ngram_size, got {min_ngram_size}, {max_ngram_size}")
        self.config = config
        self.max_ngram_size = max_ngram_size
        self.min_ngram_size = min_ngram_size
        self.index = NgramIndex(max_ngram_size, min_ngram_size)
        self._vocab_size = int(config.get_text_config().vocab_size)

    @classmethod
    def accepts(cls, model) -> bool:
        return isinstance(model, cls)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def context(self) -> torch.Tensor:
        """The committed tokens seen so far (prompt + accepted), ``[L]``."""
        return torch.tensor(self.index.tokens, dtype=torch.long)

    def start(self, prefix_ids: torch.Tensor, features: TargetFeatures | None = None) -> None:
        self.index = NgramIndex(self.max_ngram_size, self.min_ngram_size)
        self.index.extend(prefix_ids.tolist())

    def _suffixes(self, tree: DraftTree, nodes: list[int]) -> list[list[int]]:
        """The last ``max_ngram_size`` tokens of each node's sequence (context + its path, root included)."""
        tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
        n_max = self.max_ngram_size
        out = []
        for node in nodes:
            path = []
            while node >= 0 and len(path) < n_max:
                path.append(tokens[node])
                node = parents[node]
            path.reverse()
            if len(path) < n_max:
                path = self.index.tokens[len(path) - n_max :] + path
            out.append(path)
        return out

    def _proposals(self, tree: DraftTree, nodes: torch.Tensor) -> list[Counter | None]:
        """What followed each node's longest matching suffix in the context (the root counts as context)."""
        root = int(tree.tokens[0])
        return [self.index.continuations(suffix, next_token=root) for suffix in self._suffixes(tree, nodes.tolist())]

    def expand(self, tree: DraftTree, nodes: torch.Tensor) -> torch.Tensor:
        """Log-counts of the tokens that followed each node's longest matching suffix; -inf where none did."""
        rows, tokens, counts = [], [], []
        for row, seen in enumerate(self._proposals(tree, nodes)):
            if seen:
                rows += [row] * len(seen)
                tokens += list(seen)
                counts += list(seen.values())
        vocab = self.vocab_size
        # log-counts written only where a token was seen: no full-vocabulary arithmetic on the hot path
        scores = torch.full((nodes.numel() * vocab,), float("-inf"))  # log 0: no proposal
        if rows:
            keys = torch.tensor(rows) * vocab + torch.tensor(tokens)
            scores[keys] = torch.tensor(counts, dtype=torch.float32).log()
        return scores.view(nodes.numel(), vocab).to(tree.device)

    def topk_logprobs(self, tree: DraftTree, nodes: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``k`` most frequent continuations per node with log(count / total) (= log-softmax of ``expand``),
        best first (ties: lower token id), -inf padded; a few proposals per node, so no ``[m, V]`` row is built."""
        rows, cols, tokens, probs = [], [], [], []
        for row, seen in enumerate(self._proposals(tree, nodes)):
            if seen:
                total = sum(seen.values())
                for col, (token, count) in enumerate(sorted(seen.items(), key=_rank)[:k]):
                    rows.append(row), cols.append(col), tokens.append(token), probs.append(count / total)
        shape = (nodes.numel(), max(cols, default=-1) + 1)
        top_tokens = torch.zeros(shape, dtype=torch.long)
        top_probs = torch.zeros(shape)  # log 0 = -inf: padding
        if rows:
            where = (torch.tensor(rows), torch.tensor(cols))
            top_tokens[where] = torch.tensor(tokens)
            top_probs[where] = torch.tensor(probs)
        return top_probs.log().to(tree.device), top_tokens.to(tree.device)

    def greedy_chain(self, tree: DraftTree, node: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The chain that ``length`` rounds of ``expand`` + argmax would draft below ``node``, in one call.

        Returns ``(tokens, logprobs)`` (each token's log-softmax of the log-counts, i.e. log(count / total)); shorter
        than ``length`` where a node has no continuation.
        """
        root = int(tree.tokens[0])
        suffix = self._suffixes(tree, [node])[0]
        tokens, logprobs = [], []
        for _ in range(length):
            seen = self.index.continuations(suffix, next_token=root)
            if not seen:
                break
            token, count = _best(seen)
            tokens.append(token)
            logprobs.append(count / sum(seen.values()))
            suffix = suffix[1:] + [token] if len(suffix) >= self.max_ngram_size else suffix + [token]
        device = tree.device
        return (torch.tensor(tokens, dtype=torch.long, device=device),
                torch.tensor(logprobs, dtype=torch.float32, device=device).log())

    def commit(self, tree: DraftTree, accepted: torch.Tensor, features: TargetFeatures | None = None) -> None:
        self.index.extend(tree.tokens[accepted].tolist())


def prompt_lookup(model, max_ngram_size: int = 3, min_ngram_size: int = 1) -> PromptLookupDrafter:
    """A prompt-lookup tree drafter for ``model`` (pass it as ``assistant_model=``)."""
    return PromptLookupDrafter(model.config, max_ngram_size=max_ngram_size, min_ngram_size=min_ngram_size)
