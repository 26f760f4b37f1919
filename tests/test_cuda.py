"""The decoding loop, every policy, verifier and drafter kind, batched generation, auto sizing and a training step on
a CUDA device. Skipped without one (CI has none); on a GPU machine ``python -m pytest tests/test_cuda.py`` checks that
nothing in the package builds a tensor on the wrong device and that greedy output is still plain ``generate``'s.
(``tests/test_trainers.py`` pins its Trainers to the CPU; the training steps here run where the batches do, which is
where a step once built its tree-attention mask on the wrong device.)

Everything here is placed on the GPU the way a user would place it (``model.to("cuda")``, inputs on the model's
device); selectors and classifiers are left where they are loaded (the CPU) since a user passes them as loaded.
"""

from __future__ import annotations

import os

import pytest
import torch

import hf_treespec
from hf_treespec.policies import POLICIES
from hf_treespec.verifiers import VERIFIERS

from conftest import assert_drafted, confident_classifier, fixed_budget, perturbed_copy, tiny_llama
from test_batched_generate import PAD, PROMPTS
from test_batched_generate import left_padded as cpu_left_padded

#: HF_TREESPEC_TEST_DEVICE=cpu runs this file's checks on the CPU (to check the tests themselves without a GPU)
CUDA = torch.device(os.environ.get("HF_TREESPEC_TEST_DEVICE", "cuda"))
pytestmark = pytest.mark.skipif(CUDA.type == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device")
GREEDY_POLICIES = ["chain", "eagle2", "optimal", "salf", "dyspec", "iid", "swor", "delayed", "static"]
#: policies that sample their trees' tokens from the drafter even when decoding greedily: whether one of 20 steps
#: accepts a draft is chance (and the device's random stream), so only their drafting is asserted
SAMPLED_SHAPES = ("iid", "swor", "delayed")


@pytest.fixture(scope="module")
def gpu_target():
    return hf_treespec.enable(tiny_llama()).to(CUDA)


@pytest.fixture(scope="module")
def gpu_drafters(gpu_target):
    from hf_treespec.drafters import TreeSpecDrafterConfig, TreeSpecDrafterModel

    torch.manual_seed(0)
    feature = TreeSpecDrafterModel(TreeSpecDrafterConfig.for_target(gpu_target.config)).eval().to(CUDA)
    return {
        "perturbed": perturbed_copy(gpu_target),
        "truncated": hf_treespec.drafters.truncated(gpu_target, num_layers=2),
        "feature": feature,
        "lookup": hf_treespec.drafters.prompt_lookup(gpu_target),
    }


def left_padded(prompts=PROMPTS):
    ids, mask = cpu_left_padded(prompts)
    return ids.to(CUDA), mask.to(CUDA)


def single(target, prompt, **kwargs):
    return target.generate(torch.tensor([prompt], device=CUDA), **kwargs)[0, len(prompt):]


@pytest.mark.parametrize("drafter_name", ["perturbed", "truncated", "feature", "lookup"])
@pytest.mark.parametrize("policy", GREEDY_POLICIES)
def test_greedy_single_prompt(gpu_target, gpu_drafters, policy, drafter_name):
    prompt = torch.tensor([PROMPTS[0]], device=CUDA)
    ref = gpu_target.generate(prompt, do_sample=False, max_new_tokens=20)
    torch.manual_seed(0)  # iid, swor and delayed sample their shapes (which drafts are accepted) even when greedy
    out = gpu_target.generate(prompt, do_sample=False, max_new_tokens=20, assistant_model=gpu_drafters[drafter_name],
                              tree_policy=policy, return_dict_in_generate=True, **fixed_budget(policy))
    # the feature drafter is untrained
    assert_drafted(out, accepting=drafter_name != "feature" and policy not in SAMPLED_SHAPES)
    assert out.sequences.device.type == CUDA.type
    assert torch.equal(out.sequences, ref)


@pytest.mark.parametrize("drafter_name", ["perturbed", "feature", "lookup"])
@pytest.mark.parametrize("policy", GREEDY_POLICIES)
def test_greedy_batch(gpu_target, gpu_drafters, policy, drafter_name):
    ids, mask = left_padded()
    torch.manual_seed(0)  # iid, swor and delayed sample their shapes (which drafts are accepted) even when greedy
    out = gpu_target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=16, pad_token_id=PAD,
                              assistant_model=gpu_drafters[drafter_name], tree_policy=policy,
                              return_dict_in_generate=True, **fixed_budget(policy))
    assert_drafted(out, accepting=drafter_name != "feature" and policy not in SAMPLED_SHAPES)
    for row, prompt in enumerate(PROMPTS):
        assert torch.equal(out.sequences[row, ids.shape[1]:], single(gpu_target, prompt, do_sample=False,
                                                                     max_new_tokens=16)), row


def test_batch_rows_finish_early_and_cache_continues(gpu_target, gpu_drafters):
    from hf_treespec.compat import CACHE_KWARG, output_cache

    ids, mask = left_padded()
    refs = [single(gpu_target, p, do_sample=False, max_new_tokens=24) for p in PROMPTS]
    eos = int(refs[1][5])
    out = gpu_target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=24, eos_token_id=eos,
                              pad_token_id=PAD, assistant_model=gpu_drafters["perturbed"], tree_policy="salf",
                              tree_budget=60, return_dict_in_generate=True)
    assert_drafted(out)
    plain = gpu_target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=24, eos_token_id=eos,
                                pad_token_id=PAD)
    assert torch.equal(out.sequences, plain)
    # the returned cache continues plain generate (no EOS this time, so every row runs on)
    out = gpu_target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=10, pad_token_id=PAD,
                              assistant_model=gpu_drafters["perturbed"], tree_policy="eagle2", tree_budget=60,
                              return_dict_in_generate=True)
    assert_drafted(out)
    full_mask = torch.cat([mask, torch.ones_like(out.sequences[:, ids.shape[1]:])], dim=1)
    more = gpu_target.generate(out.sequences, attention_mask=full_mask, **{CACHE_KWARG: output_cache(out)},
                               do_sample=False, max_new_tokens=6, pad_token_id=PAD)
    fresh = gpu_target.generate(out.sequences, attention_mask=full_mask, do_sample=False, max_new_tokens=6,
                                pad_token_id=PAD)
    assert torch.equal(more, fresh)


def _sampling_cases():
    cases = []
    for name in GREEDY_POLICIES:
        policy = POLICIES.get(name)(do_sample=True)
        for verifier in VERIFIERS:
            if not VERIFIERS.get(verifier).sampling:
                continue
            try:
                VERIFIERS.get(verifier).check_compatible(policy.regime_for(), is_chain=policy.is_chain, do_sample=True)
            except ValueError:
                continue
            cases.append(pytest.param(name, verifier, id=f"{name}-{verifier}"))
    return cases


@pytest.mark.parametrize("policy,verifier", _sampling_cases())
def test_sampling_runs_and_reproduces(gpu_target, gpu_drafters, policy, verifier):
    """Every lossless (policy, verifier) pair samples on the GPU, batched, and a seed reproduces it. (Losslessness
    itself is device-independent arithmetic, tested on the CPU.)"""
    ids, mask = left_padded()
    kwargs = dict(attention_mask=mask, do_sample=True, temperature=1.0, top_k=8, max_new_tokens=12, pad_token_id=PAD,
                  assistant_model=gpu_drafters["perturbed"], tree_policy=policy, verifier=verifier,
                  return_dict_in_generate=True, **fixed_budget(policy))
    torch.manual_seed(3)
    first = gpu_target.generate(ids, **kwargs)
    assert_drafted(first, accepting=False)
    torch.manual_seed(3)
    second = gpu_target.generate(ids, **kwargs)
    first, second = first.sequences, second.sequences
    assert torch.equal(first, second)
    assert int(first.max()) < gpu_target.config.vocab_size


def test_c2t_and_nde_with_cpu_loaded_modules(gpu_target, gpu_drafters):
    """A classifier / selector as loaded (on the CPU) serves a GPU target."""
    from hf_treespec.policies import DelaySelector, DelaySelectorConfig

    prompt = torch.tensor([PROMPTS[0]], device=CUDA)
    ref = gpu_target.generate(prompt, do_sample=False, max_new_tokens=16)
    out = gpu_target.generate(prompt, do_sample=False, max_new_tokens=16, assistant_model=gpu_drafters["perturbed"],
                              tree_policy="c2t", c2t_classifier=confident_classifier(), return_dict_in_generate=True)
    assert_drafted(out)
    assert torch.equal(out.sequences, ref)
    torch.manual_seed(0)
    selector = DelaySelector(DelaySelectorConfig(actions=[[1, 2, 2], [2, 1, 2]],
                                                 hidden_inputs={"target_hidden": 32}, shared_dim=8)).eval()
    out = gpu_target.generate(prompt, do_sample=False, max_new_tokens=16, assistant_model=gpu_drafters["perturbed"],
                              tree_policy="nde", tree_selector=selector, return_dict_in_generate=True)
    assert_drafted(out)
    assert torch.equal(out.sequences, ref)


@pytest.mark.auto_budget
def test_auto_budget_calibrates_on_the_gpu(gpu_target, gpu_drafters, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TREESPEC_CACHE", str(tmp_path))
    ids, mask = left_padded()
    prompt = ids[:1, -len(PROMPTS[0]):]
    ref = gpu_target.generate(prompt, do_sample=False, max_new_tokens=20)
    out = gpu_target.generate(prompt, do_sample=False, max_new_tokens=20, assistant_model=gpu_drafters["perturbed"],
                              tree_policy="salf", tree_budget="auto")
    assert torch.equal(out, ref)
    out = gpu_target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=12, pad_token_id=PAD,
                              assistant_model=gpu_drafters["perturbed"], tree_policy="salf", tree_budget="auto")
    plain = gpu_target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=12, pad_token_id=PAD)
    assert torch.equal(out, plain)


#: most synchronizing calls one complete step of SALF (greedy, one prompt, feature drafter) may make on the device,
#: as ``torch.cuda.set_sync_debug_mode`` reports them (it warns once per blocking transfer); the CPU-side
#: `SyncCounter` (tests/test_sync_budget.py) counts these transfers for the same step, which is what runs with
#: HF_TREESPEC_TEST_DEVICE=cpu
DEVICE_STEP_BUDGET = 12


def test_syncs_per_step_on_the_device(gpu_target, gpu_drafters):
    import warnings

    from sync_counter import SyncCounter

    drafter = gpu_drafters["feature"]
    prompt = torch.tensor([PROMPTS[0]], device=CUDA)
    kwargs = dict(do_sample=False, max_new_tokens=24, assistant_model=drafter, tree_policy="salf", tree_budget=60)
    if CUDA.type != "cuda":
        with torch.no_grad(), SyncCounter(gpu_target, drafter) as counter:
            counter.mark(prompt)
            gpu_target.generate(prompt, attention_mask=torch.ones_like(prompt), **kwargs)
        per_step = [step.transfers for step in counter.steps]
    else:
        gpu_target.generate(prompt, **kwargs)  # warm-up: lazy initialisation syncs once
        ends = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            hook = gpu_target.register_forward_hook(
                lambda *args: ends.append(sum("synchroniz" in str(w.message) for w in caught)))
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
            try:
                gpu_target.generate(prompt, attention_mask=torch.ones_like(prompt), **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode(0)
                hook.remove()
        # complete steps, as SyncCounter.steps counts them: between the ends of the 2nd and the last target forwards
        per_step = [b - a for a, b in zip(ends[1:], ends[2:])]
    assert len(per_step) >= 3
    assert max(per_step) <= DEVICE_STEP_BUDGET, per_step


@pytest.mark.parametrize("objective", ["talf", "ttt"])
def test_training_steps_on_the_device(objective, tmp_path):
    """TALF (target trees) and TTT (7-step unroll + trees) train on the device: a few optimizer steps, finite loss."""
    from hf_treespec.trainers import TRAINERS, load_prepared, prepare_dataset
    from hf_treespec.trainers.data.prepared import PrepareConfig

    from test_trainers import TREES, char_tokenizer, conversations, make_drafter, tiny_target

    target = tiny_target()
    config = PrepareConfig(chunk_size=4, batch_tokens=256, storage_dtype="float32", tree_positions=4, **TREES)
    prepare_dataset(target.to(CUDA), char_tokenizer(), conversations(4), tmp_path / "data", config,
                    progress=False)
    data = load_prepared(tmp_path / "data")
    trainer_cls = TRAINERS[objective]
    args = trainer_cls.config_class(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, max_steps=3,
                                    save_strategy="no", report_to="none", use_cpu=CUDA.type == "cpu",
                                    disable_tqdm=True, logging_steps=1)
    trainer = trainer_cls(make_drafter(target), args, target_model=target, train_dataset=data)
    result = trainer.train()
    assert result.global_step == 3 and torch.isfinite(torch.tensor(result.training_loss))
    assert next(trainer.model.parameters()).device.type == CUDA.type

