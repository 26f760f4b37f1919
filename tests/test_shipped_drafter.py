"""The drafter shipped inside the package: Hub layout, size limit, and lossless greedy decoding on the real target."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

import hf_treespec
from hf_treespec.assets import default_drafter, load_questions, load_target, shipped_drafter_path
from hf_treespec.drafters import TreeSpecDrafterConfig

MAX_SHIPPED_BYTES = 20 * 1024 * 1024


def test_shipped_drafter_has_hub_layout_and_fits_the_size_limit():
    folder = shipped_drafter_path()
    for name in ("config.json", "model.safetensors", "README.md"):
        assert (folder / name).is_file(), f"{name} missing from {folder}"
    total = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
    assert total <= MAX_SHIPPED_BYTES, f"shipped drafter is {total / 2**20:.1f} MiB (limit 20)"
    config = AutoConfig.from_pretrained(folder)
    assert isinstance(config, TreeSpecDrafterConfig)
    assert config.share_target_lm_head and config.share_target_embeddings  # the big matrices come from the target
    card = (folder / "README.md").read_text()
    assert "tau" in card and "hf-treespec" in card


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
