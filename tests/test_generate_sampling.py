"""Sampling through generate preserves the target distribution (Monte-Carlo with a chi-square test).

Exact per-verifier proofs on toy tables live in test_verifiers_lossless.py; this checks the whole pipeline
(warping per node, tree forward, cache commit) on a tiny model: the joint law of the first three new tokens (the first
comes from the prefill, the next two from a tree step, so an accepted draft and its bonus token are both covered),
enumerated exactly from the target, against N generate runs. A correct sampler fails with probability 1e-3 per case.
"""

import pytest
import torch
from scipy.stats import chi2

from conftest import assert_drafted, fixed_budget

PROMPT = torch.tensor([[3, 17, 42, 8, 8, 21]])
WARP = dict(do_sample=True, temperature=1.2, top_k=3)


#: sampling with no logits processor at all (``top_k=0``: generate's default top-k of 50 would add one)
UNWARPED = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)


@torch.no_grad()
def exact_law(model, prefix: torch.Tensor = PROMPT, length: int = 3, warped: bool = True
              ) -> dict[tuple[int, ...], float]:
    """The law of the next ``length`` tokens: under `WARP` (``warped``), else under `UNWARPED`. One batched forward
    per position over every continuation of nonzero probability so far (4096 of them at the third unwarped token)."""
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper

    warp = LogitsProcessorList([TemperatureLogitsWarper(1.2), TopKLogitsWarper(3)] if warped else [])
    paths, probs = prefix.new_zeros(1, 0), torch.ones(1, dtype=torch.float64)
    with torch.no_grad():
        for _ in range(length):
            inputs = torch.cat([prefix.expand(paths.shape[0], -1), paths], 1)
            step = warp(inputs, model(inputs).logits[:, -1]).softmax(-1)
            row, token = step.nonzero(as_tuple=True)
            probs = probs[row] * step[row, token].double()
            paths = torch.cat([paths[row], token[:, None]], 1)
    return dict(zip(map(tuple, paths.tolist()), probs.tolist()))


def chi_square_pvalue(counts: dict, law: dict, n: int) -> float:
    """Pearson chi-square over cells with expected count >= 5; the rest pooled into one cell."""
    stat, dof, rest_obs, rest_exp = 0.0, -1, 0, 0.0
    for cell, prob in law.items():
        exp, obs = prob * n, counts.get(cell, 0)
        if exp >= 5:
            stat += (obs - exp) ** 2 / exp
            dof += 1
        else:
            rest_obs, rest_exp = rest_obs + obs, rest_exp + exp
    if rest_exp > 0:
        stat += (rest_obs - rest_exp) ** 2 / rest_exp
        dof += 1
    assert sum(counts.values()) == n and set(counts) <= set(law), "sampled a pair of probability zero"
    return float(chi2.sf(stat, dof))


def binned_pvalue(counts: dict, law: dict, n: int, bins: int = 12) -> float:
    """Pearson chi-square over ``bins`` groups of outcomes of about equal mass, grouped by their probability (a
    partition fixed by the law alone): for a law spread over too many outcomes for `chi_square_pvalue`'s cells."""
    assert sum(counts.values()) == n and set(counts) <= set(law), "sampled an outcome of probability zero"
    ranked = sorted(law, key=law.get, reverse=True)
    mass = torch.tensor([law[cell] for cell in ranked], dtype=torch.float64)
    group = dict(zip(ranked, ((mass.cumsum(0) - mass) * bins / mass.sum()).long().clamp(max=bins - 1).tolist()))
    expected = torch.zeros(bins, dtype=torch.float64).index_add_(0, torch.tensor(list(group.values())), mass) * n
    observed = torch.zeros(bins, dtype=torch.float64)
    for cell, count in counts.items():
        observed[group[cell]] += count
    used = expected > 0
    stat = float(((observed[used] - expected[used]) ** 2 / expected[used]).sum())
    return float(chi2.sf(stat, int(used.sum()) - 1))


def sample_three_tokens(model, n: int, prompt: torch.Tensor = PROMPT, sampling: dict = WARP, **generate_kwargs
                        ) -> tuple[dict, list]:
    """``n`` ``generate`` calls of three tokens sampled with ``sampling`` (seeded once): how often each 3-token
    outcome came, and the outputs (``return_dict_in_generate``, for `assert_drafted`)."""
    torch.manual_seed(0)
    counts: dict = {}
    outs = []
    for _ in range(n):
        out = model.generate(prompt, max_new_tokens=3, return_dict_in_generate=True, **sampling, **generate_kwargs)
        outs.append(out)
        cell = tuple(out.sequences[0, -3:].tolist())
        counts[cell] = counts.get(cell, 0) + 1
    return counts, outs


@pytest.mark.parametrize("policy,verifier", [("salf", "nss"), ("eagle2", "nss"), ("chain", "naive")])
def test_three_token_law_is_preserved(target, drafters, policy, verifier):
    law = exact_law(target)
    n = 600
    counts, outs = sample_three_tokens(target, n, assistant_model=drafters["perturbed"], tree_policy=policy,
                                       verifier=verifier, tree_depth=3, **fixed_budget(policy))  # trees every step
    assert_drafted(outs)
    assert all(out.drafted_steps == len(out.tree_sizes) for out in outs), "every step drafts a tree"
    assert chi_square_pvalue(counts, law, n) > 1e-3


@pytest.mark.parametrize("policy,verifier", [("dyspec", "swor"), ("salf", "nss")])
def test_three_token_law_without_logits_processors(target, drafters, policy, verifier):
    """With no processor and no returned scores, the verifier reads the forward's own logits, at the nodes it visits
    (no rows x vocabulary cast to fp32 first, no logits kept past the verdict: `TreeDecodingLoop.lean`); same law."""
    law = exact_law(target, warped=False)
    n = 600
    counts, outs = sample_three_tokens(target, n, sampling=UNWARPED, assistant_model=drafters["perturbed"],
                                       tree_policy=policy, verifier=verifier, tree_depth=3, **fixed_budget(policy, 8))
    assert_drafted(outs)
    assert all(out.drafted_steps == len(out.tree_sizes) for out in outs), "every step drafts a tree"
    assert binned_pvalue(counts, law, n) > 1e-3


# fixed sizes (no "auto"): DySpec's 4 nodes, SWOR's 4 siblings at each of 2 levels (its budget None: no cap)
@pytest.mark.parametrize("policy,verifier,budget,width", [("dyspec", "swor", 4, {}),
                                                          ("swor", "swor", None, {"tree_topk": 4})])
def test_three_token_law_with_a_reduced_draft_vocabulary_under_top_k(target, policy, verifier, budget, width):
    """A feature drafter proposing 40 of the vocabulary's ids (the rest -inf in its logits), warped by temperature
    and top-k with the target: sampled siblings and the SWOR walk over a reduced vocabulary keep the law."""
    from hf_treespec.drafters.feature import build_draft_vocab
    from test_feature_drafter import make_drafter

    law = exact_law(target)
    # the 40 ids of most mass in the law's outcomes (so drafts get accepted), the rest of the vocabulary left out
    mass = torch.zeros(target.config.vocab_size)
    for cell, prob in law.items():
        mass[list(cell)] += prob
    drafter = make_drafter(target, seed=2, target_layers=[0, 2, 3], draft_vocab_size=40)
    drafter.set_draft_vocab(build_draft_vocab(mass, 40)[0])
    n = 600
    counts, outs = sample_three_tokens(target, n, assistant_model=drafter, tree_policy=policy, verifier=verifier,
                                       tree_budget=budget, tree_depth=2, **width)
    assert_drafted(outs)
    assert all(out.drafted_steps == len(out.tree_sizes) for out in outs), "every step drafts a tree"
    assert chi_square_pvalue(counts, law, n) > 1e-3


def sharpened(model, factor: float = 3.0):
    """A drafter that is ``model`` with its LM head scaled by ``factor``: sharper than the target, it puts more mass
    than the target on the target's favourite tokens, so the tokens it drafts have p/q well below 1."""
    import copy

    drafter = copy.deepcopy(model)
    with torch.no_grad():
        drafter.lm_head.weight.mul_(factor)
    return drafter


def test_a_sharper_drafter_holds_the_acceptance_ratio_to_account(target):
    """The laws above draft with a perturbed copy of the target (p/q near 1 at its drafts), where an acceptance
    rule that is slightly off barely moves the law: accepting with min(1, 1.2 p/q) passes them. A drafter sharper
    than the target drafts tokens with p/q well below 1, where that bias moves the law of the tree step's tokens by
    several points: this law fails under it (p ~ 3e-5 at n = 600), a correct rule passes (p ~ 0.9)."""
    law = exact_law(target)
    drafter = sharpened(target)
    n = 600
    counts, outs = sample_three_tokens(target, n, assistant_model=drafter, tree_policy="iid", tree_paths=2,
                                       tree_depth=2, verifier="specinfer")
    assert_drafted(outs)
    assert chi_square_pvalue(counts, law, n) > 1e-3
