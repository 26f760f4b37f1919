"""`SyncCounter`: counts, per decoding step, the operations that would make the host wait for an accelerator.

Why: on a GPU every device -> host read (``.item()``, ``.cpu()``, ``.tolist()``, a data-dependent shape such as
``nonzero``) and every blocking host -> device copy stalls the host until the device has caught up, so a decoding
step's host work cannot overlap the device's. ``torch.cuda.set_sync_debug_mode`` counts them only where a GPU exists;
this counter counts the same operations on any device, the CPU included, so a test can hold the loop to a budget.

How: inside ``with SyncCounter(target, drafter) as counter:`` a ``TorchDispatchMode`` tags "device tensors" (the
parameters and buffers of the modules given, tensors passed to `SyncCounter.mark`, e.g. ``generate``'s inputs, every
output of an op that read a device tensor, and every tensor that lives on a non-CPU device) and records transfers:

* a **read** (device -> host) for: ``aten._local_scalar_dense`` / ``aten.item`` on a device tensor (``.item()``,
  ``int()``, ``float()``, ``bool()``, ``if tensor:``), ``nonzero`` / ``masked_select`` / ``unique*`` / ``repeat_interleave``
  without ``output_size`` / ``bincount`` / boolean-mask indexing of a device tensor (output sizes that only the
  device knows), ``torch.equal`` / ``is_nonzero`` on device tensors, a ``copy_`` from a device tensor into a host
  one; and, seen by a ``TorchFunctionMode``, ``.cpu()``, ``.tolist()`` and ``.numpy()`` of a device tensor (``.cpu()``
  then returns a host copy that is no longer tagged, as it would be on a GPU);
* a **copy** (host -> device) for ``.to(device)`` of a host tensor (``device``: the step module's; the result is
  a tagged device tensor, the host tensor stays untagged), where calls in a row with no op between them are one copy
  (`hf_treespec.kv.tree_kv.to_device` packs them into one buffer on a GPU; on a CPU run it moves them one by one); and for
  a host tensor (not a 0-dim scalar, which CUDA ops take by value) that feeds an op together with device tensors
  without such a move (indexing a device tensor with a host index copies the index), once per host storage per step.
  All the host tensors that one forward of a given module reads that way count as one copy.

A **sync** is a run of transfers with no device work between them: the first one waits for the device to finish what
was queued, the later ones find it idle (so three ``.cpu()`` calls in a row are one sync, and a read that follows
device work is a new one). View ops (no kernel) are not device work. ``torch.cuda.set_sync_debug_mode`` warns per
transfer call instead, so on a GPU it reports at least as many as `StepSyncs.syncs`; `StepSyncs.transfers` is the
closer comparison.

A step is the stretch between the ends of two consecutive forwards of the step module (the target, the first module
given): it holds the verification of the previous tree, the commit, and the drafting and forward of the next one.
`SyncCounter.steps` lists the complete steps; what runs before the second target forward ends (prefill, the drafter's
own prefill, the first step) and after the last one (final verification, clean-up) is counted in the totals only.

Known blind spots (a CPU run cannot tell host memory from device memory, so intent is inferred from data flow):

* On a CPU run the host and the model's device are the same: ``.to(<the CPU>)`` of a device tensor is not counted
  (it could be a move to the model's own device) and the tensor stays tagged, so later host reads of it count; and
  ``.to(<the CPU>)`` of a host tensor counts as a copy even where the code meant the host. Move tensors to the host
  with ``.cpu()``.
* Tensors a factory makes directly on the device (``torch.arange(n, device=device)``, ``torch.full(...,
  device=device)``) look like host tensors on a CPU run: they count as a copy where they meet device tensors, and
  reading them is not counted (transformers' ``MaxLengthCriteria`` verdict, which the loop reads once per step with
  the other stopping verdicts, is one; with an EOS criterion the verdicts derive from the tokens and are counted).
* Synchronisations that are not data movement (``torch.cuda.synchronize``, events, the caching allocator) and syncs
  inside custom kernels are not seen; ``torch.cuda.set_sync_debug_mode`` sees those on a GPU.

No global state: the modes are pushed on entry and popped on exit, the step hook lives only inside the block.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

aten = torch.ops.aten

#: aten ops that read a device tensor's values on the host (or size their output by them), whatever their arguments
_READ_OPS = {
    getattr(getattr(aten, name), overload)
    for name, overload in (
        ("_local_scalar_dense", "default"), ("item", "default"), ("nonzero", "default"), ("masked_select", "default"),
        ("equal", "default"), ("is_nonzero", "default"), ("_unique", "default"), ("_unique2", "default"),
        ("unique_dim", "default"), ("unique_consecutive", "default"), ("bincount", "default"),
        ("nonzero_numpy", "default"),
    )
    if hasattr(aten, name) and hasattr(getattr(aten, name), overload)
}
_INDEX_OPS = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}
_HOST_READ_METHODS = {torch.Tensor.tolist, torch.Tensor.numpy}


@dataclass(frozen=True)
class SyncEvent:
    """One transfer: ``kind`` is ``"read"`` (device -> host) or ``"copy"`` (host -> device); ``op`` names it;
    ``waits`` says whether device work was queued since the previous transfer (it starts a sync); ``where`` is the
    innermost caller outside torch and this module (``file:line function``), when recorded."""

    kind: str
    op: str
    waits: bool
    where: str = ""


@dataclass
class StepSyncs:
    """The transfers of one step."""

    events: list[SyncEvent] = field(default_factory=list)

    @property
    def syncs(self) -> int:
        """Host waits on the device (runs of transfers with no device work between them)."""
        return sum(e.waits for e in self.events)

    @property
    def reads(self) -> int:
        return sum(e.kind == "read" for e in self.events)

    @property
    def copies(self) -> int:
        return sum(e.kind == "copy" for e in self.events)

    @property
    def transfers(self) -> int:
        return len(self.events)


class SyncCounter:
    """Counts device -> host reads, host -> device copies and the syncs they cost, per decoding step (see the module
    docstring).

    Args:
        step_module: the target model; each end of its forward closes a step.
        *device_modules: further modules whose parameters and buffers live on the device (the drafter).
        where: record the caller of each transfer (costs a stack walk per transfer; for diagnosis).
    """

    def __init__(self, step_module: torch.nn.Module, *device_modules: torch.nn.Module, where: bool = False):
        self.step_module = step_module
        self.modules = tuple({id(m): m for m in (step_module, *device_modules)}.values())
        self.where = where
        self.forwards = 0
        self.windows: list[StepSyncs] = [StepSyncs()]  # window i: after the i-th step-module forward ended
        self._tags: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._copied: dict[int, torch.Tensor] = {}  # host storages counted as copied in this window (kept alive)
        self._depth = 0  # nesting of the given modules' forwards
        self._forward_copied = False  # whether the current outermost forward's host inputs were counted
        self._device_work = True  # device ops ran since the last transfer
        self._quiet = False
        self._to_run = False  # the last torch call was a counted `.to(device)` copy
        self.device = next(iter(step_module.parameters()), torch.empty(0)).device
        self._modes = (_FunctionMode(self), _DispatchMode(self))
        self._hooks: list = []

    # ---------------------------------------------------------------------------------------------- public API
    def mark(self, *tensors: torch.Tensor) -> None:
        """Declares ``tensors`` device tensors (what a GPU run would hold on the device: ``generate``'s inputs)."""
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor):
                self._tags[tensor] = True

    @property
    def events(self) -> list[SyncEvent]:
        return [event for window in self.windows for event in window.events]

    @property
    def steps(self) -> list[StepSyncs]:
        """The complete steps: windows between the ends of the 2nd and the last step-module forwards."""
        return self.windows[2 : self.forwards]

    @property
    def syncs(self) -> int:
        """Every host wait counted, steps or not."""
        return sum(w.syncs for w in self.windows)

    @property
    def reads(self) -> int:
        """Every device -> host read counted, steps or not."""
        return sum(w.reads for w in self.windows)

    @property
    def copies(self) -> int:
        """Every host -> device copy counted, steps or not."""
        return sum(w.copies for w in self.windows)

    def __enter__(self) -> "SyncCounter":
        for module in self.modules:
            for tensor in (*module.parameters(), *module.buffers()):
                self._tags[tensor] = True
            self._hooks.append(module.register_forward_pre_hook(self._forward_start))
            self._hooks.append(module.register_forward_hook(self._forward_end))
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self._copied.clear()

    # -------------------------------------------------------------------------------------------------- internals
    def _forward_start(self, module, args) -> None:
        if self._depth == 0:
            self._forward_copied = False
        self._depth += 1

    def _forward_end(self, module, args, output) -> None:
        self._depth -= 1
        if module is self.step_module and self._depth == 0:
            self.forwards += 1
            self.windows.append(StepSyncs())
            self._copied.clear()

    def _on_device(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type not in ("cpu", "meta") or tensor in self._tags

    def _record(self, kind: str, op) -> None:
        self.windows[-1].events.append(SyncEvent(kind, str(op), self._device_work, _caller() if self.where else ""))
        self._device_work = False

    def _copy_in(self, tensor: torch.Tensor, op) -> None:
        if self._depth:  # a forward's host inputs: one packed copy
            if not self._forward_copied:
                self._forward_copied = True
                self._record("copy", op)
            return
        storage = tensor.untyped_storage().data_ptr()
        if storage not in self._copied:
            self._copied[storage] = tensor
            self._record("copy", op)

    def _alias(self, out: torch.Tensor, source: torch.Tensor, tag: bool) -> torch.Tensor:
        """``out`` of a transfer, as a GPU run would hand it over: a tensor of its own (a CPU run returns ``source``
        itself), tagged as a device tensor or not."""
        if out is source:
            self._quiet = True
            try:
                out = out.clone() if not tag else out.view(out.shape)
            finally:
                self._quiet = False
        if tag:
            self._tags[out] = True
        return out

    def _tag(self, outputs) -> None:
        for item in tree_flatten(outputs)[0]:
            if isinstance(item, torch.Tensor):
                self._tags[item] = True


class _DispatchMode(TorchDispatchMode):
    """Tags the outputs of ops that read device tensors; records reads and copies at the aten level."""

    def __init__(self, counter: SyncCounter):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        counter = self.counter
        if counter._quiet:
            return func(*args, **kwargs)
        counter._to_run = False
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if not any(counter._on_device(t) for t in tensors):
            return func(*args, **kwargs)
        if func is aten.copy_.default and not counter._on_device(args[0]):
            counter._record("read", func)  # a host tensor filled from a device tensor: it stays a host tensor
            return func(*args, **kwargs)
        for tensor in tensors:
            if tensor.dim() > 0 and tensor.numel() and not counter._on_device(tensor):
                counter._copy_in(tensor, func)
        reads = func in _READ_OPS or (func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None) or (
            func in _INDEX_OPS and any(isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8)
                                       for t in tree_flatten(args[1])[0]))
        if func is not aten._local_scalar_dense.default and func is not aten.item.default and not func.is_view:
            counter._device_work = True  # a kernel is queued (for a data-dependent op, before its host read)
        if reads:
            counter._record("read", func)
        out = func(*args, **kwargs)
        counter._tag(out)
        return out


class _FunctionMode(TorchFunctionMode):
    """Sees the transfers that dispatch no aten op on a CPU run: ``.cpu()``, ``.tolist()``, ``.numpy()`` of device
    tensors, ``.to(device)`` of host tensors."""

    def __init__(self, counter: SyncCounter):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        counter = self.counter
        if counter._quiet or not args or not isinstance(args[0], torch.Tensor):
            return func(*args, **kwargs)
        tensor = args[0]
        if func is torch.Tensor.cpu and counter._on_device(tensor):
            counter._record("read", "Tensor.cpu")
            return counter._alias(func(*args, **kwargs), tensor, tag=False)
        if func in _HOST_READ_METHODS and counter._on_device(tensor):
            counter._record("read", f"Tensor.{func.__name__}")
        elif func is torch.Tensor.to and not counter._on_device(tensor) and tensor.dim() and tensor.numel():
            target = kwargs.get("device", next((a for a in args[1:] if isinstance(a, (str, torch.device))), None))
            if target is not None and torch.device(target) == counter.device:
                if not counter._to_run:  # `to_device`'s tensors, moved one after another: one packed copy
                    counter._record("copy", "Tensor.to")
                counter._quiet = True  # (a CPU run dispatches a no-op aten.to, which must not end the run)
                try:
                    out = func(*args, **kwargs)
                finally:
                    counter._quiet = False
                counter._to_run = True
                return counter._alias(out, tensor, tag=True)
        return func(*args, **kwargs)


def tree_flatten(obj) -> tuple[list, None]:
    """The leaves of nested lists / tuples / dicts (the shape of an aten op's arguments and outputs)."""
    if isinstance(obj, (list, tuple)):
        return [leaf for item in obj for leaf in tree_flatten(item)[0]], None
    if isinstance(obj, dict):
        return [leaf for item in obj.values() for leaf in tree_flatten(item)[0]], None
    return [obj], None


def _caller() -> str:
    """The innermost frame outside torch and this module, as ``file:line function``."""
    for frame in reversed(traceback.extract_stack()[:-3]):
        name = frame.filename.replace("\\", "/")
        if "/torch/" not in name and not name.endswith("sync_counter.py"):
            return f"{name.rsplit('/', 2)[-2]}/{name.rsplit('/', 1)[-1]}:{frame.lineno} {frame.name}"
    return ""
