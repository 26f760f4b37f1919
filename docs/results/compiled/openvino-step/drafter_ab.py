"""Experiment: the shipped feature drafter's forward converted to OpenVINO as well, beside the OpenVINO target step.

Run: ``python docs/results/compiled/openvino-step/drafter_ab.py`` (bf16, 2 threads). It times one drafter forward
alone (OpenVINO vs eager), then interleaved with the target's engine, then whole ``generate`` calls of
``tree:salf`` at 4 nodes with the OpenVINO target and the drafter in OpenVINO or eager, paired per prompt. The
result decided that the package keeps the drafter eager beside the OpenVINO target.

What is converted, and how it plugs in, follows.
"""


from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from hf_treespec.compiled.openvino_export import (
    IR_FILE, cached_ir, compile_ir, export_key, fp32_copy, half_output, openvino_installed, to_torch,
)

logger = logging.getLogger(__name__)

#: where a drafter instance keeps its engine
_STORE = "_treespec_openvino_drafter"


class _DrafterGraph(torch.nn.Module):
    """What is converted: one drafter forward over a cache given as tensors, returning the logits (draft
    vocabulary), the output features and each layer's new KV rows."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, features, position_ids, attention_mask, past):
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        for layer, (keys, values) in zip(cache.layers, past):
            layer.keys, layer.values, layer.dtype, layer.device = keys, values, keys.dtype, keys.device
            layer.is_initialized = True
        rows = input_ids.shape[1]
        out = self.model(input_ids=input_ids, features=features, position_ids=position_ids,
                         attention_mask=attention_mask, cache=cache, use_cache=True)
        new = tuple((layer.keys[:, :, -rows:], layer.values[:, :, -rows:]) for layer in cache.layers)
        return out.logits, out.hidden_states, new


def _kv_shape(config) -> tuple[int, int]:
    heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    return heads, head_dim


def _export(model: torch.nn.Module, folder) -> None:
    import openvino as ov

    heads, head_dim = _kv_shape(model.config)
    count = int(model.config.num_hidden_layers)
    past_len, rows = 5, 3
    example = {
        "input_ids": torch.zeros(1, rows, dtype=torch.long),
        "features": torch.zeros(1, rows, int(model.config.hidden_size)),
        "position_ids": torch.arange(past_len, past_len + rows)[None],
        "attention_mask": torch.zeros(1, 1, rows, past_len + rows),
        "past": tuple((torch.randn(1, heads, past_len, head_dim), torch.randn(1, heads, past_len, head_dim))
                      for _ in range(count)),
    }
    fp32 = fp32_copy(model)
    for module in getattr(fp32, "_attached", {}).values():  # the target's shared embeddings / LM head (copied)
        module.float().requires_grad_(False)
    if getattr(fp32, "lm_head", None) is None and hasattr(fp32, "compute_logits"):
        # a shared head's draft rows as the copy's own head: the eager path caches them between calls, which a trace
        # would see as two different graphs
        rows = fp32._attached["lm_head"].weight.index_select(0, fp32.d2t)
        fp32.lm_head = torch.nn.Linear(rows.shape[1], rows.shape[0], bias=False).requires_grad_(False)
        fp32.lm_head.weight.copy_(rows)
    with torch.no_grad():
        converted = ov.convert_model(_DrafterGraph(fp32), example_input=example)
    del fp32
    inputs, outputs = converted.inputs, converted.outputs
    for i in range(count):
        for j, kind in enumerate(("key", "value")):
            inputs[4 + 2 * i + j].get_tensor().set_names({f"past_{kind}_{i}"})
            outputs[2 + 2 * i + j].get_tensor().set_names({f"new_{kind}_{i}"})
            half_output(outputs[2 + 2 * i + j].get_node(), model.dtype)
    outputs[0].get_tensor().set_names({"logits"})
    outputs[1].get_tensor().set_names({"hidden"})
    half_output(outputs[1].get_node(), model.dtype)
    folder.mkdir(parents=True, exist_ok=True)
    ov.save_model(converted, folder / IR_FILE, compress_to_fp16=False)


@dataclass(eq=False)
class OpenVINODrafterForward:
    """A `TreeSpecDrafterModel` 's forward through OpenVINO, called as `hf_treespec.compiled.CompiledDrafterForward`
    is: ``(input_ids, position_ids, attention_mask, cache, features=...)`` -> ``(logits, hidden_states)``, the new
    rows appended to ``cache`` (a ``DynamicCache``)."""

    model: torch.nn.Module
    failure: str | None = None
    compile_seconds: dict[str, float] = field(default_factory=dict)
    #: the cache stays a plain ``DynamicCache`` (not preallocated): its rows are inputs of every call
    preallocates = False

    def __post_init__(self) -> None:
        self._request = None
        try:
            folder, exported = cached_ir(export_key(self.model, "drafter forward"),
                                         lambda out: _export(self.model, out), "drafter's forward")
            if exported is not None:
                self.compile_seconds["export"] = exported
            start = time.perf_counter()
            self._request = compile_ir(folder, self.model.dtype).create_infer_request()
            self.compile_seconds["compile"] = time.perf_counter() - start
        except Exception as error:  # any export or compile failure: the drafter stays eager
            text = str(error).strip()
            self.failure = f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"
            logger.warning("hf_treespec: the drafter's OpenVINO forward is not available (%s); it drafts with its "
                           "eager forward.", self.failure)
        heads, head_dim = _kv_shape(self.model.config)
        self._empty = np.zeros((1, heads, 0, head_dim), np.float32)

    def __call__(self, input_ids, position_ids, attention_mask, cache, features=None):
        feed = {"input_ids": input_ids.numpy(), "position_ids": position_ids.numpy(),
                "attention_mask": attention_mask.float().numpy(), "features": features.float().numpy()}
        for i, layer in enumerate(cache.layers):
            held = layer.is_initialized and layer.keys.numel()
            feed[f"past_key_{i}"] = layer.keys.float().numpy() if held else self._empty
            feed[f"past_value_{i}"] = layer.values.float().numpy() if held else self._empty
        request = self._request
        request.infer(feed)
        for i, layer in enumerate(cache.layers):
            layer.update(to_torch(request.get_tensor(f"new_key_{i}")), to_torch(request.get_tensor(f"new_value_{i}")))
        return to_torch(request.get_tensor("logits")), to_torch(request.get_tensor("hidden"))


def openvino_drafter_for(model: torch.nn.Module) -> OpenVINODrafterForward | None:
    """The drafter's OpenVINO forward, kept on the instance; None where OpenVINO is missing or the export failed
    (warned once)."""
    if not openvino_installed():
        return None
    if _STORE not in model.__dict__:
        model.__dict__[_STORE] = OpenVINODrafterForward(model)
    engine = model.__dict__[_STORE]
    return engine if engine.failure is None else None


# ------------------------------------------------------------------------------------------------------ harness
def main() -> None:
    import json
    import statistics
    import sys
    from pathlib import Path

    from transformers import CompileConfig

    import hf_treespec
    import hf_treespec.drafters.feature_adapter as adapter
    from hf_treespec.assets import default_drafter, load_target
    from hf_treespec.attention import causal_row_mask
    from hf_treespec.compiled.openvino_step import OpenVINOStep
    from transformers import DynamicCache

    torch.set_num_threads(2)
    model, tok = load_target("smollm2-135m-instruct", dtype=torch.bfloat16)
    model = hf_treespec.enable(model)
    drafter = default_drafter(model)
    engine = openvino_drafter_for(drafter)
    report = {}

    cache = DynamicCache(config=drafter.config)
    context = 100
    prompt = torch.randint(0, 49152, (1, context))
    engine(prompt, torch.arange(context)[None], causal_row_mask(context, context, torch.float32, "cpu"), cache,
           features=torch.randn(1, context, 576, dtype=torch.bfloat16))

    def drafter_step(rows: int, eager: bool) -> float:
        held = cache.layers[0].keys.shape[2]
        inputs = dict(input_ids=torch.randint(0, 49152, (1, rows)), position_ids=torch.arange(held, held + rows)[None],
                      features=torch.randn(1, rows, 576, dtype=torch.bfloat16))
        start = time.perf_counter()
        if eager:
            with torch.no_grad():
                drafter(**inputs, attention_mask=causal_row_mask(rows, held + rows, torch.bfloat16, "cpu"),
                        cache=cache, use_cache=True, logits_to_keep=rows)
        else:
            engine(inputs["input_ids"], inputs["position_ids"], causal_row_mask(rows, held + rows, torch.float32,
                   "cpu"), cache, features=inputs["features"])
        seconds = time.perf_counter() - start
        cache.crop(-rows)
        return seconds

    for rows in (1, 4):
        for eager in (False, True):
            times = [drafter_step(rows, eager) for _ in range(20)][3:]
            report[f"drafter alone, {rows} row(s), {'eager' if eager else 'openvino'} ms"] = 1e3 * statistics.median(times)
    target = OpenVINOStep(model, None, (1, 14, 26))
    target.reset()
    target(prompt, torch.arange(context)[None], causal_row_mask(context, context, torch.float32, "cpu"), last_only=True)
    drafts, steps = [], []
    for _ in range(15):
        drafts += [drafter_step(1, False), drafter_step(4, False)]
        start = time.perf_counter()
        target(torch.randint(0, 49152, (1, 4)), torch.arange(target.held, target.held + 4)[None],
               causal_row_mask(4, target.held + 4, torch.float32, "cpu"))
        steps.append(time.perf_counter() - start)
    report["interleaved: openvino drafter (1 and 4 rows) ms"] = 1e3 * statistics.median(drafts[6:])
    report["interleaved: target step, 4 rows ms"] = 1e3 * statistics.median(steps[3:])

    real_preallocate = adapter.preallocate
    questions = ["Write a detailed essay about the history of the Roman empire.",
                 "Explain how a transformer neural network works.", "Give me ten tips for a healthy life."]
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                       return_tensors="pt", return_dict=True) for q in questions]
    config = CompileConfig(backend="openvino")

    def run(kind: str, inputs) -> float:
        import hf_treespec.generation.loop as loop

        # the loop leaves an engine's drafter eager; "openvino drafter" hands it this module's forward instead (its
        # cache a plain DynamicCache: no preallocation)
        adapter.preallocate = (lambda cache, rows: None) if kind == "openvino drafter" else real_preallocate
        wired = loop.TreeDecodingLoop.__init__

        def init(self, *args, **kwargs):
            wired(self, *args, **kwargs)
            for row in self.rows:
                row.drafter._compiled = openvino_drafter_for(row.drafter.model) if kind == "openvino drafter" else None

        loop.TreeDecodingLoop.__init__ = init
        try:
            start = time.perf_counter()
            model.generate(**inputs, max_new_tokens=64, min_new_tokens=64, do_sample=False, compile_config=config,
                           assistant_model=drafter, tree_policy="salf", tree_budget=4)
            return (time.perf_counter() - start) * 1e3 / 64
        finally:
            loop.TreeDecodingLoop.__init__ = wired
            adapter.preallocate = real_preallocate

    kinds = ("openvino drafter", "eager drafter")
    for inputs in prompts:  # warm-up
        for kind in kinds:
            run(kind, inputs)
    paired = {kind: [] for kind in kinds}
    for _ in range(4):
        for inputs in prompts:
            for kind in kinds:
                paired[kind].append(run(kind, inputs))
    for kind in kinds:
        report[f"generate, tree:salf 4 nodes, {kind}: median ms/token"] = statistics.median(paired[kind])
        report[f"generate, tree:salf 4 nodes, {kind}: all ms/token"] = [round(x, 1) for x in paired[kind]]
    report["openvino drafter slower in pairs"] = sum(a > b for a, b in zip(*paired.values()))
    report["pairs"] = len(paired[kinds[0]])
    text = json.dumps(report, indent=1)
    print(text)
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).with_name("drafter_ab.json")
    out.write_text(text + "\n")


if __name__ == "__main__":
    main()
