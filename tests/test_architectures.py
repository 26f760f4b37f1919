"""Conformance matrix: tree speculation over tiny random models of the decoder-only families transformers ships.

Every deterministic policy x {a causal-LM drafter of the same family, a `for_target` feature drafter} must give plain
greedy ``generate``'s tokens exactly (fp32). Sliding-window families run with a window smaller than the prompt, so the
window is crossed both in the prefill and while decoding. Families that cannot work get a clear error.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf

import hf_treespec
from hf_treespec.drafters import TreeSpecDrafterConfig, TreeSpecDrafterModel
from hf_treespec.features import capture_hidden_states, final_norm
from hf_treespec.kv.window import TreeWindows
from hf_treespec.policies import DelaySelector, DelaySelectorConfig
from hf_treespec.policies.nde_selector import action_space
from hf_treespec.policies.nde_features import DIVERGENCE_FEATURES, SCALAR_FEATURES

from conftest import assert_drafted, char_tokenizer, confident_classifier, fixed_budget, perturbed_copy

torch.set_num_threads(1)

VOCAB, WINDOW, NEW_TOKENS = 96, 8, 16
POLICIES = ("chain", "eagle2", "salf", "optimal", "static")
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)

# family -> config (tiny; no special token ids, so no prompt token is taken for padding or EOS)
FAMILIES = {
    "llama": lambda: tf.LlamaConfig(**SMALL),
    "qwen2": lambda: tf.Qwen2Config(**SMALL),
    "qwen3": lambda: tf.Qwen3Config(**SMALL, head_dim=8),
    "qwen3_moe": lambda: tf.Qwen3MoeConfig(**SMALL, head_dim=8, num_experts=4, num_experts_per_tok=2,
                                           moe_intermediate_size=32),
    "smollm3": lambda: tf.SmolLM3Config(**SMALL),
    "olmo2": lambda: tf.Olmo2Config(**SMALL),
    "granite": lambda: tf.GraniteConfig(**SMALL, logits_scaling=2.0, embedding_multiplier=2.0),
    "mistral": lambda: tf.MistralConfig(**SMALL, sliding_window=WINDOW),
    "phi3": lambda: tf.Phi3Config(**SMALL, sliding_window=WINDOW),
    "gemma2": lambda: tf.Gemma2Config(**SMALL, head_dim=8, sliding_window=WINDOW),  # soft-capping on
    "gemma3_text": lambda: tf.Gemma3TextConfig(
        **{**SMALL, "num_hidden_layers": 3}, head_dim=8, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    "gpt2": lambda: tf.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=256),
    "gpt_neox": lambda: tf.GPTNeoXConfig(**{k: v for k, v in SMALL.items() if k != "num_key_value_heads"}),
    "opt": lambda: tf.OPTConfig(hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                                word_embed_proj_dim=32),
    "falcon": lambda: tf.FalconConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4),
    "gptj": lambda: tf.GPTJConfig(n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=256),
    "gpt_bigcode": lambda: tf.GPTBigCodeConfig(n_embd=32, n_layer=2, n_head=4, n_positions=256),  # multi-query
    "phi": lambda: tf.PhiConfig(**SMALL),
    "cohere": lambda: tf.CohereConfig(**SMALL, logit_scale=0.5),
    "starcoder2": lambda: tf.Starcoder2Config(**SMALL, sliding_window=WINDOW),
    "qwen2_sliding": lambda: tf.Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=WINDOW,
                                            max_window_layers=1),  # full layer first, then sliding
}
SLIDING = ("mistral", "phi3", "gemma2", "gemma3_text", "starcoder2", "qwen2_sliding")


def tiny(family: str, seed: int) -> torch.nn.Module:
    config = FAMILIES[family]()
    config.vocab_size = VOCAB
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(config, name, None)
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)  # peaked distributions, like a real LM
    return model


@pytest.fixture(scope="module")
def models():
    cache: dict[str, tuple] = {}

    def get(family: str):
        if family not in cache:
            target = hf_treespec.enable(tiny(family, seed=0))
            feature = TreeSpecDrafterModel(TreeSpecDrafterConfig.for_target(target.config, target_layers=[0, -1]))
            # scale 0.2: close enough that every family's chain accepts some drafts (olmo2's does not at 0.3)
            cache[family] = target, {"causal_lm": perturbed_copy(target, scale=0.2), "feature": feature.eval()}
        return cache[family]

    return get


def prompts(family: str) -> list[torch.Tensor]:
    """A prompt longer than the window; for sliding families also a short one (the window is crossed mid-decode)."""
    generator = torch.Generator().manual_seed(5)
    lengths = (WINDOW + 5, 3) if family in SLIDING else (WINDOW + 5,)
    return [torch.randint(0, VOCAB, (1, n), generator=generator) for n in lengths]


@pytest.mark.parametrize("drafter_kind", ["causal_lm", "feature"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_identity_with_plain_generate(models, family, drafter_kind):
    target, drafters = models(family)
    drafter = drafters[drafter_kind]
    outs: dict[str, list] = {policy: [] for policy in POLICIES}
    for ids in prompts(family):
        plain = target.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        for policy in POLICIES:
            out = target.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, assistant_model=drafter,
                                  tree_policy=policy, return_dict_in_generate=True, **fixed_budget(policy))
            assert torch.equal(out.sequences, plain), (family, drafter_kind, policy, ids.shape[1])
            outs[policy].append(out)
    for policy in POLICIES:  # trees were verified by every policy (accepted, with the causal-LM drafter)
        assert_drafted(outs[policy], accepting=drafter_kind == "causal_lm")


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_returned_cache_is_the_sliding_cache_plain_generate_leaves(models, family):
    target, drafters = models(family)
    ids = prompts(family)[0]
    kwargs = dict(max_new_tokens=NEW_TOKENS, do_sample=False, return_dict_in_generate=True)
    plain = target.generate(ids, **kwargs).past_key_values
    out = target.generate(ids, assistant_model=drafters["causal_lm"], tree_policy="eagle2", tree_budget=60, **kwargs)
    assert_drafted(out)
    tree = out.past_key_values
    assert [type(layer) for layer in tree.layers] == [type(layer) for layer in plain.layers]
    for mine, theirs in zip(tree.layers, plain.layers):
        assert mine.get_seq_length() == theirs.get_seq_length()
        torch.testing.assert_close(mine.keys, theirs.keys, atol=1e-5, rtol=1e-4)


def test_identity_needs_the_window_in_the_tree_mask(models, monkeypatch):
    """The matrix can fail: without the window in the tree mask a Mistral target's tree steps diverge."""
    target, drafters = models("mistral")
    ids = prompts("mistral")[0]
    plain = target.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    kwargs = dict(max_new_tokens=NEW_TOKENS, do_sample=False, assistant_model=drafters["causal_lm"],
                  tree_policy="chain", return_dict_in_generate=True)
    assert_drafted(target.generate(ids, **kwargs))  # the control drafts: what breaks below is the trees' mask
    monkeypatch.setattr(TreeWindows, "masks", lambda self, mask, queries, keys: mask)
    out = target.generate(ids, **kwargs)
    assert_drafted(out)
    assert not torch.equal(out.sequences, plain)


def padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Three prompts longer than the window (one crosses it by a token), left-padded to the longest."""
    generator = torch.Generator().manual_seed(7)
    lengths = (WINDOW + 5, WINDOW + 1, WINDOW + 9)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, width - n :] = torch.randint(1, VOCAB, (n,), generator=generator)
        mask[row, width - n :] = 1
    return ids, mask


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_sliding_window_batch_rows_equal_plain_batched_generate(models, family):
    """A left-padded batch of 3 over a sliding-window target: the window applied per row in the tree mask, every
    policy's rows equal plain batched ``generate``'s token for token (fp32, greedy)."""
    target, drafters = models(family)
    ids, mask = padded_batch()
    kwargs = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    plain = target.generate(ids, **kwargs)
    # untrained helper networks (whatever tree they pick, greedy verification is lossless); the delay selector reads
    # the target's state at each row's root, no drafter state (a batch keeps none per row for it)
    torch.manual_seed(0)
    selector = DelaySelector(DelaySelectorConfig(
        actions=[list(a) for a in action_space((1, 2), (1,), (1, 2))], hidden_inputs={"target_hidden": SMALL["hidden_size"]}, shared_dim=8,
        scalar_features=[name for name in SCALAR_FEATURES if name not in DIVERGENCE_FEATURES])).eval()
    needs = {"c2t": dict(c2t_classifier=confident_classifier()), "nde": dict(tree_selector=selector)}
    for policy in hf_treespec.list_policies():
        out = target.generate(ids, assistant_model=drafters["causal_lm"], tree_policy=policy,
                              return_dict_in_generate=True, **needs.get(policy, {}), **fixed_budget(policy), **kwargs)
        assert_drafted(out)  # per policy: trees were verified and accepted, not only draft-free steps
        assert torch.equal(out.sequences, plain), (family, policy)


def test_sliding_window_batch_needs_the_window_in_the_tree_mask(models, monkeypatch):
    """The batch test can fail: without the window in the batch's tree mask a Mistral target's rows diverge."""
    target, drafters = models("mistral")
    ids, mask = padded_batch()
    kwargs = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    plain = target.generate(ids, **kwargs)
    kwargs.update(assistant_model=drafters["causal_lm"], tree_policy="chain", return_dict_in_generate=True)
    assert_drafted(target.generate(ids, **kwargs))  # the control drafts: what breaks below is the trees' mask
    monkeypatch.setattr(TreeWindows, "masks", lambda self, mask, queries, keys: mask)
    out = target.generate(ids, **kwargs)
    assert_drafted(out)
    assert not torch.equal(out.sequences, plain)


@pytest.mark.parametrize("family", ["gpt2", "gpt_neox", "opt", "falcon", "gemma2", "llama"])
def test_captured_last_state_through_the_final_norm_gives_the_logits(models, family):
    """Layer -1 is the last block's output and `final_norm` the module found between it and the LM head."""
    target, _ = models(family)
    ids = prompts(family)[0]
    norm = final_norm(target)
    with torch.no_grad(), capture_hidden_states(target, [-1]) as states:
        logits = target(ids).logits
        rebuilt = target.get_output_embeddings()(norm(states.hidden_states))
    cap = getattr(target.config, "final_logit_softcapping", None)
    if cap:
        rebuilt = torch.tanh(rebuilt / cap) * cap
    torch.testing.assert_close(rebuilt, logits, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("config, reason", [
    (lambda: tf.BloomConfig(hidden_size=32, n_layer=2, n_head=4), "takes no position_ids"),
    (lambda: tf.FalconConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, alibi=True), "uses ALiBi"),
], ids=["bloom", "falcon_alibi"])
def test_models_that_take_positions_from_the_mask_are_refused_by_name(config, reason):
    made = config()
    made.vocab_size = VOCAB
    model = hf_treespec.enable(tf.AutoModelForCausalLM.from_config(made).eval())
    with pytest.raises(ValueError, match=f"The target model .*{reason}"):
        model.generate(torch.randint(0, VOCAB, (1, 5)), max_new_tokens=4, do_sample=False, assistant_model=model,
                       tree_policy="chain")


def test_encoder_decoder_models_are_refused_by_name():
    config = tf.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4,
                         decoder_start_token_id=0, pad_token_id=0, eos_token_id=None)
    model = hf_treespec.enable(tf.T5ForConditionalGeneration(config).eval())
    with pytest.raises(ValueError, match="encoder-decoder"):
        model.generate(torch.randint(1, VOCAB, (1, 5)), max_new_tokens=4, assistant_model=model, tree_policy="chain")
    with pytest.raises(ValueError, match="encoder-decoder"):
        TreeSpecDrafterConfig.for_target(config)


@pytest.mark.parametrize("family", ["gemma2", "granite", "cohere", "gpt_neox", "opt"])
def test_target_head_recomputes_the_targets_log_probs(models, family):
    """Soft labels of drafter training: the final norm, LM head and the logit soft-capping / scaling of the family."""
    from hf_treespec.trainers import TargetHead

    target, _ = models(family)
    ids = prompts(family)[0]
    head = TargetHead.from_target(target)
    with torch.no_grad(), capture_hidden_states(target, [-1]) as states:
        expected = torch.log_softmax(target(ids).logits, dim=-1)
    torch.testing.assert_close(head.log_probs(states.hidden_states), expected, atol=1e-5, rtol=1e-4)


def test_target_head_refuses_logits_it_cannot_rebuild(models):
    """A logit transform no config field declares (here: a hook doubling the LM head's output) is refused."""
    from hf_treespec.trainers import TargetHead

    target, _ = models("llama")
    handle = target.get_output_embeddings().register_forward_hook(lambda module, args, output: output * 2)
    try:
        with pytest.raises(ValueError, match="not supported for drafter training"):
            TargetHead.from_target(target)
    finally:
        handle.remove()


@pytest.mark.parametrize("family", ["gpt_neox", "opt"])
def test_talf_trained_feature_drafter_for_a_non_llama_target_decodes_losslessly(models, family, tmp_path):
    """`for_target` + a few TALF steps on data prepared from the target itself, then every deterministic policy."""
    import random
    import string

    from hf_treespec.trainers import PrepareConfig, TALFConfig, TALFTrainer, load_prepared, prepare_dataset

    tokenizer = char_tokenizer(string.ascii_letters + string.digits + "+/", chat=True)
    rng = random.Random(0)
    records = [{"id": f"c{i}", "conversations": [
        {"from": "human", "value": "".join(rng.choice(string.ascii_lowercase) for _ in range(5))},
        {"from": "gpt", "value": "".join(rng.choice(string.ascii_lowercase) for _ in range(3)) * 5}]}
        for i in range(6)]
    target, _ = models(family)
    prepare_dataset(target, tokenizer, records, tmp_path / "data", PrepareConfig(
        chunk_size=3, batch_tokens=256, storage_dtype="float32", tree_positions=4, tree_policy="eagle2",
        tree_params={"tree_topk": 3, "tree_depth": 2, "tree_budget": 60}), progress=False)
    torch.manual_seed(0)
    config = TreeSpecDrafterConfig.for_target(target.config, share_target_embeddings=True, share_target_lm_head=True)
    drafter = TreeSpecDrafterModel(config).tie_to_target(target)
    args = TALFConfig(output_dir=str(tmp_path / "run"), per_device_train_batch_size=2, learning_rate=3e-3, max_steps=3,
                      save_strategy="no", report_to="none", use_cpu=True, seed=0, dataloader_num_workers=0,
                      disable_tqdm=True, warmup_steps=0)
    TALFTrainer(drafter, args, target_model=target, train_dataset=load_prepared(tmp_path / "data")).train()
    drafter.eval()
    ids = prompts(family)[0]
    plain = target.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    for policy in POLICIES:
        out = target.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, assistant_model=drafter,
                              tree_policy=policy, return_dict_in_generate=True, **fixed_budget(policy))
        assert_drafted(out, accepting=False)  # three training steps: acceptance is not the point here
        assert torch.equal(out.sequences, plain), policy


def test_for_target_reads_per_layer_type_rope_and_sizes_the_mlp_of_gpt_style_targets():
    gemma3 = TreeSpecDrafterConfig.for_target(FAMILIES["gemma3_text"]())
    full_attention = FAMILIES["gemma3_text"]().rope_parameters["full_attention"]
    assert gemma3.rope_parameters["rope_theta"] == full_attention["rope_theta"] != 10000.0
    assert TreeSpecDrafterConfig.for_target(FAMILIES["gpt2"]()).intermediate_size == 4 * 32


@pytest.mark.parametrize("family, policy", [("mistral", "salf"), ("gpt_neox", "eagle2")])
def test_sampled_tree_decoding_preserves_the_law_of_non_llama_targets(models, family, policy):
    """Sampling (nss verifier) through a sliding-window and a GPT-style target: the joint law of the first three new
    tokens after a prompt longer than the window, against the law enumerated from the target (chi-square)."""
    from test_generate_sampling import chi_square_pvalue, exact_law, sample_three_tokens

    target, drafters = models(family)
    prompt = prompts(family)[0]
    law = exact_law(target, prompt)
    n = 600
    counts, outs = sample_three_tokens(target, n, prompt, assistant_model=drafters["causal_lm"], tree_policy=policy,
                                       verifier="nss", tree_depth=3, **fixed_budget(policy))  # trees every step
    assert_drafted(outs)
    assert chi_square_pvalue(counts, law, n) > 1e-3


def test_sliding_layers_other_than_dynamic_ones_are_refused_by_name(models):
    from transformers import StaticCache

    target, _ = models("mistral")
    cache = StaticCache(config=target.config, max_cache_len=32)
    with pytest.raises(ValueError, match="StaticSlidingWindowLayer"):
        TreeWindows.of(target.config, cache)


def test_multimodal_model_decodes_text_prompts_and_refuses_images():
    """Gemma 3 with a vision tower: a text-only prompt goes through its text decoder losslessly; pixel values (which
    the tree forwards would drop) are refused by name."""
    text = dict(SMALL, head_dim=8, sliding_window=WINDOW, vocab_size=VOCAB + 4,
                layer_types=["sliding_attention", "full_attention"], bos_token_id=None, eos_token_id=None,
                pad_token_id=None)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, image_size=28,
                  patch_size=14)
    config = tf.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                             boi_token_index=VOCAB + 1, eoi_token_index=VOCAB + 2, image_token_index=VOCAB + 3)
    torch.manual_seed(0)
    model = hf_treespec.enable(tf.Gemma3ForConditionalGeneration(config).eval())
    ids = prompts("gemma3_text")[0]
    plain = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    drafter = TreeSpecDrafterModel(TreeSpecDrafterConfig.for_target(model.config)).eval()
    for assistant, accepting in ((perturbed_copy(model), True), (drafter, False)):
        out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, assistant_model=assistant,
                             tree_policy="eagle2", tree_budget=30, return_dict_in_generate=True)
        assert_drafted(out, accepting=accepting)
        assert torch.equal(out.sequences, plain)
    with pytest.raises(ValueError, match=r"the model inputs \[.*\] would be ignored"):
        model.generate(ids, pixel_values=torch.zeros(1, 3, 28, 28), max_new_tokens=4, do_sample=False,
                       assistant_model=drafter, tree_policy="chain")


@pytest.mark.auto_budget
def test_auto_budget_calibrates_and_decodes_a_hybrid_sliding_window_target(models, monkeypatch, tmp_path):
    """tree_budget="auto" measures the target's cost curve with tree forwards: over full-length layers, as the loop
    runs them (a sliding layer's window-wide keys would not match the tree mask)."""
    monkeypatch.setenv("HF_TREESPEC_CACHE", str(tmp_path))
    target, drafters = models("gemma2")
    ids = prompts("gemma2")[0]
    plain = target.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    out = target.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, assistant_model=drafters["causal_lm"],
                          tree_policy="salf", tree_budget="auto")
    assert torch.equal(out, plain)


def test_training_trees_over_a_sliding_window_target_are_refused_by_name(models):
    from transformers import DynamicCache

    from hf_treespec.trainers.data.target_trees import grow_target_trees

    target, _ = models("mistral")
    with pytest.raises(ValueError, match="sliding-window attention .*--tree-policy none"):
        grow_target_trees(target, DynamicCache(config=target.config), [], policy=None)


ABSOLUTE_POSITIONS = {  # learned position tables, some smaller than the default calibration's contexts
    "gpt2": lambda: tf.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=256),
    "gpt2_short": lambda: tf.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=48),
    "opt": lambda: tf.OPTConfig(hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                                word_embed_proj_dim=32),
    "opt_short": lambda: tf.OPTConfig(hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                                      word_embed_proj_dim=32, max_position_embeddings=40),
    "gpt_bigcode_short": lambda: tf.GPTBigCodeConfig(n_embd=32, n_layer=2, n_head=4, n_positions=40),
}


@pytest.mark.auto_budget
@pytest.mark.parametrize("family", sorted(ABSOLUTE_POSITIONS))
@pytest.mark.parametrize("policy", ["salf", "optimal", "eagle2"])
def test_default_budget_on_absolute_position_models(family, policy, monkeypatch):
    """The default budget ("auto") calibrates within the model's position limit (GPT-2's ``n_positions``, OPT's
    ``max_position_embeddings``): no crash, and greedy output equal to plain generate, with a causal-LM drafter of
    the same family."""
    monkeypatch.setitem(FAMILIES, family, ABSOLUTE_POSITIONS[family])
    target = hf_treespec.enable(tiny(family, seed=0))
    drafter = perturbed_copy(target, scale=0.2)
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))
    plain = target.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    out = target.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, assistant_model=drafter,
                          tree_policy=policy)
    assert torch.equal(out, plain)
