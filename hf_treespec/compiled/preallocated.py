"""`PreallocatedLayer`: a ``DynamicLayer`` whose rows live in one preallocated buffer, for compiled forwards.

A ``DynamicLayer`` grows by ``torch.cat``: every step copies the whole cache and hands a compiled graph a new tensor.
Here the rows live in a buffer of ``capacity`` rows and ``keys`` / ``values`` are *views* of the used rows, so
everything that reads or edits a ``DynamicLayer`` works unchanged: writing through ``layer.keys[...]`` writes the
buffer, and cutting with ``layer.keys = layer.keys[..., :n, :]`` (`hf_treespec.kv.tree_kv.keep_rows`, `RaggedKV`,
``crop``) keeps a view of it.

Two ways to write a forward's new rows:
- a plain forward (the prefill, any eager forward): right after the used rows, ``keys`` / ``values`` then view them;
- a compiled step: at the buffer columns `WriteSlots.index` names (set by `CompiledForward` for the call only), and
  the *whole* buffers are returned, the mask covering every column. The index, not whether dynamo is tracing,
  selects this: a step that dynamo runs eagerly (past its recompile limit) computes the same thing. The graph thus reads and writes only the
  buffers, never their views (inputs aliasing each other are what AOT autograd cannot always trace with dynamic
  sizes), and its KV length is the buffer's capacity, a dynamic dimension that changes only when a buffer grows.

`reserve` runs eagerly before every compiled forward: it grows a buffer that would overflow, and re-adopts a layer
whose ``keys`` an editor replaced by a tensor of its own (``RaggedKV.retire`` selects batch rows into a new tensor).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer


def _mark_dynamic(tensor: torch.Tensor, dim: int) -> None:
    """Tells ``torch.compile`` that ``tensor``'s ``dim`` varies, so a new size is not a new graph."""
    torch._dynamo.maybe_mark_dynamic(tensor, dim)


class WriteSlots:
    """The buffer columns a compiled forward writes its new rows to (one index shared by every layer of a cache)."""

    def __init__(self) -> None:
        self.index: torch.Tensor | None = None


class BufferRows:
    """``keys`` / ``values`` of a `PreallocatedLayer`: a view of the first rows of its buffer, made when read (a step
    that moves the used length sets one integer per layer instead of slicing two views per layer: 60 slices a step
    for SmolLM2's 30 layers). Any other tensor assigned is held as it is (`PreallocatedLayer.reserve` re-adopts it)."""

    def __init__(self, buffer: str):
        self.buffer = buffer

    def __set_name__(self, owner, name: str) -> None:
        self.rows, self.held = f"_{name}_rows", f"_{name}_held"

    def __get__(self, layer, owner=None):
        if layer is None:
            return self
        rows = layer.__dict__.get(self.rows)
        if rows is None:
            return layer.__dict__.get(self.held)
        return getattr(layer, self.buffer).narrow(2, 0, rows)

    def __set__(self, layer, value) -> None:
        buffer = layer.__dict__.get(self.buffer)
        if value is not None and buffer is not None and _prefix_of(value, buffer):
            layer.__dict__[self.rows], layer.__dict__[self.held] = value.shape[2], None
        else:
            layer.__dict__[self.rows], layer.__dict__[self.held] = None, value


def _prefix_of(view: torch.Tensor, buffer: torch.Tensor) -> bool:
    """Whether ``view`` is the first rows of ``buffer`` (same start, batch, heads and strides)."""
    return (view.data_ptr() == buffer.data_ptr() and view.shape[:2] == buffer.shape[:2]
            and view.shape[3:] == buffer.shape[3:] and view.stride() == buffer.stride())


class PreallocatedLayer(DynamicLayer):
    """One layer's keys and values in buffers of ``capacity`` rows; ``keys`` / ``values`` view the first rows."""

    keys = BufferRows("key_buffer")
    values = BufferRows("value_buffer")

    def __init__(self, capacity: int, slots: WriteSlots | None = None):
        super().__init__()
        if capacity < 1:
            raise ValueError(f"PreallocatedLayer needs a capacity of at least one row, got {capacity}.")
        self.capacity = capacity
        self.slots = slots if slots is not None else WriteSlots()
        self.key_buffer: torch.Tensor | None = None
        self.value_buffer: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self._allocate(key_states, value_states, max(self.capacity, key_states.shape[-2]))
        self.view_rows(0)
        self.is_initialized = True

    def _allocate(self, keys_like: torch.Tensor, values_like: torch.Tensor, capacity: int) -> None:
        batch, heads = keys_like.shape[:2]
        self.key_buffer = keys_like.new_zeros(batch, heads, capacity, keys_like.shape[-1])
        self.value_buffer = values_like.new_zeros(batch, values_like.shape[1], capacity, values_like.shape[-1])
        for buffer in (self.key_buffer, self.value_buffer):
            _mark_dynamic(buffer, 0)
            _mark_dynamic(buffer, 2)
        self.capacity = capacity

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.slots.index is not None:  # a compiled step (traced, or run eagerly by a dynamo that gave up)
            self.key_buffer.index_copy_(2, self.slots.index, key_states)
            self.value_buffer.index_copy_(2, self.slots.index, value_states)
            return self.key_buffer, self.value_buffer
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        else:
            self.reserve(key_states.shape[-2])
        length, new = self.rows_in_buffers, key_states.shape[-2]
        index = torch.arange(length, length + new, device=key_states.device)
        self.key_buffer.index_copy_(2, index, key_states)
        self.value_buffer.index_copy_(2, index, value_states)
        self.view_rows(length + new)
        return self.keys, self.values

    @property
    def rows_in_buffers(self) -> int | None:
        """How many first rows of the buffers ``keys`` / ``values`` view; None when they hold tensors of their own.
        Editors read it (and write the buffers) instead of reading ``keys``, which makes a view per read."""
        rows = self.__dict__.get("_keys_rows")
        return rows if rows is not None and rows == self.__dict__.get("_values_rows") else None

    def reserve(self, new_rows: int) -> None:
        """Makes room for ``new_rows`` more rows (doubling the capacity when it must grow) and makes ``keys`` /
        ``values`` views of the buffers again; eager, before a compiled forward."""
        if not self.is_initialized:
            return
        rows = self.rows_in_buffers
        if rows is not None and rows + new_rows <= self.capacity:
            return
        keys, values = self.keys, self.values
        length = keys.shape[-2]
        needed = length + new_rows
        capacity = self.capacity if needed <= self.capacity else max(needed, 2 * self.capacity)
        self._allocate(keys, values, capacity)
        self.key_buffer[..., :length, :] = keys
        self.value_buffer[..., :length, :] = values
        self.view_rows(length)

    def view_rows(self, length: int) -> None:
        """``keys`` / ``values`` become views of the buffers' first ``length`` rows (after a compiled forward wrote
        its rows into the buffers)."""
        self.__dict__.update(_keys_rows=length, _values_rows=length, _keys_held=None, _values_held=None)

    def keep(self, start: int, rows: torch.Tensor | None, count: int) -> None:
        """Keeps the first ``start`` rows and then ``count`` more: the buffer rows ``rows`` (moved right after the
        first ``start``; None: the rows already there). `hf_treespec.kv.tree_kv.keep_rows` for this layer, one index
        copy per buffer and no view."""
        if rows is not None:
            target = torch.arange(start, start + count, device=rows.device)
            self.key_buffer.index_copy_(2, target, self.key_buffer.index_select(2, rows))
            self.value_buffer.index_copy_(2, target, self.value_buffer.index_select(2, rows))
        self.view_rows(start + count)


def preallocate(cache, capacity: int) -> None:
    """Replaces every layer of the empty ``cache`` (a ``DynamicCache`` of full-attention layers) by a
    `PreallocatedLayer` of ``capacity`` rows, in place."""
    if cache.get_seq_length() != 0:
        raise ValueError("preallocate needs an empty cache; do not pass a filled past_key_values to a compiled run.")
    slots = WriteSlots()
    for index, layer in enumerate(cache.layers):
        if type(layer) is not DynamicLayer:
            raise ValueError(
                f"a compiled forward needs a DynamicCache of plain DynamicLayers; layer {index} is a "
                f"{type(layer).__name__}."
            )
        cache.layers[index] = PreallocatedLayer(capacity, slots)


def reserve(cache, new_rows: int) -> None:
    """`PreallocatedLayer.reserve` on every layer of ``cache``."""
    for layer in cache.layers:
        layer.reserve(new_rows)


def start_empty(cache, batch: int, layout: list[tuple[torch.Size, torch.Size, torch.dtype]],
                device: torch.device) -> None:
    """Allocates the buffers of every layer of the empty preallocated ``cache`` for ``batch`` rows, holding no rows
    yet, so that a compiled forward writes the prompt itself. ``layout``: per layer, the key and value shape of one
    row (heads, head size) and their dtype, as an eager forward gave them (`CompiledForward.warm_up` records them)."""
    for layer, (key_shape, value_shape, dtype) in zip(cache.layers, layout):
        keys = torch.empty(batch, key_shape[0], 0, key_shape[1], dtype=dtype, device=device)
        values = torch.empty(batch, value_shape[0], 0, value_shape[1], dtype=dtype, device=device)
        layer.lazy_initialization(keys, values)
