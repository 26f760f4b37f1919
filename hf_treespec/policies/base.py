"""Tree policy interface: how a draft tree is grown. Policies see draft answers and the tree, never a verifier.

Every policy implements ONE method, a generator the decoding loop drives once per step::

    def grow(self, root_token: int, *, context: StepContext, capabilities: frozenset[str] = frozenset(),
             generator: Randomness = None) -> Growth:
        tree = DraftTree.root(root_token)
        logq = yield LogprobsRequest(tree, nodes)      # one draft forward: [len(nodes), V] warped log q
        ...
        return Draft(tree, shape)                      # the tree, and the (k, l) an auto-sized sampled policy chose

Growth yields typed requests (`LogprobsRequest`; the fast paths `GreedyChainRequest` / `TopkRequest` when
``capabilities`` declares them, through the helpers `draft_greedy_chain` / `topk_children` / `sibling_sequence`,
used as ``tree = yield from draft_greedy_chain(...)``) and receives their answers. The loop answers one request per
row of a batch with one batched drafter forward (`hf_treespec.generation.drafting.draft_trees`); `TreePolicy.build`
answers them from one `DraftSource` (tests, trainers, a policy driven by hand). A policy may also override two
hooks the loop calls around growth: ``setup(DecodingSetup)`` once per generate call and ``observe(StepOutcome)``
after every verified step (transformers' ``update_candidate_strategy``). Sizing is not the policy's: with
``tree_budget="auto"`` the loop decides whether a step drafts at all and hands the policy the step's `StepBudget`
in ``context.budget`` (`hf_treespec.budget.step_budget` reads it).

* ``context`` (`StepContext`) is filled by the loop every step: ``device``, ``root_token``, ``context_length``,
  ``temperature`` / ``top_p`` and the target's warped probabilities at the root's parent. Facts that cost something
  (the target's hidden state: a hook; latencies: device syncs) are gathered only when the policy lists them in its
  ``context_needs`` (``frozenset({"target_hidden"})``, say). The loop never names a policy.
* ``generator``: pass it to every random draw (`hf_treespec.randomness`) so the exact-enumeration tests can drive
  the policy; deterministic policies ignore it.
* Build trees with ``DraftTree.root(root_token, regime=...)`` and the tree's ``add_*`` / ``select`` methods. The
  tree's structure is host bookkeeping (CPU tensors): ``add_children`` accepts the draft answers' device tensors and
  copies them over once per call, so index the tree with host tensors and keep per-node Python loops off the hot
  path. ``context.device`` is where the models run (for a policy that makes device tensors of its own).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ..budget import check_budget, is_auto
from ..registry import Registry
from ..step_context import CONTEXT_NEEDS, DecodingSetup, StepContext, StepOutcome
from ..randomness import Randomness, support_columns, without_replacement
from ..tree import DraftTree, Regime, to_host

if TYPE_CHECKING:
    from ..drafters.base import Drafter

POLICIES: Registry["TreePolicy"] = Registry("tree policy", plural="tree policies")


class DraftSource(ABC):
    """What answers a policy's draft requests for one row: warped log-probabilities of the children of some nodes,
    in one forward (`LogprobsRequest`).

    ``capabilities`` declares the fast paths a source offers (a subset of ``{"greedy_chain", "topk_logprobs"}``);
    policies request a fast path only when it is declared, through `draft_greedy_chain` / `topk_children`, which fall
    back to ``logprobs`` otherwise and give the same tree either way:

    * ``greedy_chain(tree, node, length) -> (tokens, logprobs)``: the chain of draft argmaxes below ``node``;
    * ``topk_logprobs(tree, nodes, k) -> (values, tokens)``: each node's best children, without ``[m, V]`` rows.
    """

    capabilities: frozenset[str] = frozenset()
    #: sorted token ids outside which every q of this source is zero, or None (`SupportRequest`)
    support: torch.Tensor | None = None

    @abstractmethod
    def logprobs(self, tree: DraftTree, nodes: torch.Tensor) -> torch.Tensor:
        """``[len(nodes), V]`` log q(. | node) after the same logits processors as the target's."""

    def greedy_chain(self, tree: DraftTree, node: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError(f"{type(self).__name__} does not declare the 'greedy_chain' capability")

    def topk_logprobs(self, tree: DraftTree, nodes: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError(f"{type(self).__name__} does not declare the 'topk_logprobs' capability")


@dataclass(frozen=True)
class LogprobsRequest:
    """One draft forward: ``[len(nodes), V]`` log q(. | node) after the target's logits processors. The only request
    the loop batches across rows."""

    tree: DraftTree
    nodes: torch.Tensor

    def answer(self, source: DraftSource) -> torch.Tensor:
        return source.logprobs(self.tree, self.nodes)


@dataclass(frozen=True)
class GreedyChainRequest:
    """Fast path ``"greedy_chain"``: ``(tokens, logprobs)`` of the draft argmax chain below ``node``."""

    tree: DraftTree
    node: int
    length: int

    def answer(self, source: DraftSource) -> tuple[torch.Tensor, torch.Tensor]:
        return source.greedy_chain(self.tree, self.node, self.length)


@dataclass(frozen=True)
class TopkRequest:
    """Fast path ``"topk_logprobs"``: ``(values, tokens)`` of each node's ``k`` best children."""

    tree: DraftTree
    nodes: torch.Tensor
    k: int

    def answer(self, source: DraftSource) -> tuple[torch.Tensor, torch.Tensor]:
        return source.topk_logprobs(self.tree, self.nodes, self.k)


@dataclass(frozen=True)
class Support:
    """The answer to a `SupportRequest`: ``columns`` (sorted token ids outside which every q of the source is zero)
    or None. A request's answer is never None itself: None means "wait for the round" to `grow_in_rounds`."""

    columns: torch.Tensor | None


@dataclass(frozen=True)
class SupportRequest:
    """The columns q can be positive on (`DraftSource.support`), answered at once (no forward): draws and their
    verification then pass over those columns, not the vocabulary (a drafter with a reduced vocabulary)."""

    def answer(self, source: DraftSource) -> Support:
        return Support(source.support)


@dataclass
class Draft:
    """What a policy's growth returns: the tree, and the ``(k, l)`` shape an auto-sized sampled policy chose for it
    (None otherwise). The shape comes back to ``observe`` in `StepOutcome.shapes`, so the acceptance of that shape is
    learned."""

    tree: DraftTree
    shape: tuple[int, int] | None = None


#: a policy's tree growth: yields draft requests (``answer(source)`` answers one), receives their answers, returns
#: the `Draft`
Growth = Generator[Any, Any, Draft]


def answer_from(source: DraftSource, growth: Generator) -> Any:
    """Runs ``growth`` to the end, answering each of its requests from ``source`` (one row, no batching); returns
    what it returns (a policy's `Draft`; a helper's own result, e.g. `topk_children`'s)."""
    answer = None
    try:
        while True:
            answer = growth.send(answer).answer(source)
    except StopIteration as done:
        return done.value
    finally:
        growth.close()


def grow_in_rounds(growths: list[Growth], answer_round: Callable[[list[int], list[Any]], list[Any]],
                   answer_alone: Callable[[int, Any], Any] | None = None) -> list[Draft]:
    """Runs several growths side by side, their requests answered together round by round; returns each `Draft`.

    A round advances every growth still running, in order (so random draws and Python state change in the same order
    on every run), to its next request that ``answer_alone(index, request)`` does not answer on the spot (None: it
    waits for the round; without ``answer_alone`` every request waits), then ``answer_round(indices, requests)``
    answers the waiting ones together (one batched forward), one answer per request. A growth that returns leaves
    the later rounds; growths left parked in a request when an answer raises are closed.
    """
    drafts: list[Draft | None] = [None] * len(growths)
    answers: list[Any] = [None] * len(growths)  # what each growth's next `send` delivers
    running = list(range(len(growths)))
    try:
        while running:
            waiting, requests = [], []
            for index in running:
                answer = answers[index]
                while True:
                    try:
                        request = growths[index].send(answer)
                    except StopIteration as done:
                        drafts[index] = done.value
                        break
                    answer = None if answer_alone is None else answer_alone(index, request)
                    if answer is None:
                        waiting.append(index)
                        requests.append(request)
                        break
            running = waiting
            if requests:
                for index, answer in zip(waiting, answer_round(waiting, requests)):
                    answers[index] = answer
    finally:
        for growth in growths:
            growth.close()
    return drafts


class TreePolicy(ABC):
    """Grows a `DraftTree` from a root token.

    ``defaults`` lists the generate kwargs the policy reads (``tree_budget``, ``tree_depth`` ...) with the values of its
    paper; the generation config overrides them. ``regime`` says how children are made (which verifiers stay
    lossless); ``default_verifier`` is used when sampling and the user named none.
    """

    defaults: ClassVar[dict[str, Any]] = {}
    regime: ClassVar[str] = Regime.DETERMINISTIC
    default_verifier: ClassVar[str] = "nss"
    name: ClassVar[str] = ""
    #: optional `StepContext` facts this policy reads (names from `CONTEXT_NEEDS`); the loop gathers only these
    context_needs: frozenset[str] = frozenset()
    #: True for policies whose growth reads a `StepBudget` (``tree_budget="auto"``)
    supports_auto: ClassVar[bool] = False

    def __init__(self, do_sample: bool = False, **params: Any):
        self.do_sample = do_sample
        unknown = set(params) - set(self.defaults)
        if unknown:
            raise TypeError(f"tree_policy={self.name!r} does not take {sorted(unknown)}")
        self.params = {**self.defaults, **{k: v for k, v in params.items() if v is not None}}
        self.validate()
        unknown_needs = set(self.context_needs) - CONTEXT_NEEDS
        if unknown_needs:
            raise TypeError(f"{type(self).__name__}.context_needs names {sorted(unknown_needs)}; the decoding loop "
                            f"can gather {sorted(CONTEXT_NEEDS)}.")

    #: kwargs the policy takes only with the value "auto" (the sampled policies' tree_budget)
    auto_only: ClassVar[frozenset[str]] = frozenset()

    @classmethod
    def takes(cls, key: str, value: Any = "auto") -> bool:
        """Whether ``key=value`` is a kwarg this policy reads (benchmark group overrides and sweeps ask)."""
        return key in cls.defaults and (key not in cls.auto_only or is_auto(value))

    @classmethod
    def defaults_from_drafter(cls, drafter: "Drafter") -> dict[str, Any]:
        """Values for generate kwargs the user left unset that come with the assistant model (a policy component
        trained for that drafter, say); generate kwargs always win. None by default."""
        return {}

    def validate(self) -> None:
        budget = self.params.get("tree_budget")
        if budget is not None:
            if is_auto(budget) and not self.supports_auto:
                raise ValueError(
                    f"tree_policy={self.name!r} does not size its tree by measured cost; tree_budget='auto' works "
                    "with the best-first policies (salf, optimal, eagle2). Give a number."
                )
            check_budget(budget)
        for key in sorted(self.auto_only):
            value = self.params.get(key)
            if value is not None and not is_auto(value):
                raise ValueError(
                    f"tree_policy={self.name!r} takes only 'auto' as {key} (its shape is then chosen per step by "
                    f"measured cost); its size comes from its other kwargs ({sorted(set(self.defaults) - {key})}), "
                    f"got {key}={value!r}."
                )
        depth = self.params.get("tree_depth")
        if depth is not None and int(depth) < 1:
            raise ValueError(f"tree_depth must be >= 1, got {depth}.")
        topk = self.params.get("tree_topk")
        if topk is not None and int(topk) < 1:
            raise ValueError(f"tree_topk must be >= 1, got {topk}.")

    # ---------------------------------------------------------------------------------------------- loop hooks
    def setup(self, setup: DecodingSetup) -> None:
        """Called once per generate call before the first step (state a policy keeps across a call). Default: none."""

    def observe(self, outcome: StepOutcome) -> None:
        """Feedback after every verified step (what was drafted, what was accepted). Default: none."""

    @property
    def is_chain(self) -> bool:
        """Whether every tree this policy builds is a single path (for chain-only verifiers)."""
        return False

    def regime_for(self) -> str:
        return self.regime

    @abstractmethod
    def grow(
        self, root_token: int, *, context: StepContext, capabilities: frozenset[str] = frozenset(),
        generator: Randomness = None,
    ) -> Growth:
        """Grows the tree for one decoding step: a generator that yields draft requests, receives their answers and
        returns the `Draft`.

        Args:
            root_token: the step's root (the last committed token; ``context.root_token`` too).
            context: what the loop knows at the root (`StepContext`): device, context length, sampling settings,
                plus whatever ``context_needs`` asked for (the target's probabilities at the root's parent, ...).
            capabilities: the fast paths the answering side offers (``DraftSource.capabilities``); the helpers
                `draft_greedy_chain` / `topk_children` yield a fast-path request only when it is declared.
            generator: where random draws come from (torch's global RNG when None; a ``RandomSource`` in the
                exact-enumeration tests). Deterministic policies ignore it.
        """

    def draft(self, source: DraftSource, root_token: int, *, context: StepContext,
              generator: Randomness = None) -> Draft:
        """`grow` answered from one `DraftSource`: the tree and the shape it chose."""
        growth = self.grow(root_token, context=context, capabilities=source.capabilities, generator=generator)
        return answer_from(source, growth)

    def build(self, source: DraftSource, root_token: int, *, context: StepContext,
              generator: Randomness = None) -> DraftTree:
        """The tree `grow` builds with its requests answered from ``source`` (one row; outside the loop:
        ``policy.build(source, root, context=StepContext(root))``)."""
        return self.draft(source, root_token, context=context, generator=generator).tree


def draft_greedy_chain(tree: DraftTree, node: int, length: int,
                       capabilities: frozenset[str]) -> Generator[Any, Any, DraftTree]:
    """Hangs below ``node`` the chain of draft argmaxes, up to ``length`` tokens, stopping where q has no support;
    returns the tree (``tree = yield from draft_greedy_chain(...)``).

    A source that declares ``greedy_chain`` (prompt lookup without logits processors) proposes the whole chain in one
    request; any other is asked depth by depth. Both give the same tree.
    """
    if "greedy_chain" in capabilities:
        return tree.add_path(node, *(yield GreedyChainRequest(tree, node, length)))
    current = torch.tensor([node], device=tree.device)
    for _ in range(length):
        # argmax (first on ties), ~3x faster on CPU; both to the host in one copy, where the check reads them
        logq, token = to_host(*(yield LogprobsRequest(tree, current)).max(dim=-1))
        if not bool(torch.isfinite(logq).all()):  # the drafter has no proposal here
            break
        tree = tree.add_children(current, token, logq)
        current = torch.tensor([tree.num_nodes - 1], device=tree.device)
    return tree


def topk_children(tree: DraftTree, nodes: torch.Tensor, k: int,
                  capabilities: frozenset[str]) -> Generator[Any, Any, tuple[torch.Tensor, torch.Tensor]]:
    """Returns ``(values, tokens)`` ``[len(nodes), <= k]``: each node's ``k`` most likely children under q, best
    first, -inf where q has fewer tokens (`DraftTree.add_children` drops those). Sparse when ``topk_logprobs`` is
    declared."""
    if "topk_logprobs" in capabilities:
        return (yield TopkRequest(tree, nodes, k))
    logq = yield LogprobsRequest(tree, nodes)
    return logq.topk(min(k, logq.shape[-1]), dim=-1)


def sibling_sequence(
    tree: DraftTree, nodes: torch.Tensor, count: int, do_sample: bool, capabilities: frozenset[str],
    generator: Randomness = None,
) -> Generator[Any, Any, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]]:
    """Returns each node's first ``count`` children ``(tokens, log q)`` ``[len(nodes), <= count]`` in sibling order,
    -inf past q's support, the rows of q they came from and the source's `Support` columns (for
    `DraftTree.record_draft_probs`): sampled without replacement when ``do_sample`` (the order of a
    sampling-without-replacement sequence, which the SWOR verifier tests), the draft's top ranks otherwise (no q to
    record). Shared by the policies of the without-replacement regime (DySpec, Sequoia's static trees)."""
    if not do_sample:
        values, tokens = yield from topk_children(tree, nodes, count, capabilities)
        return tokens, values, None, None
    logq = yield LogprobsRequest(tree, nodes)
    support = (yield SupportRequest()).columns
    probs = exp_on(logq, support)
    # q's positive columns (top-k leaves 50 of a draft vocabulary's 8192), found once for the draws and the walk
    support = support_columns(probs, support)
    tokens, valid = without_replacement(probs, count, generator, support)
    values = logq.gather(1, tokens).masked_fill(~valid, float("-inf"))
    return tokens, values, probs, support


def exp_on(logq: torch.Tensor, support: torch.Tensor | None) -> torch.Tensor:
    """``logq.exp()``, computed on the ``support`` columns only where the rest is -inf (zeros there): an exp over
    SmolLM2's 49152 columns, mostly -inf, cost 0.07 ms a row against the draft vocabulary's 8192 (2-core EPYC)."""
    if support is None:
        return logq.exp()
    return logq.new_zeros(logq.shape).index_copy_(-1, support, logq.index_select(-1, support).exp_())
