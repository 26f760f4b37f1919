"""hf_treespec's tree-speculative decoding as a Hub-layout ``custom_generate`` folder.

``model.generate(**inputs, custom_generate="<this repository's path or Hub id>", trust_remote_code=True,
assistant_model=drafter, tree_policy="salf")`` loads this file and calls `generate` with every argument of the
``generate`` call, ``assistant_model`` and ``streamer`` included. It hands them to the tree loop bound in the callable
it passes to stock ``generate``, so transformers still prepares the generation config, logits processors, stopping
criteria and cache, and the loop never has to look for them in the caller's frame.
"""

from __future__ import annotations

import functools

from hf_treespec import tree_generate


def generate(model, *args, assistant_model=None, streamer=None, **kwargs):
    """Stock ``generate`` of ``model``'s class with the tree loop as its decoding method (``tree_policy=`` needed)."""
    if assistant_model is None:
        raise ValueError(
            "custom_generate=<hf_treespec folder> needs assistant_model= (a drafter: "
            "hf_treespec.assets.default_drafter(model), or hf_treespec.drafters.prompt_lookup(model) for no model)."
        )
    loop = functools.partial(tree_generate, assistant_model=assistant_model, streamer=streamer)
    return type(model).generate(model, *args, custom_generate=loop, assistant_model=assistant_model, streamer=streamer,
                                **kwargs)
