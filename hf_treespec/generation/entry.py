"""`tree_generate`: the tree loop as a ``custom_generate`` callable of stock ``model.generate``.

``model.generate(ids, custom_generate=hf_treespec.tree_generate, assistant_model=drafter, tree_policy="salf")``
runs transformers' own preparation (generation config, logits processors, stopping criteria, cache) and then calls
this function for the decoding loop. transformers hands a callable the keyword arguments its signature declares
beyond those of the stock decoding methods, so every tree kwarg (``TREE_GENERATION_KWARGS``) is declared here; the
values are written onto the call's generation config, which is also where settings saved with
``model.generation_config`` come from.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

from transformers import GenerationConfig, GenerationMixin, LogitsProcessorList, StoppingCriteriaList

from .config import GENERATE_ONLY_KWARGS, TREE_GENERATION_KWARGS
from .loop import tree_speculative_decoding

_GENERATE_CODE = inspect.unwrap(GenerationMixin.generate).__code__


def _from_generate_call(name: str, depth: int = 2) -> Any:
    """``name`` as passed to the ``GenerationMixin.generate`` call that invoked the caller of this function.

    transformers (5.6 - 5.24, tested on both) builds a callable's keyword arguments only from the names its signature
    adds, taken out of generate's ``**kwargs``; ``assistant_model`` and ``streamer`` are named parameters of generate,
    so a callable never receives them. They are read from that one call's arguments, and only when the direct caller
    is transformers' ``generate`` itself (checked by code object), so nothing else is ever picked up. The Hub-layout
    folder (``custom_generate/`` of the repository) gets both from transformers and binds them, so it never gets here.
    """
    frame = sys._getframe(depth)
    try:
        if frame.f_code is _GENERATE_CODE:
            return frame.f_locals.get(name)
        return None
    finally:
        del frame


def tree_generate(
    model,
    input_ids,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    assistant_model=None,
    streamer=None,
    **kwargs,
):
    """Tree-speculative decoding loop for ``generate(custom_generate=tree_generate, ...)``.

    Takes every tree kwarg of ``hf_treespec.generation.TREE_GENERATION_KWARGS`` (``tree_policy`` is required, here or
    on the generation config) and needs ``assistant_model``. Returns what ``generate`` returns: the sequences, or a
    ``TreeSpecGenerateOutput`` with ``return_dict_in_generate=True``.
    """
    if assistant_model is None:
        assistant_model = _from_generate_call("assistant_model")
    if streamer is None:
        streamer = _from_generate_call("streamer")
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
    for unused in GENERATE_ONLY_KWARGS:
        kwargs.pop(unused, None)
    return tree_speculative_decoding(
        model, input_ids, logits_processor, stopping_criteria, generation_config,
        streamer=streamer, assistant_model=assistant_model, **kwargs,
    )


def _with_tree_kwargs(function) -> None:
    """Declares every tree kwarg as a keyword-only parameter of ``function``'s signature (one list: the config's),
    which is how ``generate`` knows to hand them over instead of rejecting them as unknown model kwargs."""
    signature = inspect.signature(function)
    params = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    extra = [inspect.Parameter(key, inspect.Parameter.KEYWORD_ONLY, default=None) for key in TREE_GENERATION_KWARGS]
    var_kw = [p for p in signature.parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD]
    function.__signature__ = signature.replace(parameters=params + extra + var_kw)


_with_tree_kwargs(tree_generate)
