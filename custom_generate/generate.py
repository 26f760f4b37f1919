"""hf_treespec's tree-speculative decoding as a Hub-layout ``custom_generate`` folder.

``model.generate(**inputs, custom_generate="<this repository's path or Hub id>", trust_remote_code=True,
assistant_model=drafter, tree_policy="salf")`` loads this file and calls `generate` with every argument of the
``generate`` call, ``assistant_model``, ``streamer`` and ``tokenizer`` included. It binds them for the tree loop
exactly as ``hf_treespec.enable`` does (``hf_treespec.generation.binding.bind_drafter``: the drafter and the streamer
go to ``tree_generate`` under the names it declares, stop strings become a stopping criterion) and runs stock
``generate`` with ``custom_generate=tree_generate``, so transformers still prepares the generation config, logits
processors, stopping criteria and cache. Needs ``hf_treespec`` installed (``requirements.txt``).
"""

from __future__ import annotations

from hf_treespec import tree_generate
from hf_treespec.generation.binding import bind_drafter


def generate(model, *args, **kwargs):
    """Stock ``generate`` of ``model``'s class with the tree loop as its decoding method (``tree_policy=`` and
    ``assistant_model=`` needed)."""
    return type(model).generate(model, *args, custom_generate=tree_generate, **bind_drafter(model, kwargs))
