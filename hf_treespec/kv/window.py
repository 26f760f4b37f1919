"""Sliding-window attention during tree speculation: full-length cache layers, the window applied by the tree mask.

A ``DynamicSlidingWindowLayer`` keeps only its last ``window - 1`` rows, so the rows of a tree appended to it evict
committed context, and a rejected branch cannot be taken back. While a tree loop runs, every sliding layer of the
cache is therefore replaced by a full-length ``DynamicLayer`` and the window is applied through the 4D tree mask
instead, with transformers' own rule (a query at position ``q`` sees a key at position ``k`` iff ``q - k < window``).
Plain causal forwards (the prefill, draft-free steps) get the same window from the model's own mask functions, which
read it from the config.

Memory cost: a sliding layer holds the whole context during the loop (as a layer without a window would) instead of
``window - 1`` rows; full-attention layers cost what they always cost. `TreeWindows.restore` gives the cache its
sliding layers back (their last ``window - 1`` rows) when the loop ends, so the caller gets the cache plain
``generate`` leaves.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

SLIDING, FULL = "sliding_attention", "full_attention"


class TreeWindows:
    """The sliding windows of one model's cache, and the tree masks that apply them.

    Attributes:
        window: the sliding window (tokens a query sees, itself included).
        sliding: per cache layer, whether it was a sliding-window layer.
        layer_types: the config's ``layer_types`` when sliding and full layers are mixed (the model then takes one mask
            per layer type), else None (every attention layer slides: one windowed mask serves them all).
    """

    def __init__(self, window: int, sliding: tuple[bool, ...], layer_types: tuple[str, ...] | None):
        self.window = window
        self.sliding = sliding
        self.layer_types = layer_types

    @classmethod
    def of(cls, config, cache: DynamicCache, role: str = "model") -> "TreeWindows | None":
        """The windows of ``cache`` (built by transformers for ``config``), or None when no layer slides. Raises a
        ValueError for layouts a tree mask cannot reproduce (chunked attention, several window sizes)."""
        text = config.get_text_config(decoder=True)
        layer_types = tuple(getattr(text, "layer_types", None) or ())
        if getattr(text, "attention_chunk_size", None) is not None or "chunked_attention" in layer_types:
            raise ValueError(
                f"The {role} ({type(config).__name__}) uses chunked attention, whose mask depends on chunk boundaries "
                "that tree speculation does not reproduce; decode it without tree_policy."
            )
        sliding = tuple(bool(getattr(layer, "is_sliding", False)) for layer in cache.layers)
        if not any(sliding):
            return None
        others = sorted({type(layer).__name__ for layer, s in zip(cache.layers, sliding)
                         if s and type(layer) is not DynamicSlidingWindowLayer})
        if others:
            raise ValueError(
                f"The {role}'s cache has {', '.join(others)} sliding layers; tree speculation can widen only "
                "DynamicCache's plain DynamicSlidingWindowLayer. Use the default dynamic cache (no "
                "cache_implementation) or decode without tree_policy."
            )
        windows = {int(layer.sliding_window) for layer, s in zip(cache.layers, sliding) if s}
        config_window = getattr(text, "sliding_window", None)
        if len(windows) != 1 or config_window is None or windows != {int(config_window)}:
            raise ValueError(
                f"The {role}'s cache has sliding windows {sorted(windows)} but its config says "
                f"sliding_window={config_window}; tree speculation applies one window from the config to every "
                "sliding layer, as the model's own masks do. Decode it without tree_policy."
            )
        if all(sliding):
            return cls(windows.pop(), sliding, None)
        if not layer_types or set(layer_types) - {SLIDING, FULL}:
            raise ValueError(
                f"The {role} mixes sliding and full-attention cache layers but its config's layer_types "
                f"{list(layer_types)} are not only {SLIDING!r} / {FULL!r}: tree speculation cannot tell which mask "
                "each layer reads. Decode it without tree_policy."
            )
        return cls(windows.pop(), sliding, layer_types)

    def full_length(self, cache: DynamicCache) -> None:
        """Replaces the sliding layers of the empty ``cache`` by full-length ``DynamicLayer`` s, in place."""
        if cache.get_seq_length() != 0:
            raise ValueError(
                "tree speculation over a sliding-window model needs an empty cache (a sliding layer that already "
                "dropped rows beyond its window cannot hold tree rows); do not pass a filled past_key_values."
            )
        for index, slides in enumerate(self.sliding):
            if slides:
                cache.layers[index] = DynamicLayer()

    def restore(self, cache: DynamicCache) -> None:
        """Turns the full-length layers back into sliding layers holding their last ``window - 1`` rows (what plain
        ``generate`` leaves), through the layer's own ``update``."""
        for index, slides in enumerate(self.sliding):
            layer = cache.layers[index]
            if not slides or isinstance(layer, DynamicSlidingWindowLayer):
                continue
            windowed = DynamicSlidingWindowLayer(sliding_window=self.window)
            if layer.keys is not None and layer.keys.numel():
                windowed.update(layer.keys, layer.values)
            cache.layers[index] = windowed

    def masks(
        self, mask: torch.Tensor, query_positions: torch.Tensor, key_positions: torch.Tensor
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """The attention mask(s) of a tree forward: ``mask`` ``[B, 1, q, kv]`` (additive, no window) with every key
        farther than the window from its query masked for the sliding layers. ``query_positions`` ``[q]`` (or
        ``[B, q]``, one row per batch row) and ``key_positions`` ``[kv]`` (or ``[B, kv]``) are the position ids of
        the mask's rows and columns. A dict keyed by layer type when sliding and full layers are mixed (the form
        transformers' hybrid models accept), else one tensor."""
        far = (query_positions.unsqueeze(-1) - key_positions.unsqueeze(-2)) >= self.window
        windowed = mask.masked_fill(far.unsqueeze(-3), torch.finfo(mask.dtype).min)
        if self.layer_types is None:
            return windowed
        return {SLIDING: windowed, FULL: mask}


def prepare(model, cache: DynamicCache, role: str = "model") -> TreeWindows | None:
    """The windows of ``model``'s ``cache``, its sliding layers made full-length for the tree loop (None when
    nothing slides: the cache is left as it is)."""
    windows = TreeWindows.of(model.config, cache, role=role)
    if windows is not None:
        windows.full_length(cache)
    return windows


def tree_inputs(kv, tree, nodes: torch.Tensor, dtype: torch.dtype, device, windows: TreeWindows | None):
    """``kv.inputs_for`` (a `~hf_treespec.kv.tree_kv.TreeKV`) with the sliding windows applied to its mask: ``input_ids``,
    ``position_ids`` and the mask (or the dict of masks) of a tree forward, on ``device``; one host-device copy."""
    if windows is None:
        return kv.inputs_for(tree, nodes, dtype, device=device)
    keys = kv.key_positions(tree, nodes)
    ids, positions, mask, keys = kv.inputs_for(tree, nodes, dtype, device=device, extra=(keys,))
    return ids, positions, windows.masks(mask, positions[0], keys)


def sliding_layers(cache) -> list[str]:
    """Class names of the sliding-window layers of ``cache`` (empty when none, or no cache): what code that appends
    tree rows to a cache it did not widen with `prepare` must refuse."""
    return [type(layer).__name__ for layer in getattr(cache, "layers", ()) if getattr(layer, "is_sliding", False)]
