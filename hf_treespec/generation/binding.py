"""How the drafter and the streamer of a ``generate`` call reach the tree loop: one rule, :func:`bind_drafter`.

transformers (5.6 - 5.24) hands a ``custom_generate`` *callable* only the keyword arguments its signature declares
beyond those of ``GenerationMixin._sample``, taken from generate's ``**kwargs``. ``assistant_model``, ``streamer``
and ``tokenizer`` never get there: the first two are named parameters of ``generate``, the third is taken out for
generate's own use. And an ``assistant_model`` named to ``generate`` selects transformers' assisted mode, whose
checks refuse ``num_return_sequences > 1`` before any custom loop runs.

The rule: the tree loop's drafter and streamer travel under two names that ``tree_generate`` declares,
``tree_drafter`` and ``tree_streamer``, so transformers passes them through like any tree kwarg and never sees an
assistant model. :func:`bind_drafter` rewrites a ``generate`` call's keyword arguments to that form; it is what
``hf_treespec.enable`` and the Hub-layout folder (``custom_generate/generate.py``) call, and a caller of the bare
``custom_generate=hf_treespec.tree_generate`` form writes those two names itself. ``tree_generate`` takes them back
with :func:`take_bound`. Nothing reads a caller's stack frame, and transformers is not patched.
"""

from __future__ import annotations

from typing import Any

from transformers import StoppingCriteriaList, StopStringCriteria

#: the ``tree_generate`` parameter that carries the drafter (``generate``'s ``assistant_model``)
DRAFTER_KWARG = "tree_drafter"
#: the ``tree_generate`` parameter that carries the streamer (``generate``'s ``streamer``)
STREAMER_KWARG = "tree_streamer"

NO_DRAFTER = (
    "tree_policy needs a drafter: pass assistant_model= (with hf_treespec.enable(model) or the custom_generate "
    "folder) or tree_drafter= (with custom_generate=hf_treespec.tree_generate, which transformers does not hand "
    "assistant_model). Drafters: hf_treespec.drafters.prompt_lookup(model) drafts from the prompt with no model; a "
    "trained TreeSpecDrafterModel, e.g. hf_treespec.assets.default_drafter(model) for SmolLM2 or one from "
    "`hf-treespec train`; or a small AutoModelForCausalLM sharing the vocabulary."
)


def bind_drafter(model, kwargs: dict[str, Any]) -> dict[str, Any]:
    """A ``generate`` call's keyword arguments, rewritten for ``generate(custom_generate=tree_generate, ...)``.

    - ``assistant_model`` moves to ``tree_drafter`` and ``streamer`` to ``tree_streamer`` (the loop puts the prompt
      and every new token into it, then ends it, as plain ``generate`` does);
    - ``tokenizer`` with ``stop_strings`` (in the call, or on its generation config) becomes the
      ``StopStringCriteria`` generate would have built, added to ``stopping_criteria``; a ``tokenizer`` without stop
      strings is dropped (nothing else in the tree loop reads it).

    Everything else passes unchanged. ``model`` is the target (its ``generation_config`` is read when the call names
    none). Returns a new dict; ``kwargs`` is not modified. Naming the drafter twice (both ``assistant_model`` and
    ``tree_drafter``, or both streamers) is an error.
    """
    kwargs = dict(kwargs)
    for generate_name, loop_name in (("assistant_model", DRAFTER_KWARG), ("streamer", STREAMER_KWARG)):
        value = kwargs.pop(generate_name, None)
        if value is None:
            continue
        if kwargs.get(loop_name) is not None:
            raise ValueError(f"pass {generate_name}= or {loop_name}=, not both.")
        kwargs[loop_name] = value
    tokenizer = kwargs.pop("tokenizer", None)
    config = kwargs.get("generation_config") or model.generation_config
    stop_strings = kwargs["stop_strings"] if "stop_strings" in kwargs else getattr(config, "stop_strings", None)
    if stop_strings is not None and tokenizer is not None:
        criteria = StoppingCriteriaList(kwargs.get("stopping_criteria") or [])
        criteria.append(StopStringCriteria(tokenizer, [stop_strings] if isinstance(stop_strings, str) else stop_strings))
        kwargs["stopping_criteria"], kwargs["stop_strings"] = criteria, None
    return kwargs


def take_bound(kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """``(drafter, streamer)`` taken out of ``tree_generate``'s keyword arguments (the names :func:`bind_drafter`
    writes); raises the one error that says how to pass a drafter when there is none."""
    drafter, streamer = kwargs.pop(DRAFTER_KWARG, None), kwargs.pop(STREAMER_KWARG, None)
    if drafter is None:
        raise ValueError(NO_DRAFTER)
    return drafter, streamer
