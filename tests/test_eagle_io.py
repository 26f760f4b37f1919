"""EAGLE-1 / EAGLE-3 checkpoint import and EAGLE-3 export, against synthetic checkpoints in the published layouts.

The references below are written from the published architectures with plain tensor ops (no transformers modules),
so an import that loads every tensor but wires one wrongly (a norm on the wrong input, embedding and feature swapped,
d2t offsets read as ids) fails.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from hf_treespec.drafters import (
    TreeSpecDrafterConfig,
    TreeSpecDrafterModel,
    build_draft_vocab,
    from_eagle,
    to_eagle3,
)
from hf_treespec.drafters.eagle_io import EAGLE3_ARCHITECTURE, eagle3_default_target_layers, eagle_version

from conftest import VOCAB, assert_drafted

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, EPS, THETA = 32, 4, 2, 8, 64, 1e-6, 10000.0
DRAFT_VOCAB = 40
EAGLE3_KEYS = {
    "fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight", "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight", "midlayer.hidden_norm.weight",
    "midlayer.input_layernorm.weight", "midlayer.post_attention_layernorm.weight", "norm.weight", "lm_head.weight",
    "d2t", "t2d",
}



# ------------------------------------------------------------------------------------- reference architectures
def rms(x, weight):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS))


def rope(x):
    """x: [heads, T, head_dim] at positions 0..T-1 (rotate-half RoPE)."""
    dim, length = x.shape[-1], x.shape[-2]
    inv_freq = 1.0 / THETA ** (torch.arange(0, dim, 2).float() / dim)
    angles = torch.arange(length).float()[:, None] * inv_freq[None]
    angles = torch.cat([angles, angles], dim=-1)
    x1, x2 = x[..., : dim // 2], x[..., dim // 2 :]
    return x * angles.cos() + torch.cat([-x2, x1], dim=-1) * angles.sin()


def attention(x, sd, prefix):
    length = x.shape[0]
    q = (x @ sd[prefix + "q_proj.weight"].T).view(length, HEADS, HEAD_DIM).transpose(0, 1)
    k = (x @ sd[prefix + "k_proj.weight"].T).view(length, KV_HEADS, HEAD_DIM).transpose(0, 1)
    v = (x @ sd[prefix + "v_proj.weight"].T).view(length, KV_HEADS, HEAD_DIM).transpose(0, 1)
    q, k = rope(q), rope(k)
    k, v = k.repeat_interleave(HEADS // KV_HEADS, 0), v.repeat_interleave(HEADS // KV_HEADS, 0)
    scores = q @ k.transpose(-1, -2) / HEAD_DIM**0.5
    scores = scores.masked_fill(~torch.ones(length, length, dtype=torch.bool).tril(), float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(0, 1).reshape(length, HEADS * HEAD_DIM)
    return out @ sd[prefix + "o_proj.weight"].T


def mlp(x, sd, prefix):
    gate, up = x @ sd[prefix + "gate_proj.weight"].T, x @ sd[prefix + "up_proj.weight"].T
    return (F.silu(gate) * up) @ sd[prefix + "down_proj.weight"].T


def eagle3_reference(sd, embedding, tokens, target_states):
    """EAGLE-3 midlayer: attention over [input_layernorm(emb); hidden_norm(fc(h))], residual = fc(h)."""
    emb, hidden = embedding[tokens], target_states @ sd["fc.weight"].T
    attn_in = torch.cat([rms(emb, sd["midlayer.input_layernorm.weight"]),
                         rms(hidden, sd["midlayer.hidden_norm.weight"])], dim=-1)
    hidden = hidden + attention(attn_in, sd, "midlayer.self_attn.")
    hidden = hidden + mlp(rms(hidden, sd["midlayer.post_attention_layernorm.weight"]), sd, "midlayer.mlp.")
    draft_logits = rms(hidden, sd["norm.weight"]) @ sd["lm_head.weight"].T
    logits = torch.full((len(tokens), VOCAB), float("-inf"))
    logits[:, sd["d2t"] + torch.arange(DRAFT_VOCAB)] = draft_logits  # d2t holds offsets
    return logits, hidden


def eagle1_reference(sd, target, tokens, prenorm_states, num_layers):
    """EAGLE-1: fc([emb; post-norm target state]) -> layers (layer 0 without input norm) -> target LM head."""
    post_norm = target.model.norm(prenorm_states)
    hidden = torch.cat([sd["embed_tokens.weight"][tokens], post_norm], dim=-1) @ sd["fc.weight"].T + sd["fc.bias"]
    for i in range(num_layers):
        p = f"layers.{i}."
        attn_in = hidden if i == 0 else rms(hidden, sd[p + "input_layernorm.weight"])
        hidden = hidden + attention(attn_in, sd, p + "self_attn.")
        hidden = hidden + mlp(rms(hidden, sd[p + "post_attention_layernorm.weight"]), sd, p + "mlp.")
    return target.lm_head(hidden), hidden


# ---------------------------------------------------------------------------------- synthetic checkpoints
def llama_config(**extra):
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "hidden_size": HIDDEN,
        "initializer_range": 0.02, "intermediate_size": INTER, "max_position_embeddings": 2048,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "pad_token_id": 0, "bos_token_id": 1,
        "eos_token_id": 2, "rms_norm_eps": EPS, "rope_theta": THETA, "rope_scaling": None,
        "tie_word_embeddings": False, "torch_dtype": "float16", "transformers_version": "4.28.1", "use_cache": True,
        "vocab_size": VOCAB, **extra,
    }


def rand(*shape, gen):
    return torch.randn(*shape, generator=gen) * 0.2


def norm_weight(gen):
    return 1.0 + 0.3 * torch.randn(HIDDEN, generator=gen)


def layer_weights(prefix, gen, qkv_in=HIDDEN, input_norm=True):
    sd = {
        prefix + "self_attn.q_proj.weight": rand(HEADS * HEAD_DIM, qkv_in, gen=gen),
        prefix + "self_attn.k_proj.weight": rand(KV_HEADS * HEAD_DIM, qkv_in, gen=gen),
        prefix + "self_attn.v_proj.weight": rand(KV_HEADS * HEAD_DIM, qkv_in, gen=gen),
        prefix + "self_attn.o_proj.weight": rand(HIDDEN, HEADS * HEAD_DIM, gen=gen),
        prefix + "mlp.gate_proj.weight": rand(INTER, HIDDEN, gen=gen),
        prefix + "mlp.up_proj.weight": rand(INTER, HIDDEN, gen=gen),
        prefix + "mlp.down_proj.weight": rand(HIDDEN, INTER, gen=gen),
        prefix + "post_attention_layernorm.weight": norm_weight(gen),
    }
    if input_norm:
        sd[prefix + "input_layernorm.weight"] = norm_weight(gen)
    return sd


def eagle3_checkpoint(with_embeddings: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    sd = layer_weights("midlayer.", gen, qkv_in=2 * HIDDEN)
    sd["midlayer.hidden_norm.weight"] = norm_weight(gen)
    sd["fc.weight"] = rand(HIDDEN, 3 * HIDDEN, gen=gen)
    sd["norm.weight"] = norm_weight(gen)
    sd["lm_head.weight"] = rand(DRAFT_VOCAB, HIDDEN, gen=gen) * 5
    used = torch.randperm(VOCAB, generator=gen)[:DRAFT_VOCAB].sort().values
    sd["d2t"] = used - torch.arange(DRAFT_VOCAB)
    sd["t2d"] = torch.zeros(VOCAB, dtype=torch.bool)
    sd["t2d"][used] = True
    if with_embeddings:
        sd["embed_tokens.weight"] = rand(VOCAB, HIDDEN, gen=gen) * 5
    config = llama_config(architectures=[EAGLE3_ARCHITECTURE], num_hidden_layers=1, draft_vocab_size=DRAFT_VOCAB)
    return config, sd


def eagle1_checkpoint(num_layers: int = 2, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    sd = {"fc.weight": rand(HIDDEN, 2 * HIDDEN, gen=gen), "fc.bias": rand(HIDDEN, gen=gen),
          "embed_tokens.weight": rand(VOCAB, HIDDEN, gen=gen) * 5}
    for i in range(num_layers):
        sd.update(layer_weights(f"layers.{i}.", gen, input_norm=i > 0))
    return llama_config(num_hidden_layers=num_layers, bias=True), sd


def write(folder, config, sd):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    torch.save(sd, folder / "pytorch_model.bin")
    return folder


def assert_logits_equal(got, want):
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = torch.isfinite(want)
    assert torch.allclose(got[finite], want[finite], atol=1e-4)


# ------------------------------------------------------------------------------------------------- imports
@pytest.mark.parametrize("with_embeddings", [True, False], ids=["own-embeddings", "target-embeddings"])
def test_import_eagle3_matches_reference(target, tmp_path, with_embeddings):
    config, sd = eagle3_checkpoint(with_embeddings)
    config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}
    folder = write(tmp_path / "eagle3", config, sd)
    assert eagle_version(sd) == 3
    drafter = from_eagle(folder, target_model=target).eval()
    assert drafter.config.input_mode == "eagle3" and drafter.config.target_layers == [0, 1, 2]
    assert drafter.config.draft_vocab_size == DRAFT_VOCAB
    assert drafter.config.share_target_embeddings is (not with_embeddings)
    assert torch.equal(drafter.d2t, sd["d2t"] + torch.arange(DRAFT_VOCAB))
    gen = torch.Generator().manual_seed(1)
    tokens, states = torch.randint(0, VOCAB, (9,), generator=gen), torch.randn(9, 3 * HIDDEN, generator=gen)
    embedding = sd["embed_tokens.weight"] if with_embeddings else target.model.embed_tokens.weight.detach()
    want_logits, want_hidden = eagle3_reference(sd, embedding, tokens, states)
    with torch.no_grad():
        out = drafter(tokens[None], states[None])
        assert_logits_equal(drafter.target_logits(out.logits[0]), want_logits)
        assert torch.allclose(out.hidden_states[0], want_hidden, atol=1e-4)
        # the next depth feeds the output feature back: same layer, features instead of target states
        fed = drafter(tokens[None], features=out.hidden_states)
        emb = embedding[tokens]
        attn_in = torch.cat([rms(emb, sd["midlayer.input_layernorm.weight"]),
                             rms(want_hidden, sd["midlayer.hidden_norm.weight"])], dim=-1)
        again = want_hidden + attention(attn_in, sd, "midlayer.self_attn.")
        again = again + mlp(rms(again, sd["midlayer.post_attention_layernorm.weight"]), sd, "midlayer.mlp.")
        assert torch.allclose(fed.hidden_states[0], again, atol=1e-4)


def test_import_eagle3_target_layers(target):
    config, sd = eagle3_checkpoint(True)
    assert from_eagle(config=config, state_dict=sd, target_layers=[1, 2, 3]).config.target_layers == [1, 2, 3]
    with pytest.raises(ValueError, match="eagle_aux_hidden_state_layer_ids"):
        from_eagle(config=config, state_dict=sd)
    with pytest.raises(ValueError, match="at least 6"):
        from_eagle(config=config, state_dict=sd, target_model=target)  # the tiny target has 4 layers
    assert eagle3_default_target_layers(30) == [1, 14, 26]  # EAGLE-3 / vLLM read the inputs of layers 2, 15, 27
    with pytest.raises(ValueError, match="features"):
        from_eagle(config=config, state_dict=sd, target_layers=[1, 2])


def test_import_eagle3_rejects_inconsistent_maps():
    config, sd = eagle3_checkpoint(True)
    sd["t2d"] = ~sd["t2d"]
    with pytest.raises(ValueError, match="t2d"):
        from_eagle(config=config, state_dict=sd, target_layers=[0, 1, 2])


@pytest.fixture(scope="module")
def target_with_norm(target):
    """The tiny target with a non-trivial final-norm weight (fresh inits are all ones, hiding a missing copy)."""
    model = copy.deepcopy(target)
    with torch.no_grad():
        model.model.norm.weight.copy_(norm_weight(torch.Generator().manual_seed(9)))
    return model


@pytest.mark.parametrize("num_layers", [1, 2])
def test_import_eagle1_matches_reference(target_with_norm, tmp_path, num_layers):
    target = target_with_norm
    config, sd = eagle1_checkpoint(num_layers)
    folder = write(tmp_path / "eagle1", config, sd)
    assert eagle_version(sd) == 1
    drafter = from_eagle(folder, target_model=target).eval()
    assert drafter.config.target_layers == [-1] and drafter.config.share_target_lm_head
    assert drafter.config.num_hidden_layers == num_layers
    gen = torch.Generator().manual_seed(2)
    tokens, prenorm = torch.randint(0, VOCAB, (8,), generator=gen), torch.randn(8, HIDDEN, generator=gen) * 20
    with torch.no_grad():
        want_logits, want_hidden = eagle1_reference(sd, target, tokens, prenorm, num_layers)
        out = drafter(tokens[None], prenorm[None])
    assert torch.allclose(out.logits[0], want_logits, atol=1e-4)
    assert torch.allclose(out.hidden_states[0], want_hidden, atol=1e-4)


def test_import_eagle1_needs_the_target():
    config, sd = eagle1_checkpoint(1)
    with pytest.raises(ValueError, match="target_model"):
        from_eagle(config=config, state_dict=sd)


def test_unknown_layout_is_refused():
    with pytest.raises(ValueError, match="not an EAGLE checkpoint"):
        from_eagle(config=llama_config(), state_dict={"model.layers.0.mlp.up_proj.weight": torch.zeros(2, 2)})


# ---------------------------------------------------------------------------------------------------- export
def eagle3_drafter(target, **overrides) -> TreeSpecDrafterModel:
    torch.manual_seed(0)
    fields = dict(target_layers=[0, 1, 2], input_mode="eagle3", feature_norm=False, draft_vocab_size=DRAFT_VOCAB)
    config = TreeSpecDrafterConfig.for_target(target.config, **{**fields, **overrides})
    drafter = TreeSpecDrafterModel(config).eval()
    counts = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(5)).float()
    drafter.set_draft_vocab(build_draft_vocab(counts, DRAFT_VOCAB)[0])
    return drafter


def test_export_eagle3_layout_and_round_trip(target, tmp_path):
    drafter = eagle3_drafter(target)
    folder = to_eagle3(drafter, tmp_path / "export")
    config = json.loads((folder / "config.json").read_text())
    assert config["norm_before_fc"] is False
    assert config["architectures"] == [EAGLE3_ARCHITECTURE] and config["model_type"] == "llama"
    assert config["draft_vocab_size"] == DRAFT_VOCAB and config["vocab_size"] == VOCAB
    assert config["num_hidden_layers"] == 1 and config["target_hidden_size"] == HIDDEN
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    saved = load_file(str(folder / "model.safetensors"))
    assert set(saved) == EAGLE3_KEYS | {"embed_tokens.weight"}
    assert saved["midlayer.self_attn.q_proj.weight"].shape == (HEADS * HEAD_DIM, 2 * HIDDEN)
    assert saved["fc.weight"].shape == (HIDDEN, 3 * HIDDEN)
    assert torch.equal(saved["d2t"] + torch.arange(DRAFT_VOCAB), drafter.d2t)

    back = from_eagle(folder).eval()
    assert back.config.target_layers == [0, 1, 2] and torch.equal(back.d2t, drafter.d2t)
    ids, states = torch.randint(0, VOCAB, (2, 7)), torch.randn(2, 7, 3 * HIDDEN)
    with torch.no_grad():
        assert torch.allclose(back(ids, states).logits, drafter(ids, states).logits, atol=1e-6)


def _speculators():
    """speculators' EAGLE-3 converter and draft model, or a skip that says why they cannot be used here."""
    try:
        from speculators.convert.eagle.eagle3_converter import Eagle3Converter
        from speculators.models.eagle3 import Eagle3DraftModel
    except ImportError as error:  # setup.sh installs it (--no-deps: it pins an older transformers and CUDA extras)
        pytest.skip(f"speculators cannot be imported here ({error}); setup.sh installs it with its light dependencies")
    return Eagle3Converter, Eagle3DraftModel


def test_feature_norm_round_trips_as_norm_before_fc(target, tmp_path):
    """Our default feature norm leaves as EAGLE-3's norm_before_fc extension (its weight folded into fc) and comes
    back with the same logits."""
    drafter = eagle3_drafter(target, feature_norm=True)
    with torch.no_grad():
        drafter.feature_norm.weight.uniform_(0.5, 2.0)
    folder = to_eagle3(drafter, tmp_path / "export")
    assert json.loads((folder / "config.json").read_text())["norm_before_fc"] is True
    saved = load_file(str(folder / "model.safetensors"))
    assert torch.equal(saved["input_norm.weight"], torch.ones(3 * HIDDEN))  # its weight is folded into fc
    back = from_eagle(folder).eval()
    assert back.config.feature_norm
    ids, states = torch.randint(0, VOCAB, (2, 7)), torch.randn(2, 7, 3 * HIDDEN) * 50
    with torch.no_grad():
        assert torch.allclose(back(ids, states).logits, drafter(ids, states).logits, atol=1e-6)
        without = copy.deepcopy(drafter)
        without.feature_norm.weight.fill_(1.0)  # the norm matters: dropping its weights changes the logits
        assert not torch.allclose(without(ids, states).logits, drafter(ids, states).logits, atol=1e-3)


@pytest.mark.parametrize("feature_norm", [False, True])
def test_export_loads_in_speculators_with_equal_logits(target, tmp_path, feature_norm):
    """export-eagle3 -> speculators' own EAGLE-3 converter -> speculators' Eagle3DraftModel: same layer ids, same
    draft-vocabulary logits as our drafter on the same tokens and fused target features (one step, no unroll); a
    feature norm travels as speculators' norm_before_fc."""
    Eagle3Converter, Eagle3DraftModel = _speculators()
    drafter = eagle3_drafter(target, feature_norm=feature_norm)
    if feature_norm:
        with torch.no_grad():
            drafter.feature_norm.weight.uniform_(0.5, 2.0)
    target.save_pretrained(tmp_path / "target")
    folder = to_eagle3(drafter, tmp_path / "export")
    layer_ids = json.loads((folder / "config.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    Eagle3Converter().convert(folder, tmp_path / "speculators", base_model=str(tmp_path / "target"), validate=False,
                              eagle_aux_hidden_state_layer_ids=layer_ids)
    theirs = Eagle3DraftModel.from_pretrained(tmp_path / "speculators", attn_implementation="eager").eval()
    assert theirs.config.eagle_aux_hidden_state_layer_ids == layer_ids
    assert theirs.config.draft_vocab_size == DRAFT_VOCAB and torch.equal(theirs.d2t + torch.arange(DRAFT_VOCAB),
                                                                          drafter.d2t)
    length = 9
    ids, states = torch.randint(0, VOCAB, (1, length)), torch.randn(1, length, 3 * HIDDEN)
    logits = []
    hook = theirs.lm_head.register_forward_hook(lambda module, inputs, output: logits.append(output))
    with torch.no_grad():
        theirs(hidden_states=states, input_ids=ids, document_ids=torch.zeros(1, length, dtype=torch.long),
               position_ids=torch.arange(length)[None], ttt_steps=1)
        ours = drafter(ids, states).logits
    hook.remove()
    assert logits[0].shape == ours.shape == (1, length, DRAFT_VOCAB)
    assert torch.allclose(logits[0], ours, atol=1e-5)
    drafter.lm_head.weight.data[0, 0] += 1.0  # the comparison can fail: a changed weight changes our logits
    with torch.no_grad():
        assert not torch.allclose(logits[0], drafter(ids, states).logits, atol=1e-5)


def test_export_with_shared_target_modules(target, tmp_path):
    drafter = eagle3_drafter(target).tie_to_target(target, embeddings=True, lm_head=True)
    folder = to_eagle3(drafter, tmp_path / "shared")
    saved = load_file(str(folder / "model.safetensors"))
    assert set(saved) == EAGLE3_KEYS  # embeddings left to the server's target; head written as its draft rows
    assert torch.equal(saved["lm_head.weight"], target.lm_head.weight.detach()[drafter.d2t])
    back = from_eagle(folder, target_model=target).eval()
    assert back.config.share_target_embeddings and not back.config.share_target_lm_head
    ids, states = torch.randint(0, VOCAB, (1, 6)), torch.randn(1, 6, 3 * HIDDEN)
    with torch.no_grad():
        assert torch.allclose(back(ids, states).logits, drafter(ids, states).logits, atol=1e-5)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(input_mode="fc"), "input_mode"),
        (dict(feature_norm=True, feature_norm_eps=1e-3), "eps"),
        (dict(target_layers=[0, 1, -1]), "-1"),
        (dict(num_hidden_layers=2), "one decoder layer"),
    ],
)
def test_export_refuses_what_eagle3_cannot_express(target, tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        to_eagle3(eagle3_drafter(target, **overrides), tmp_path / "refused")


def test_imported_eagle3_head_drafts_losslessly(target, prompt):
    config, sd = eagle3_checkpoint(with_embeddings=False)
    drafter = from_eagle(config=config, state_dict=sd, target_model=target, target_layers=[0, 1, 2]).eval()
    ref = target.generate(prompt, do_sample=False, max_new_tokens=16)
    out = target.generate(prompt, do_sample=False, max_new_tokens=16, assistant_model=drafter, tree_policy="salf",
                          tree_budget=12, return_dict_in_generate=True)
    assert_drafted(out, accepting=False)  # a random EAGLE-3 head
    assert torch.equal(out.sequences, ref)
