"""How long a process takes to be ready to decode with the compiled target and drafter (SmolLM2-135M-Instruct and
the shipped drafter, bf16, `CompileConfig()`): imports, loading both models, preparing every graph (building its
AOTInductor package on the first run, loading it afterwards) and decoding 16 tokens of a 4-node `salf` tree and of
plain decoding. Prints one JSON line. Run it twice with the same HF_TREESPEC_COMPILED_CACHE."""
import time

START = time.perf_counter()
import json  # noqa: E402

import torch  # noqa: E402
from transformers import CompileConfig  # noqa: E402

from hf_treespec.benchmark.loading import load_drafter, load_model  # noqa: E402
from hf_treespec.compiled.forward import _STORE  # noqa: E402
from hf_treespec.generation.plain import plain_generate  # noqa: E402

torch.set_num_threads(2)
model, tokenizer = load_model("smollm2-135m-instruct", "bf16", torch.device("cpu"))
drafter = load_drafter("default", model, "bf16")
loaded = time.perf_counter() - START
ids = tokenizer.apply_chat_template([{"role": "user", "content": "Name three uses of a paper clip."}],
                                    add_generation_prompt=True, return_tensors="pt")
ids = getattr(ids, "input_ids", ids)
with torch.inference_mode():
    tree = model.generate(ids, assistant_model=drafter, tree_policy="salf", tree_budget=4, max_new_tokens=16,
                          do_sample=False, compile_config=CompileConfig())
    plain = model.generate(ids, custom_generate=plain_generate, max_new_tokens=16, do_sample=False,
                           compile_config=CompileConfig())
ready = time.perf_counter() - START
graphs = {f"{c.role}: {name}": round(seconds, 1) for owner in (model, drafter)
          for c in owner.__dict__.get(_STORE, {}).values() for name, seconds in c.compile_seconds.items()}
failures = [c.package_failure or c.failure for owner in (model, drafter) for c in owner.__dict__.get(_STORE, {}).values()
            if c.package_failure or c.failure]
print(json.dumps({"ready_s": round(ready, 1), "models_loaded_s": round(loaded, 1), "graphs_s": graphs,
                  "failures": failures, "tree_equals_plain": bool(torch.equal(tree, plain))}))
