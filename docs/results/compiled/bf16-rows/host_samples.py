"""Where a batch-1 T=1 tree step's host time goes, from py-spy's samples (run.sh attaches it).

``python host_samples.py run``: after a warm-up, twelve seeded calls of DySpec one layer of 4 siblings (bf16, 2
threads, one ShareGPT dev prompt x 64 new tokens), printing GO when py-spy may attach; writes samples_meta.json (steps,
wall and packaged-graph seconds). ``python host_samples.py summarise RAW``: py-spy's raw stacks (``-f raw``) -> the
share of samples inside the packaged graphs and the prompt's prefill, and the host samples by the innermost
hf_treespec line and by the innermost frame, with the ms a step each share stands for."""
import collections
import json
import re
import sys
import time
from pathlib import Path

META = Path(__file__).with_name("samples_meta.json")


def run() -> None:
    import torch
    from transformers import CompileConfig

    from hf_treespec.assets import sharegpt_prompts
    from hf_treespec.benchmark.batched import left_pad
    from hf_treespec.benchmark.loading import build_prompt, load_drafter, load_model
    from hf_treespec.compiled.forward import packaged_time

    torch.set_num_threads(2)
    model, tokenizer = load_model("smollm2-135m-instruct", "bf16")
    drafter = load_drafter("default", model, "bf16")
    ids, mask = left_pad([build_prompt(tokenizer, sharegpt_prompts("dev", 1)[0])], tokenizer.pad_token_id or 0)
    kwargs = dict(max_new_tokens=64, compile_config=CompileConfig(), return_dict_in_generate=True,
                  attention_mask=mask, do_sample=True, temperature=1.0, assistant_model=drafter, tree_policy="dyspec",
                  tree_budget=4, tree_depth=1)
    with torch.inference_mode():
        model.generate(ids, **kwargs)
        time.sleep(1.0)
        print("GO", flush=True)
        steps, graphs, start = 0, packaged_time(model, drafter), time.perf_counter()
        for seed in range(12):
            torch.manual_seed(seed)
            out = model.generate(ids, **kwargs)
            steps += max(len(row) for row in out.row_accepted_lengths)
        wall = time.perf_counter() - start
    graphs = packaged_time(model, drafter) - graphs
    META.write_text(json.dumps({"steps": steps, "wall_s": wall, "graphs_s": graphs}))


def frame_key(frame: str) -> str | None:
    match = re.match(r"(\S+) \((.*?):(\d+)\)", frame)
    if not match or "hf_treespec/" not in match.group(2):
        return None
    return f"{match.group(2).split('hf_treespec/')[-1]}:{match.group(3)} {match.group(1)}"


def summarise(raw: str) -> None:
    meta = json.loads(META.read_text())
    host_ms = (meta["wall_s"] - meta["graphs_s"]) / meta["steps"] * 1e3
    total = graphs = prefill = 0
    by_line, by_leaf = collections.Counter(), collections.Counter()
    for line in Path(raw).read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames, count = stack.split(";"), int(count)
        total += count
        if any("FlatCall.__call__" in frame for frame in frames):
            graphs += count
            continue
        if any(".prefill (" in frame for frame in frames):
            prefill += count
            continue
        keys = [key for key in map(frame_key, frames) if key]
        by_line[keys[-1] if keys else "(outside hf_treespec)"] += count
        by_leaf[re.sub(r":\d+\)", ")", frames[-1])] += count
    host = total - graphs - prefill
    print(f"{meta['steps']} steps; host time {host_ms:.2f} ms a step (wall minus the packaged graphs' calls)")
    print(f"samples: {total}; inside the packaged graphs {graphs / total:.1%}, the prompts' prefill "
          f"{prefill / total:.1%}, the decoding steps' host work {host / total:.1%}")
    for title, counter in (("innermost hf_treespec line", by_line), ("innermost frame", by_leaf)):
        print(f"\nhost samples by {title} (share of the host samples, ms a step it stands for):")
        for key, count in counter.most_common(25):
            print(f"  {count / host:6.1%}  {count / host * host_ms:5.2f}  {key}")


if __name__ == "__main__":
    run() if sys.argv[1] == "run" else summarise(sys.argv[2])
