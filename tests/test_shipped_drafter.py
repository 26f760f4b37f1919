"""The drafter shipped inside the package: Hub layout, size limit, and lossless greedy decoding on the real target;
its bundled delay selector (the default of ``tree_policy="nde"``) and the card section describing it."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, GenerationConfig

import hf_treespec
from hf_treespec.assets import (
    default_drafter,
    load_questions,
    load_target,
    shipped_delay_selector_path,
    shipped_drafter_path,
)
from hf_treespec.drafters import TreeSpecDrafterConfig, as_drafter
from hf_treespec.generation.components import resolve
from hf_treespec.model_card import make_card
from hf_treespec.policies import DelaySelector, DelaySelectorConfig
from hf_treespec.policies.nde import LATENCY_FEATURES, SELECTOR_SUBFOLDER, Action

MAX_SHIPPED_BYTES = 20 * 1024 * 1024


def test_shipped_drafter_has_hub_layout_and_fits_the_size_limit():
    folder = shipped_drafter_path()
    for name in ("config.json", "model.safetensors", "README.md"):
        assert (folder / name).is_file(), f"{name} missing from {folder}"
    total = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())  # the delay selector included
    assert total <= MAX_SHIPPED_BYTES, f"shipped drafter is {total / 2**20:.1f} MiB (limit 20)"
    config = AutoConfig.from_pretrained(folder)
    assert isinstance(config, TreeSpecDrafterConfig)
    assert config.share_target_lm_head and config.share_target_embeddings  # the big matrices come from the target
    card = (folder / "README.md").read_text()
    assert "tau" in card and "hf-treespec" in card
    assert "## Delay selector" in card and 'tree_policy="nde"' in card and "default_drafter(model)" in card


def test_shipped_delay_selector_is_sane():
    folder = shipped_delay_selector_path()
    assert folder == shipped_drafter_path() / SELECTOR_SUBFOLDER
    assert {"config.json", "model.safetensors"} <= {f.name for f in folder.iterdir()}
    selector = DelaySelector.from_pretrained(folder)
    config = selector.config
    drafter_config = AutoConfig.from_pretrained(shipped_drafter_path())
    assert config.hidden_inputs == {"target_hidden": drafter_config.target_hidden_size}  # the shipped target's width
    assert config.standardised and config.verifier == "specinfer"
    assert not set(LATENCY_FEATURES) & set(config.scalar_features)  # no machine-specific inputs shipped
    actions = selector.actions
    assert len(actions) == len(set(actions)) > 1 and all(a == Action(*a).checked() for a in actions)
    assert any(a.paths > 1 for a in actions)  # real trees, so the i.i.d. verifiers matter
    baseline = Action(*config.baseline_actions["T=1,top_p=1"])
    assert baseline in actions
    for name, buffer in selector.state_dict().items():
        assert torch.isfinite(buffer).all(), name
    assert bool((selector.scalar_std > 0).all() and (selector.target_hidden_std > 0).all())
    torch.manual_seed(0)
    logits = selector(torch.randn(8, len(config.scalar_features)), target_hidden=torch.randn(8, 576))
    assert logits.shape == (8, len(actions)) and torch.isfinite(logits).all()


def test_card_selector_section_is_optional_and_checked():
    config = AutoConfig.from_pretrained(shipped_drafter_path())
    common = dict(base_model="HuggingFaceTB/SmolLM2-135M-Instruct", data="d", objective="o",
                  draft_vocab_size=config.draft_vocab_size, results={"tau": 2.0}, command="c")
    without = make_card(config, **common).content
    assert "Delay selector" not in without and without.endswith("rounds differently.\n")
    described = {"data": "351 roots", "objective": "throughput ratio", "results": "1.06x"}
    card = make_card(config, repo_id="me/drafter", delay_selector={**described, "command": "hf-treespec train nde"},
                     **common).content
    section = card[card.index("## Delay selector"):]
    assert 'tree_policy="nde"' in section and 'snapshot_download("me/drafter")' in section
    assert "351 roots" in section and "throughput ratio" in section and "1.06x" in section
    assert "hf-treespec train nde" in section and "{{" not in card
    local = make_card(config, delay_selector=described, **common).content
    assert "snapshot_download" not in local and "Trained with" not in local
    with pytest.raises(ValueError, match="missing \\['results'\\]"):
        make_card(config, delay_selector={"data": "d", "objective": "o"}, **common)


def test_card_c2t_section_is_optional_and_checked():
    config = AutoConfig.from_pretrained(shipped_drafter_path())
    common = dict(base_model="HuggingFaceTB/SmolLM2-135M-Instruct", data="d", objective="o",
                  draft_vocab_size=config.draft_vocab_size, results={"tau": 2.0}, command="c")
    assert "Confidence classifier" not in make_card(config, **common).content
    described = {"data": "125 prompts", "objective": "BCE", "results": "tau 1.5", "command": "hf-treespec train c2t"}
    card = make_card(config, c2t_classifier=described, **common).content
    section = card[card.index("## Confidence classifier"):]
    assert 'tree_policy="c2t"' in section and "125 prompts" in section and "hf-treespec train c2t" in section
    with pytest.raises(ValueError, match="c2t_classifier must give"):
        make_card(config, c2t_classifier={"data": "d"}, **common)


def test_shipped_c2t_classifier_loads():
    from hf_treespec.policies.c2t import CLASSIFIER_SUBFOLDER, C2TClassifier

    classifier = C2TClassifier.from_pretrained(shipped_drafter_path() / CLASSIFIER_SUBFOLDER)
    assert classifier.config.standardised
    confidence = classifier.confidence(torch.tensor([[0.9, 0.5, 1.0], [0.001, 6.0, 5.0]]))
    assert confidence[0] > confidence[1]  # a likely shallow node is trusted more than an unlikely deep one


def test_unknown_target_has_no_shipped_drafter():
    with pytest.raises(ValueError, match="no drafter ships"):
        shipped_drafter_path("llama-70b")


@pytest.mark.real_model
def test_default_drafter_is_lossless_on_the_real_target():
    """fp32: SALF with the shipped drafter reproduces plain greedy generate token for token, and accepts drafts."""
    model, tok = load_target(dtype=torch.float32)
    model = hf_treespec.enable(model)
    drafter = default_drafter(model)
    question = load_questions(limit=1)[0]
    ids = tok.apply_chat_template([{"role": "user", "content": question.turns[0]}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    plain = model.generate(ids, max_new_tokens=32, do_sample=False)
    out = model.generate(ids, assistant_model=drafter, tree_policy="salf", tree_budget=8, max_new_tokens=32,
                         do_sample=False, return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain)
    assert sum(out.accepted_lengths) / len(out.accepted_lengths) > 1.0


@pytest.mark.real_model
def test_nde_uses_the_selector_shipped_with_the_drafter():
    """No tree_selector: tree_policy="nde" takes the drafter's bundled selector; fp32 greedy equals plain generate,
    sampling runs, and an explicit tree_selector still wins."""
    model, tok = load_target(dtype=torch.float32)
    model = hf_treespec.enable(model)
    drafter = default_drafter(model)
    policy, verifier = resolve(GenerationConfig(do_sample=True, tree_policy="nde"), as_drafter(drafter))
    assert policy.params["tree_selector"] == str(shipped_delay_selector_path()) and verifier.name == "specinfer"
    question = load_questions(limit=1)[0]
    ids = tok.apply_chat_template([{"role": "user", "content": question.turns[0]}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    plain = model.generate(ids, max_new_tokens=16, do_sample=False)
    out = model.generate(ids, assistant_model=drafter, tree_policy="nde", max_new_tokens=16, do_sample=False,
                         return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain) and max(out.accepted_lengths) > 1
    torch.manual_seed(0)
    sampled = model.generate(ids, assistant_model=drafter, tree_policy="nde", max_new_tokens=16, do_sample=True,
                             return_dict_in_generate=True)
    assert sampled.sequences.shape == (1, ids.shape[1] + 16)
    assert sum(sampled.accepted_lengths) == 15  # every token after the prefill's came out of a tree step
    chain = DelaySelector(DelaySelectorConfig(actions=[[1, 0, 1]], hidden_inputs={"target_hidden": 576})).eval()
    torch.manual_seed(0)
    explicit = model.generate(ids, assistant_model=drafter, tree_policy="nde", tree_selector=chain, max_new_tokens=16,
                              do_sample=True, return_dict_in_generate=True)
    assert set(explicit.tree_sizes) == {1}  # the one-node chain of the explicit selector, not the bundled trees


@pytest.mark.real_model
def test_shipped_drafter_exports_to_eagle3_and_loads_in_speculators(tmp_path):
    """The shipped drafter leaves through export-eagle3 (its feature norm as norm_before_fc) and speculators'
    Eagle3DraftModel gives its draft-vocabulary logits on the same tokens and target features."""
    try:
        from speculators.convert.eagle.eagle3_converter import Eagle3Converter
        from speculators.models.eagle3 import Eagle3DraftModel
    except ImportError as error:  # setup.sh installs it (--no-deps: it pins an older transformers and CUDA extras)
        pytest.skip(f"speculators cannot be imported here ({error})")
    from hf_treespec.drafters import to_eagle3

    model, _ = load_target(dtype=torch.float32)
    drafter = default_drafter(model).float().eval()
    assert drafter.config.feature_norm  # the case the plain EAGLE-3 layout could not express
    model.save_pretrained(tmp_path / "target")
    folder = to_eagle3(drafter, tmp_path / "export")
    Eagle3Converter().convert(folder, tmp_path / "speculators", base_model=str(tmp_path / "target"), validate=False)
    theirs = Eagle3DraftModel.from_pretrained(tmp_path / "speculators", attn_implementation="eager").eval()
    assert theirs.config.norm_before_fc
    # the export leaves the shared embeddings out (servers use the target's): give speculators' model the target's
    with torch.no_grad():
        theirs.embed_tokens.weight.copy_(model.get_input_embeddings().weight)
    torch.manual_seed(0)
    length = 12
    ids = torch.randint(0, model.config.vocab_size, (1, length))
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True).hidden_states  # [i + 1] = output of layer i
        states = torch.cat([hidden[i + 1] for i in drafter.config.target_layers], dim=-1)
        assert states.shape[-1] == 3 * model.config.hidden_size
        logits = []
        hook = theirs.lm_head.register_forward_hook(lambda module, inputs, output: logits.append(output))
        theirs(hidden_states=states, input_ids=ids, document_ids=torch.zeros(1, length, dtype=torch.long),
               position_ids=torch.arange(length)[None], ttt_steps=1)
        hook.remove()
        ours = drafter(ids, states).logits
    assert logits[0].shape == ours.shape
    assert torch.allclose(logits[0], ours, atol=1e-3, rtol=1e-3), float((logits[0] - ours).abs().max())
