"""Names that moved between the transformers releases this package supports.

transformers 5.24 renamed the KV cache everywhere from ``past_key_values`` to ``cache``: the keyword of model /
decoder-layer forwards and ``create_causal_mask``, the field of model outputs and the key ``generate`` puts in its
model kwargs. The old names still work there with a deprecation warning (removed in 5.40), except in one place that
breaks at once: a ``ModelOutput`` subclass declaring a ``past_key_values`` field. Everything in this package that
passes or reads a cache goes through the two names below, read once from the installed release.
"""

from __future__ import annotations

import inspect
from typing import Any

from transformers.masking_utils import create_causal_mask

#: the keyword (and ``generate`` model-kwargs key) under which the installed transformers passes a KV cache
CACHE_KWARG: str = "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"


def output_cache(outputs: Any) -> Any:
    """The cache a model output carries (``outputs.cache`` from transformers 5.24, ``outputs.past_key_values``
    before), or None. Reads the output as the mapping every ``ModelOutput`` is, so no deprecated alias is touched."""
    for name in ("cache", "past_key_values"):
        if name in outputs:
            return outputs[name]
    return None
