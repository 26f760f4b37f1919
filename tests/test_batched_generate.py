"""Batched tree speculation: a left-padded batch of prompts (and ``num_return_sequences``), each row its own tree.

Greedy rows must equal each prompt's own plain ``generate`` token for token (fp32), with rows finishing at different
steps; the returned cache must continue plain ``generate`` for every row; sampling rows must keep the target's law
(Monte-Carlo through ``generate`` with B = 3, one row stopping early), and a broken acceptance rule must fail that
test.
"""

import copy

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

import hf_treespec
from hf_treespec.compat import CACHE_KWARG, output_cache
from hf_treespec.policies import POLICIES
from hf_treespec.verifiers import VERIFIERS

from conftest import assert_drafted, fixed_budget
from test_generate_sampling import chi_square_pvalue, exact_law

PROMPTS = [[3, 17, 42, 8, 8, 21], [5, 9, 33, 2], [11, 40, 7, 7, 19]]
PAD = 0


def left_padded(prompts=PROMPTS):
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids, mask


def single(target, prompt, **kwargs):
    return target.generate(torch.tensor([prompt]), **kwargs)[0, len(prompt):]


def new_tokens(out, row, width):
    """Row ``row``'s generated tokens, trailing padding removed (the output pads finished rows)."""
    return out[row, width:]


GREEDY_POLICIES = ["chain", "eagle2", "optimal", "salf", "dyspec", "iid", "swor", "delayed", "static"]


@pytest.mark.parametrize("policy", GREEDY_POLICIES)
def test_greedy_rows_equal_single_prompt_generate(target, drafters, policy):
    ids, mask = left_padded()
    torch.manual_seed(0)  # iid, swor and delayed sample their shapes (which drafts are accepted) even when greedy
    out = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=25, pad_token_id=PAD,
                          assistant_model=drafters["perturbed"], tree_policy=policy, return_dict_in_generate=True,
                          **fixed_budget(policy))
    for row, prompt in enumerate(PROMPTS):
        assert torch.equal(new_tokens(out.sequences, row, ids.shape[1]), single(target, prompt, do_sample=False,
                                                                                max_new_tokens=25)), row
    assert len(out.row_accepted_lengths) == 3
    assert all(sum(lengths) + 1 == 25 for lengths in out.row_accepted_lengths)
    assert_drafted(out)
    sizes = iter(out.tree_sizes)  # the rows' steps one after another, as row_accepted_lengths splits them
    assert all(any([next(sizes) for _ in lengths]) for lengths in out.row_accepted_lengths), "every row drafts"


def test_plain_batched_generate_rows_agree(target, drafters):
    """Where plain batched generate gives each prompt's single-prompt output, the tree batch gives the same rows."""
    ids, mask = left_padded()
    plain = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=20, pad_token_id=PAD)
    tree = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=20, pad_token_id=PAD,
                           assistant_model=drafters["perturbed"], tree_policy="salf", tree_budget=60,
                           return_dict_in_generate=True)
    assert_drafted(tree)
    assert torch.equal(tree.sequences, plain)


def test_batch_of_one_and_of_four_run_the_same_loop(target, drafters, monkeypatch):
    """One decoding loop: a single prompt and a padded batch of 4 go through the same `TreeDecodingLoop` steps; only
    the target cache's bookkeeping behind `TargetKV` differs (one row: `OneRowKV`, a batch: `RaggedKV`)."""
    from hf_treespec.generation.loop import TreeDecodingLoop

    seen, verify = [], TreeDecodingLoop.verify

    def spy(self, drafted):
        seen.append((len(self.rows), type(self.kv).__name__, len(drafted.trees)))
        return verify(self, drafted)

    monkeypatch.setattr(TreeDecodingLoop, "verify", spy)
    kwargs = dict(do_sample=False, max_new_tokens=8, pad_token_id=PAD, assistant_model=drafters["perturbed"],
                  tree_policy="salf", tree_budget=60, return_dict_in_generate=True)
    one = target.generate(torch.tensor([PROMPTS[0]]), **kwargs)
    ids, mask = left_padded(PROMPTS + [[6, 6, 1]])
    four = target.generate(ids, attention_mask=mask, **kwargs)
    assert_drafted(one)
    assert_drafted(four)
    assert {(1, "OneRowKV", 1), (4, "RaggedKV", 4)} <= set(seen)
    assert torch.equal(new_tokens(four.sequences, 0, ids.shape[1]), one.sequences[0, len(PROMPTS[0]):])


@pytest.mark.parametrize("drafter_name", ["random", "copy", "truncated", "lookup"])
def test_every_drafter_kind(target, drafters, drafter_name):
    drafter = hf_treespec.drafters.prompt_lookup(target) if drafter_name == "lookup" else drafters[drafter_name]
    assert_batch_equals_single_prompts(target, drafter, "eagle2", 20, accepting=drafter_name != "random")


def test_feature_drafter(target):
    from hf_treespec.drafters import TreeSpecDrafterConfig, TreeSpecDrafterModel

    torch.manual_seed(0)
    drafter = TreeSpecDrafterModel(TreeSpecDrafterConfig.for_target(target.config)).eval()
    assert_batch_equals_single_prompts(target, drafter, "salf", 15, accepting=False)  # an untrained drafter


def assert_batch_equals_single_prompts(target, drafter, policy, max_new_tokens, accepting=True, budget=60):
    """The batch's rows equal each prompt's own plain generate, trees drafted (and accepted, with ``accepting``)."""
    ids, mask = left_padded()
    out = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=PAD,
                          assistant_model=drafter, tree_policy=policy, tree_budget=budget,
                          return_dict_in_generate=True)
    assert_drafted(out, accepting=accepting)
    out = out.sequences
    for row, prompt in enumerate(PROMPTS):
        assert torch.equal(new_tokens(out, row, ids.shape[1]), single(target, prompt, do_sample=False,
                                                                      max_new_tokens=max_new_tokens)), row


def test_rows_finish_at_different_steps_with_a_custom_eos(target, drafters):
    ids, mask = left_padded()
    refs = [single(target, p, do_sample=False, max_new_tokens=30) for p in PROMPTS]
    eos = int(refs[1][7])  # row 1 stops at its 8th token at the latest; the others whenever they emit it
    refs_eos = [single(target, p, do_sample=False, max_new_tokens=30, eos_token_id=eos, pad_token_id=PAD)
                for p in PROMPTS]
    out = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=30, eos_token_id=eos,
                          pad_token_id=PAD, assistant_model=drafters["copy"], tree_policy="salf", tree_budget=60,
                          return_dict_in_generate=True)
    assert_drafted(out)
    lengths = {len(r) for r in refs_eos}
    assert len(lengths) > 1, "the test needs rows of different lengths"
    width = ids.shape[1]
    for row, ref in enumerate(refs_eos):
        got = out.sequences[row, width:]
        assert torch.equal(got[: len(ref)], ref), row
        assert bool((got[len(ref):] == PAD).all()), "a finished row is padded with pad_token_id"
    # plain batched generate pads the same way
    plain = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=30, eos_token_id=eos,
                            pad_token_id=PAD)
    assert torch.equal(out.sequences, plain)
    # a finished row stops costing compute: it runs no more steps than it needed
    assert [sum(r) + 1 for r in out.row_accepted_lengths] == [len(r) for r in refs_eos]


def test_stop_strings_per_row(target, drafters, word_tokenizer):
    ids, mask = left_padded()
    ref = single(target, PROMPTS[0], do_sample=False, max_new_tokens=30)
    stop = word_tokenizer.decode(ref[5:7])
    kwargs = dict(do_sample=False, max_new_tokens=30, stop_strings=[stop], tokenizer=word_tokenizer, pad_token_id=PAD)
    out = target.generate(ids, attention_mask=mask, assistant_model=drafters["perturbed"], tree_policy="eagle2",
                          tree_budget=60, return_dict_in_generate=True, **kwargs)
    assert_drafted(out)
    out = out.sequences
    stopped = 0
    for row, prompt in enumerate(PROMPTS):
        alone = target.generate(torch.tensor([prompt]), **kwargs)[0, len(prompt):]
        got = out[row, ids.shape[1]:]
        assert torch.equal(got[: len(alone)], alone), row
        # without an EOS token plain batched generate keeps decoding a stopped row; a tree batch drops it and pads
        assert bool((got[len(alone):] == PAD).all()), row
        stopped += len(alone) < 30
    assert stopped >= 1, "the stop string must end at least one row early"


def test_returned_cache_continues_plain_generate(target, drafters):
    ids, mask = left_padded()
    out = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=12, pad_token_id=PAD,
                          assistant_model=drafters["perturbed"], tree_policy="eagle2", tree_budget=60,
                          return_dict_in_generate=True)
    assert_drafted(out)
    cache = output_cache(out)
    assert cache.get_seq_length() == out.sequences.shape[1] - 1
    more = target.generate(out.sequences, attention_mask=out.attention_mask, do_sample=False, max_new_tokens=8,
                           pad_token_id=PAD, **{CACHE_KWARG: cache})
    full = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=20, pad_token_id=PAD)
    assert torch.equal(more, full)


def test_returned_cache_after_rows_dropped_out(target, drafters):
    """Rows that finished early are put back into the returned cache: each row's KV continues that row alone."""
    ids, mask = left_padded()
    ref = single(target, PROMPTS[1], do_sample=False, max_new_tokens=30)
    eos = int(ref[5])
    out = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=14, eos_token_id=eos,
                          pad_token_id=PAD, assistant_model=drafters["copy"], tree_policy="salf", tree_budget=60,
                          return_dict_in_generate=True)
    assert_drafted(out)
    cache = output_cache(out)
    for row, prompt in enumerate(PROMPTS):
        real = out.attention_mask[row].bool()
        tokens = out.sequences[row, real]
        if int(tokens[-1]) == eos:
            continue  # a finished row: nothing to continue
        alone = target(tokens[None], use_cache=False).logits[0, -1]
        keys = [layer.keys[row : row + 1, :, real[:-1]] for layer in cache.layers]
        assert all(k.shape[-2] == tokens.numel() - 1 for k in keys)
        # the next-token logits from the returned cache equal a fresh forward over the row's tokens
        from transformers import DynamicCache

        fresh = DynamicCache(config=target.config)
        for i, layer in enumerate(cache.layers):
            fresh.update(layer.keys[row : row + 1, :, real[:-1]], layer.values[row : row + 1, :, real[:-1]], i)
        step = target(tokens[None, -1:], position_ids=torch.tensor([[tokens.numel() - 1]]), use_cache=True,
                      **{CACHE_KWARG: fresh}).logits[0, -1]
        torch.testing.assert_close(step, alone, rtol=1e-4, atol=1e-4)


@pytest.mark.auto_budget
def test_auto_budget_batch(target, drafters, tmp_path, monkeypatch):
    """auto sizes a batch's trees: on a flat curve (pinned: a GPU's) with the truncated self-drafter (priced below a
    target step) its rows draft, and each equals its own plain generate."""
    from hf_treespec.cost.curve import CostCurve

    sizes = [1, 2, 4, 8, 16, 32, 64, 128]
    flat = CostCurve(sizes, [256], [[0.05 + 0.0001 * n for n in sizes]])
    monkeypatch.setenv("HF_TREESPEC_CACHE", str(tmp_path))
    monkeypatch.setattr("hf_treespec.cost.speed_model.load_or_calibrate",
                        lambda m, cache_dir=None, compiled=None, batch=1: CostCurve.from_json(flat.to_json()))
    ids, mask = left_padded()
    out = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=20, pad_token_id=PAD,
                          assistant_model=drafters["truncated"], tree_policy="salf", tree_budget="auto",
                          return_dict_in_generate=True)
    assert_drafted(out)
    out = out.sequences
    for row, prompt in enumerate(PROMPTS):
        assert torch.equal(new_tokens(out, row, ids.shape[1]), single(target, prompt, do_sample=False,
                                                                      max_new_tokens=20)), row


def steep_curve():
    """Every extra target row costs a full step: no tree can pay at any batch size."""
    from hf_treespec.cost.curve import CostCurve

    sizes = [1, 2, 4, 8, 16, 32, 64, 128]
    return CostCurve(sizes, [256], [[0.05 * n for n in sizes]])


@pytest.mark.auto_budget
def test_batch_where_no_tree_pays_runs_no_policy_and_equals_plain(target, drafters, tmp_path, monkeypatch):
    """auto under a cost curve where no tree can pay: no row drafts (one bound per step, no probe within budget), the
    draft-free rows share processor and stopping calls per row length, and every row equals plain batched
    generate, a prefix-reading processor (no-repeat n-grams) and a custom EOS included."""
    monkeypatch.setenv("HF_TREESPEC_CACHE", str(tmp_path))
    monkeypatch.setattr("hf_treespec.cost.speed_model.load_or_calibrate", lambda m, cache_dir=None, compiled=None, batch=1: steep_curve())
    monkeypatch.delitem(target.__dict__, "_treespec_speed_models", raising=False)  # no curve an earlier test set
    ids, mask = left_padded()
    refs = [single(target, p, do_sample=False, max_new_tokens=30) for p in PROMPTS]
    eos = int(refs[1][7])
    kwargs = dict(do_sample=False, max_new_tokens=30, eos_token_id=eos, pad_token_id=PAD, no_repeat_ngram_size=2)
    plain = target.generate(ids, attention_mask=mask, **kwargs)
    calls = []
    salf = hf_treespec.policies.POLICIES.get("salf")
    original = salf.grow
    monkeypatch.setattr(salf, "grow",
                        lambda self, *a, **k: calls.append(1) or original(self, *a, **k))
    out = target.generate(ids, attention_mask=mask, **kwargs, assistant_model=drafters["copy"], tree_policy="salf",
                          tree_budget="auto", return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain)
    assert out.drafted_steps == 0 and out.draft_forwards == 0 and not calls
    lengths = [sum(r) + 1 for r in out.row_accepted_lengths]
    assert len(set(lengths)) > 1, "the test needs rows finishing at different steps"
    for row, prompt in enumerate(PROMPTS):  # and each row equals its own single-prompt generate
        ref = single(target, prompt, **kwargs)
        assert torch.equal(out.sequences[row, ids.shape[1] : ids.shape[1] + len(ref)], ref), row


@pytest.mark.parametrize("policy", ["chain", "salf"])
def test_repetition_penalty_on_a_padded_batch_equals_plain_batched(target, drafters, policy):
    """transformers (5.2x) gives the repetition penalty each row's left padding as per-row state; the loop calls
    processors on single rows, tree nodes and groups of rows, so that state must follow the row (the pad id 0 is a
    token these prompts would otherwise be penalised for)."""
    ids, mask = left_padded()
    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=20, repetition_penalty=1.5, pad_token_id=PAD)
    ref = target.generate(ids, **kwargs)
    out = target.generate(ids, assistant_model=drafters["perturbed"], tree_policy=policy, return_dict_in_generate=True,
                          **fixed_budget(policy), **kwargs)
    assert_drafted(out)
    assert torch.equal(out.sequences, ref)


def test_per_row_processor_state_is_narrowed_to_the_rows():
    from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper

    from hf_treespec.generation.processors import processors_for_rows

    penalty, warper = RepetitionPenaltyLogitsProcessor(1.3), TemperatureLogitsWarper(0.7)
    penalty.prompt_ignore_length = torch.tensor([2, 0, 1])  # as transformers sets it for a padded batch
    processors = LogitsProcessorList([warper, penalty])
    one = processors_for_rows(processors, 2)
    assert one[0] is warper and one[1].prompt_ignore_length == 1 and isinstance(one[1].prompt_ignore_length, int)
    group = processors_for_rows(processors, [2, 0])
    assert torch.equal(group[1].prompt_ignore_length, torch.tensor([1, 2]))
    assert torch.equal(penalty.prompt_ignore_length, torch.tensor([2, 0, 1]))  # the caller's processor is untouched
    plain = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.3)])
    assert processors_for_rows(plain, 1)[0] is plain[0]


def test_could_pay_bounds_every_tree():
    """`TreeSizer.could_pay`: False when even a perfectly accepted chain of any depth loses to a draft-free step at
    this batch (a steep curve, or a flat one at a batch whose rows draft one after another), True where a tree could
    pay, from the first step at every batch size."""
    from hf_treespec.cost.curve import CostCurve
    from hf_treespec.cost.sizer import TreeSizer
    from hf_treespec.cost.speed_model import SpeedModel

    sizes = [1, 2, 4, 8, 16, 32, 64, 128]
    flat = CostCurve(sizes, [256], [[0.05 + 0.0001 * n for n in sizes]])
    assert not TreeSizer(SpeedModel(steep_curve()), 256).could_pay()
    assert TreeSizer(SpeedModel(flat), 256).could_pay()
    assert TreeSizer(SpeedModel(flat, batch=2), 256).could_pay()  # a batch decides from its first step
    # rows draft one after another: at batch 16 an expansion costs 16 draft forwards (4.8 one-row steps at the prior)
    assert not TreeSizer(SpeedModel(flat, batch=16), 256).could_pay()
    # a drafter that batches rows drafts all 16 in one forward per expansion: a tree can pay again
    assert TreeSizer(SpeedModel(flat, batch=16, batched_drafting=True), 256).could_pay()
    costly = SpeedModel(flat, batch=64, batched_drafting=True)
    costly._draft.add(0.06)  # one draft round costs more than a step of the batch: no tree pays
    assert not TreeSizer(costly, 256).could_pay()
    as_large = SpeedModel(flat, draft_prior=1.0)  # a drafter as large as the target, before it was ever timed
    assert not TreeSizer(as_large, 256).could_pay()


def test_batch_prices_its_own_forwards():
    """A batch's curve prices its own ``[B, n]`` forwards (n rows per tree); drafting row by row costs B forwards of
    the prior, a drafter that batches rows one."""
    from hf_treespec.cost.curve import CostCurve
    from hf_treespec.cost.speed_model import SpeedModel

    curve = CostCurve(sizes=[1, 8, 64], contexts=[100], seconds=[[1.0, 2.0, 9.0]])
    four = SpeedModel(curve, batch=4, draft_prior=0.25)
    assert four.step_costs(2, 100).tolist() == pytest.approx([curve(1, 100), curve(2, 100)])
    assert four.target_seconds(2, 100) == pytest.approx(curve(2, 100))
    assert four.draft_seconds(100) == pytest.approx(4 * 0.25 * curve(1, 100))
    batched = SpeedModel(curve, batch=4, batched_drafting=True, draft_prior=0.25)
    assert batched.draft_seconds(100) == pytest.approx(0.25 * curve(1, 100))
    assert batched.step_mode(100) == "size"  # no waiting for a probe


def test_each_batch_size_has_its_own_calibrated_curve(target, monkeypatch):
    """[batch, n] forwards cost more than batch x n rows of one sequence: each batch size is calibrated on its own
    forwards, and what one batch size learns never reprices another's steps."""
    from hf_treespec.cost.curve import CostCurve
    from hf_treespec.cost.speed_model import speed_model_for

    asked = []

    def calibrate(model, cache_dir=None, compiled=None, batch=1):
        asked.append(batch)
        return CostCurve(sizes=[1, 8, 64], contexts=[100], seconds=[[batch * 1.0, batch * 2.0, batch * 9.0]])

    monkeypatch.setattr("hf_treespec.cost.speed_model.load_or_calibrate", calibrate)
    model = copy.copy(target)
    model.__dict__.pop("_treespec_speed_models", None)
    drafter = torch.nn.Linear(1, 1)
    single, batch = speed_model_for(model, drafter, ("k",)), speed_model_for(model, drafter, ("k",), batch=4)
    assert asked == [1, 4] and single.curve is not batch.curve
    assert batch.curve(1, 100) == pytest.approx(4.0)
    for _ in range(50):
        batch.curve.observe(4, 100, 50.0)
    assert single.curve(4, 100) == pytest.approx(1 + 3 / 7)  # interpolated between 1 and 8 rows, untouched
    assert speed_model_for(model, drafter, ("other",), batch=4).curve is batch.curve  # shared by every key
    assert asked == [1, 4]  # calibrated once per batch size


def test_speed_models_are_kept_per_drafter_object_and_die_with_it(target, monkeypatch):
    """A drafter's speed model is keyed by the drafter itself (a weak reference), not its ``id()``: a new drafter
    that reuses a dead one's address starts fresh."""
    import gc

    from hf_treespec.cost.curve import CostCurve
    from hf_treespec.cost.speed_model import speed_model_for

    monkeypatch.setattr("hf_treespec.cost.speed_model.load_or_calibrate",
                        lambda m, cache_dir=None, compiled=None, batch=1: CostCurve([1, 2], [8], [[1.0, 2.0]]))
    model = copy.copy(target)
    model.__dict__.pop("_treespec_speed_models", None)
    first = torch.nn.Linear(2, 2)
    speed = speed_model_for(model, first, ("k",))
    speed.steps.add(3, 0.01)
    assert speed_model_for(model, first, ("k",)) is speed
    store = model.__dict__["_treespec_speed_models"]["drafters"]
    del first, speed
    gc.collect()
    assert len(store) == 0
    assert speed_model_for(model, torch.nn.Linear(2, 2), ("k",)).gain.count == 0


def test_num_return_sequences_with_sampling(target, drafters):
    prompt = torch.tensor([PROMPTS[0]])
    torch.manual_seed(0)
    out = target.generate(prompt, do_sample=True, num_return_sequences=4, max_new_tokens=10,
                          assistant_model=drafters["perturbed"], tree_policy="salf", tree_budget=60,
                          return_dict_in_generate=True)
    assert_drafted(out)
    assert out.sequences.shape == (4, prompt.shape[1] + 10)
    assert torch.equal(out.sequences[:, : prompt.shape[1]], prompt.expand(4, -1))
    assert len({tuple(r) for r in out.sequences[:, prompt.shape[1]:].tolist()}) > 1, "rows sample independently"


def test_streamer_with_a_batch_is_refused(target, drafters):
    from transformers import TextStreamer

    class Tok:
        def decode(self, *a, **k):
            return ""

    ids, mask = left_padded()
    with pytest.raises(ValueError, match="batch size 1|streamer takes one sequence"):
        target.generate(ids, attention_mask=mask, max_new_tokens=3, pad_token_id=PAD, streamer=TextStreamer(Tok()),
                        assistant_model=drafters["copy"], tree_policy="salf", tree_budget=8)


def test_right_padding_is_refused(target, drafters):
    ids, mask = left_padded()
    with pytest.raises(ValueError, match="left padding"):
        target.generate(ids.flip(-1), attention_mask=mask.flip(-1), max_new_tokens=3, pad_token_id=PAD,
                        assistant_model=drafters["copy"], tree_policy="salf", tree_budget=8)


def test_scores_are_per_row_steps(target, drafters):
    ids, mask = left_padded()
    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=6, pad_token_id=PAD, output_scores=True,
                  return_dict_in_generate=True)
    plain = target.generate(ids, **kwargs)
    out = target.generate(ids, assistant_model=drafters["perturbed"], tree_policy="salf", tree_budget=60, **kwargs)
    assert_drafted(out)
    assert len(out.scores) == len(plain.scores) == 6
    for ours, theirs in zip(out.scores, plain.scores):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------------------------ sampling, B = 3
WARP = dict(do_sample=True, temperature=1.2, top_k=3)
STOP_ROW = 2  # stops after 2 new tokens; the others run 3


class StopRowEarly(StoppingCriteria):
    """Stops the row whose prompt ends like PROMPTS[STOP_ROW] once it has two new tokens (a per-row criterion, as
    plain batched generate calls it)."""

    def __init__(self, width):
        self.width = width

    def __call__(self, input_ids, scores, **kwargs):
        is_row = input_ids[:, self.width - 1] == PROMPTS[STOP_ROW][-1]
        return is_row & (input_ids.shape[-1] >= self.width + 2)


def _deterministic_cases():
    """Every lossless (policy, verifier) pair; the first pair of each policy and of each verifier runs in the README's
    test command, the rest under ``-m slow`` (CI runs both): the whole matrix took about a third of the quick suite."""
    cases, seen_policies, seen_verifiers = [], set(), set()
    for name in ["chain", "eagle2", "optimal", "salf", "static", "dyspec", "iid", "swor", "delayed"]:
        policy = POLICIES.get(name)(do_sample=True)
        for verifier in VERIFIERS:
            cls = VERIFIERS.get(verifier)
            try:
                cls.check_compatible(policy.regime_for(), is_chain=policy.is_chain, do_sample=True)
            except ValueError:
                continue
            new = name not in seen_policies or verifier not in seen_verifiers
            seen_policies.add(name)
            seen_verifiers.add(verifier)
            cases.append(pytest.param(name, verifier, id=f"{name}-{verifier}", marks=() if new else pytest.mark.slow))
    return cases


LOSSLESS_PAIRS = _deterministic_cases()


def test_pairs_cover_every_sampling_verifier():
    assert {case.values[1] for case in LOSSLESS_PAIRS} == {n for n in VERIFIERS if VERIFIERS.get(n).sampling}


def shape_of(policy):
    """Two draft levels: the first new token comes from the prefill, the next two from one tree step."""
    if "tree_depth" in POLICIES.get(policy).defaults:
        return {"tree_depth": 2}
    return {"delay_trunk": 1, "delay_branch": 1}


def batched_counts(target, drafter, policy, verifier, n, budget=60):
    """Each row's counts of its new tokens over ``n`` batched generate calls (trees of ``budget`` nodes for a policy
    sized by ``tree_budget``), and the calls' outputs (for `assert_drafted`)."""
    ids, mask = left_padded()
    stop = StoppingCriteriaList([StopRowEarly(ids.shape[1])])
    counts = [{} for _ in PROMPTS]
    outs = []
    for _ in range(n):
        out = target.generate(ids, attention_mask=mask, max_new_tokens=3, pad_token_id=PAD, stopping_criteria=stop,
                              assistant_model=drafter, tree_policy=policy, verifier=verifier, **shape_of(policy),
                              return_dict_in_generate=True, **fixed_budget(policy, budget), **WARP)
        outs.append(out)
        out = out.sequences
        for row in range(len(PROMPTS)):
            cell = tuple(out[row, ids.shape[1]: ids.shape[1] + (2 if row == STOP_ROW else 3)].tolist())
            counts[row][cell] = counts[row].get(cell, 0) + 1
        assert int(out[STOP_ROW, -1]) == PAD, "the early row is padded after it stopped"
    return counts, outs


@pytest.fixture(scope="module")
def laws(target):
    return [exact_law(target, torch.tensor([p]), 2 if row == STOP_ROW else 3) for row, p in enumerate(PROMPTS)]


N_SAMPLES = 240  # per row and pair; a correct sampler fails one row's test with probability 1e-3


@pytest.mark.parametrize("policy,verifier", LOSSLESS_PAIRS)
def test_batched_sampling_keeps_each_rows_law(target, drafters, laws, policy, verifier):
    torch.manual_seed(0)
    counts, outs = batched_counts(target, drafters["perturbed"], policy, verifier, N_SAMPLES)
    assert_drafted(outs)
    for row in range(len(PROMPTS)):
        assert chi_square_pvalue(counts[row], laws[row], N_SAMPLES) > 1e-3, row


def test_a_broken_acceptance_rule_fails_the_batched_test(target, drafters, laws, monkeypatch):
    """The test above has power: a verifier that always accepts the first draft child skews every row's law."""
    from hf_treespec.verifiers.base import VerifyResult

    cls = VERIFIERS.get("nss")

    def accept_first_child(self, tree, target_logits, generator=None):
        children = tree.children(0)
        if children.numel() == 0:
            return VerifyResult(torch.zeros(1, dtype=torch.long), self.target_choice(target_logits[0]))
        child = int(children[0])
        return VerifyResult(torch.tensor([0, child]), self.target_choice(target_logits[child]))

    monkeypatch.setattr(cls, "verify", accept_first_child)
    torch.manual_seed(0)
    counts, outs = batched_counts(target, drafters["random"], "eagle2", "nss", N_SAMPLES)
    assert_drafted(outs)  # the control drafts (and accepts): the skew below comes from the broken rule, not from chance
    assert min(pvalue_or_zero(counts[row], laws[row]) for row in range(len(PROMPTS))) < 1e-3


def pvalue_or_zero(counts, law):
    """The chi-square p-value, 0 when a cell of probability zero was sampled (already a failure)."""
    if not set(counts) <= set(law):
        return 0.0
    return chi_square_pvalue(counts, law, sum(counts.values()))
