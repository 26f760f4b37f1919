"""Host-side cost per speculative step: process time spent OUTSIDE the target's (and the drafter's) forwards.

On a GPU the forwards run on the device, while everything else in a step (building the tree, masks, verification,
cache bookkeeping, emitting tokens) runs on the host and, when it syncs, stalls the device. This script measures that
host share on CPU, where it is easy to isolate: forward hooks on the target and on the drafter record the process
time of each forward; the rest of ``generate``'s process time is host overhead.

It uses only public API (``hf_treespec.enable``, ``generate`` and ``nn.Module`` forward hooks), so it runs unchanged on
any version of the package that ships ``hf_treespec.assets.default_drafter`` (from a source checkout, put the checkout
first on the path: ``PYTHONPATH=. python examples/host_overhead.py ...``):

    python examples/host_overhead.py --policy salf --num-questions 20 --max-new-tokens 128
    python examples/host_overhead.py --policy eagle2 --num-questions 20 --max-new-tokens 128
    python examples/host_overhead.py --policy none --num-questions 20 --max-new-tokens 128   # plain generate

Reported per step (one step = one target tree forward; the prefill is excluded from the step count but its forward
time is subtracted like every other target forward):

* ``outside target``: process time of generate minus the target forwards (drafter compute included);
* ``host only``: minus the drafter's module calls too (policy, verifier, masks, caches, emit, and the vocabulary-
  sized tensor ops outside the models: log-softmax of draft rows, argmax / softmax of target rows, which a GPU
  would run on the device);
* ``target fwd`` / ``drafter fwd``: the forwards themselves, for scale.

Run it on a quiet machine: process time is less sensitive to other load than wall time, but not immune. With
``--device cuda`` it also counts host-device syncs per step (``torch.cuda.set_sync_debug_mode("warn")``); the
syncs of the prefill and of the final ``synchronize`` are included in the count but not in the step count.

``--syncs`` counts instead, on any device, the operations of a step that would make the host wait for a GPU
(`SyncCounter`, a development tool in the repository's `tests/sync_counter.py`, so it needs a clone: device -> host
reads, host -> device copies, and the syncs they cost), for each policy of ``--policies``, greedy and sampling, one
prompt and a batch of 4, and prints one table (``--tiny``: a 4-layer random Llama with a random feature drafter
instead of the shipped pair):

    python examples/host_overhead.py --syncs --tiny --max-new-tokens 48
    python examples/host_overhead.py --syncs --num-questions 4 --max-new-tokens 48
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

import hf_treespec
from hf_treespec.assets import default_drafter, load_questions, load_target
from hf_treespec.benchmark.runner import build_prompt


class ForwardClock:
    """Process time of module calls, with pre/post forward hooks on EVERY submodule of the target and the drafter.

    Only outermost hooked calls are timed. One that starts at the target's top module is a target forward; any other
    (the drafter's forward, but also its calls into modules it shares with the target, such as the LM head it
    applies to its own states, or a feature projection) is drafter compute. What is left of ``generate``'s process
    time is host work: policy, verifier, masks, caches, logits processing outside the models, emitting tokens.
    """

    def __init__(self, target: torch.nn.Module, drafter: torch.nn.Module):
        self.target = target
        self.seconds = {"target": 0.0, "drafter": 0.0}
        self.target_calls = 0
        self._depth = 0
        self._start = 0.0
        self._kind = ""
        modules = {id(m): m for root in (target, drafter) for m in root.modules()}
        self._handles = [h for m in modules.values()
                         for h in (m.register_forward_pre_hook(self._enter), m.register_forward_hook(self._exit))]

    def _enter(self, module, args):
        if self._depth == 0:
            self._kind = "target" if module is self.target else "drafter"
            self._start = time.process_time()
        self._depth += 1

    def _exit(self, module, args, output):
        self._depth -= 1
        if self._depth == 0:
            self.seconds[self._kind] += time.process_time() - self._start
            self.target_calls += self._kind == "target"

    def reset(self) -> None:
        self.seconds = {"target": 0.0, "drafter": 0.0}
        self.target_calls = 0

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def parse_value(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", default="salf", help="tree_policy (salf, eagle2, optimal, chain, ...) or none (plain generate)")
    parser.add_argument("--num-questions", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs on the first question before measuring")
    parser.add_argument("--device", default="cpu", help="cpu or cuda; on cuda, host-device syncs are counted too")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="extra generate kwargs, e.g. --set tree_budget=16 (repeatable)")
    parser.add_argument("--syncs", action="store_true", help="count syncs per step (any device) and print a table")
    parser.add_argument("--policies", default="chain,eagle2,salf,dyspec,iid", help="with --syncs: policies to count")
    parser.add_argument("--tiny", action="store_true", help="with --syncs: tiny random target and feature drafter")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.syncs:
        return count_syncs(args)

    model, tokenizer = load_target(dtype=torch.float32 if args.dtype == "fp32" else torch.bfloat16)
    model = hf_treespec.enable(model.to(args.device))
    drafter = default_drafter(model)
    cuda = torch.device(args.device).type == "cuda"
    extra = {key: parse_value(value) for key, value in (item.split("=", 1) for item in args.set)}
    kwargs = dict(do_sample=False, max_new_tokens=args.max_new_tokens, **extra)
    if args.policy != "none":  # none: plain generate, the host cost every step of ours is compared with
        kwargs.update(assistant_model=drafter, tree_policy=args.policy)
    prompts = [build_prompt(tokenizer, q).to(args.device) for q in load_questions(limit=args.num_questions)]

    clock = ForwardClock(model, drafter)
    with torch.no_grad():
        for _ in range(args.warmup):
            model.generate(prompts[0], attention_mask=torch.ones_like(prompts[0]), **kwargs)
        per_question = []
        totals = dict(process=0.0, wall=0.0, target=0.0, drafter=0.0, steps=0, tokens=0, syncs=0)
        for prompt in prompts:
            clock.reset()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if cuda:  # every synchronizing CUDA call warns while this is on
                    torch.cuda.set_sync_debug_mode("warn")
                wall0, proc0 = time.perf_counter(), time.process_time()
                out = model.generate(prompt, attention_mask=torch.ones_like(prompt), **kwargs)
                if cuda:
                    torch.cuda.synchronize()
                process, wall = time.process_time() - proc0, time.perf_counter() - wall0
                if cuda:
                    torch.cuda.set_sync_debug_mode(0)
            totals["syncs"] += sum("synchroniz" in str(w.message) for w in caught)
            steps = clock.target_calls - 1  # the first target forward is the prefill
            if steps < 1:
                continue
            totals["process"] += process
            totals["wall"] += wall
            totals["target"] += clock.seconds["target"]
            totals["drafter"] += clock.seconds["drafter"]
            totals["steps"] += steps
            totals["tokens"] += out.shape[1] - prompt.shape[1]
            per_question.append((process - clock.seconds["target"] - clock.seconds["drafter"]) / steps)
    clock.remove()

    steps = totals["steps"]
    if not steps:
        raise SystemExit("no speculative step ran (every answer ended at its first token)")
    ms = lambda seconds: 1000 * seconds / steps  # noqa: E731
    print(f"policy={args.policy} questions={len(per_question)} max_new_tokens={args.max_new_tokens} "
          f"threads={args.threads} settings={extra or '{}'}")
    print(f"steps={steps} tokens={totals['tokens']} tau={totals['tokens'] / steps:.2f} "
          f"(tokens per step, the prefill's token included)")
    print(f"per step (process time, ms): outside target {ms(totals['process'] - totals['target']):.2f} | "
          f"host only {ms(totals['process'] - totals['target'] - totals['drafter']):.2f} | "
          f"target fwd {ms(totals['target']):.2f} | drafter fwd {ms(totals['drafter']):.2f} | "
          f"wall {ms(totals['wall']):.2f}")
    if cuda:
        print(f"host-device syncs per step (torch.cuda.set_sync_debug_mode): {totals['syncs'] / steps:.1f}")
    if len(per_question) > 1:
        print(f"host only per step across questions (ms): median {1000 * statistics.median(per_question):.2f}, "
              f"min {1000 * min(per_question):.2f}, max {1000 * max(per_question):.2f}")


def tiny_pair(device: str):
    """A 4-layer random Llama (vocabulary 64) and a random one-layer feature drafter for it, plus 4 random prompts."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_treespec.drafters import TreeSpecDrafterConfig, TreeSpecDrafterModel

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, bos_token_id=None, eos_token_id=None,
                         pad_token_id=None)
    model = hf_treespec.enable(LlamaForCausalLM(config).eval().to(device))
    with torch.no_grad():
        model.lm_head.weight.mul_(12.0)  # peaked distributions, like a real LM's
    drafter = TreeSpecDrafterModel(TreeSpecDrafterConfig.for_target(config)).eval().to(device)
    prompts = [torch.randint(1, 64, (1, n), device=device) for n in (12, 9, 15, 7)]
    return model, drafter, prompts


def count_syncs(args) -> None:
    """Syncs per complete step (`SyncCounter.steps`), per policy x mode x batch size, as a markdown table."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # a development tool, not shipped
    from sync_counter import SyncCounter

    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    if args.tiny:
        model, drafter, prompts = tiny_pair(args.device)
        pad = 0
    else:
        model, tokenizer = load_target(dtype=dtype)
        model = hf_treespec.enable(model.to(args.device))
        drafter = default_drafter(model)
        prompts = [build_prompt(tokenizer, q).to(args.device) for q in load_questions(limit=args.num_questions)]
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    extra = {key: parse_value(value) for key, value in (item.split("=", 1) for item in args.set)}
    print(f"max_new_tokens={args.max_new_tokens} prompts={len(prompts)} settings={extra or '{}'} "
          f"model={'tiny' if args.tiny else 'shipped'}")
    print("| policy | mode | batch | syncs / step | reads / step | copies / step | max syncs in a step |")
    print("|---|---|---|---|---|---|---|")
    for policy in args.policies.split(","):
        for mode in ("greedy", "sampling"):
            for batch in (1, 4):
                steps = []
                for start in range(0, len(prompts) - batch + 1, batch):
                    group = prompts[start : start + batch]
                    width = max(p.shape[1] for p in group)
                    ids = torch.full((len(group), width), pad, dtype=torch.long, device=args.device)
                    mask = torch.zeros_like(ids)
                    for row, p in enumerate(group):  # left padding
                        ids[row, width - p.shape[1]:] = p[0]
                        mask[row, width - p.shape[1]:] = 1
                    kwargs = dict(assistant_model=drafter, tree_policy=policy, max_new_tokens=args.max_new_tokens,
                                  pad_token_id=pad, **extra)
                    if mode == "sampling":
                        kwargs.update(do_sample=True, temperature=1.0, top_k=50)
                        torch.manual_seed(start)
                    else:
                        kwargs.update(do_sample=False)
                    with torch.no_grad(), SyncCounter(model, drafter) as counter:
                        counter.mark(ids, mask)
                        model.generate(ids, attention_mask=mask, **kwargs)
                    steps += counter.steps
                if not steps:
                    print(f"| {policy} | {mode} | {batch} | (no complete step) | | | |")
                    continue
                mean = lambda values: sum(values) / len(steps)  # noqa: E731
                print(f"| {policy} | {mode} | {batch} | {mean([s.syncs for s in steps]):.1f} | "
                      f"{mean([s.reads for s in steps]):.1f} | {mean([s.copies for s in steps]):.1f} | "
                      f"{max(s.syncs for s in steps)} |")


if __name__ == "__main__":
    main()
