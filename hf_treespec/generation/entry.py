"""`tree_generate`: the tree loop as a ``custom_generate`` callable of stock ``model.generate``.

``model.generate(ids, custom_generate=hf_treespec.tree_generate, tree_drafter=drafter, tree_policy="salf")`` runs
transformers' own preparation (generation config, logits processors, stopping criteria, cache) and then calls this
function for the decoding loop. transformers hands a callable the keyword arguments its signature declares beyond
those of the stock decoding methods, so every tree kwarg (``TREE_GENERATION_KWARGS``) is declared here, and so are
the drafter and the streamer, under the names `binding` defines (``tree_drafter``, ``tree_streamer``: transformers
never passes ``assistant_model`` or ``streamer`` to a callable). ``hf_treespec.enable`` and the Hub-layout folder
accept ``assistant_model=`` / ``streamer=`` and rename them with `binding.bind_drafter`. The tree kwargs' values are
written onto the call's generation config, which is also where settings saved with ``model.generation_config`` come
from.
"""

from __future__ import annotations

import inspect

from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

from .binding import DRAFTER_KWARG, STREAMER_KWARG, take_bound
from .config import GENERATE_ONLY_KWARGS, TREE_GENERATION_KWARGS
from .loop import tree_speculative_decoding


def tree_generate(
    model,
    input_ids,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    **kwargs,
):
    """Tree-speculative decoding loop for ``generate(custom_generate=tree_generate, ...)``.

    Takes every tree kwarg of ``hf_treespec.generation.TREE_GENERATION_KWARGS`` (``tree_policy`` is required, here or
    on the generation config), the drafter as ``tree_drafter=`` (required) and a streamer as ``tree_streamer=``
    (`binding`). Returns what ``generate`` returns: the sequences, or a ``TreeSpecGenerateOutput`` with
    ``return_dict_in_generate=True``.
    """
    for key in TREE_GENERATION_KWARGS:
        value = kwargs.pop(key, None)
        if value is not None:
            setattr(generation_config, key, value)
    if getattr(generation_config, "tree_policy", None) is None:
        from ..policies import POLICIES

        raise ValueError(
            "custom_generate=tree_generate needs tree_policy= (in the call or on the generation config); valid: "
            f"{', '.join(POLICIES.names())}."
        )
    drafter, streamer = take_bound(kwargs)
    for unused in GENERATE_ONLY_KWARGS:
        kwargs.pop(unused, None)
    if streamer is not None and input_ids.shape[0] == 1:  # a batch with a streamer is refused by the loop
        streamer.put(input_ids.cpu())  # the prompt, as plain generate puts it before decoding
    return tree_speculative_decoding(
        model, input_ids, logits_processor, stopping_criteria, generation_config,
        streamer=streamer, assistant_model=drafter, **kwargs,
    )


def _with_tree_kwargs(function) -> None:
    """Declares the drafter, the streamer and every tree kwarg as keyword-only parameters of ``function``'s signature
    (one list: the config's), which is how ``generate`` knows to hand them over instead of rejecting them as unknown
    model kwargs."""
    signature = inspect.signature(function)
    params = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    extra = [inspect.Parameter(key, inspect.Parameter.KEYWORD_ONLY, default=None)
             for key in (DRAFTER_KWARG, STREAMER_KWARG, *TREE_GENERATION_KWARGS)]
    var_kw = [p for p in signature.parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD]
    function.__signature__ = signature.replace(parameters=params + extra + var_kw)


_with_tree_kwargs(tree_generate)
