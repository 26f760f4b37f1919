"""Held-out acceptance of a drafter per depth, along the target's own greedy continuation.

Evaluation data is prepared with the ``chain`` policy (``tree_depth=D``): at every root position the target's greedy
chain of ``D`` tokens and its state at each of them are stored. The drafter then runs exactly as in greedy chain
drafting -- context pass, then its own features fed back along the chain (:func:`~.unroll.unroll`) -- and a draft at
depth k is accepted when its argmax (mapped to a target id) equals the target's argmax there. Since an accepted draft
*is* the target's greedy token, the conditional rate at depth k given depths < k accepted is greedy speculative
decoding's acceptance rate alpha_k, and ``1 + mean leading accepted`` is tau of greedy chain drafting of depth D.
"""

from __future__ import annotations

from typing import Any

import torch
from tqdm.auto import tqdm

from ..data.collators import TALFCollator
from ..data.prepared import PreparedData
from ..objectives.losses import TargetHead
from ..objectives.unroll import TreeLevels, unroll


@torch.no_grad()
def acceptance_by_depth(
    model, data: PreparedData, target_head: TargetHead, batch_size: int = 4, progress: bool = True
) -> dict[str, Any]:
    """``{"top1_d{k}", "accept_d{k}", "mean_accepted", "tau_chain", "roots"}`` over every stored root (see module)."""
    if data.config.tree_policy != "chain":
        raise ValueError("acceptance_by_depth needs data prepared with the 'chain' tree policy (the target's greedy "
                         f"continuation at every root); this folder used {data.config.tree_policy!r}.")
    depth = int(data.config.tree_params.get("tree_depth", 5))
    collator = TALFCollator.from_prepared(data)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    rows = data.dataset
    results = []  # [roots, depth] 1 accepted / 0 rejected / -1 not available (sequence end)
    for start in tqdm(range(0, len(rows), batch_size), desc="acceptance", disable=not progress):
        picked = [rows[i] for i in range(start, min(start + batch_size, len(rows)))]
        batch = {k: v.to(device) for k, v in collator(picked).items()}
        levels = TreeLevels.from_batch(batch)
        out = unroll(model, batch["input_ids"], batch["target_hidden_states"], batch["attention_mask"], levels)
        d2t = model.d2t
        node_ok = None
        if out.node_logits is not None:
            node_ok = torch.zeros_like(levels.valid)
            valid = levels.valid
            node_ok[valid] = d2t[out.node_logits[valid].argmax(-1)] == _target_argmax(
                target_head, batch["node_label_hidden"][valid])
        for b, row in enumerate(picked):
            roots = torch.tensor(row["tree_roots"], dtype=torch.long, device=device) - 1
            if roots.numel() == 0:
                continue
            table = torch.full((batch["input_ids"].shape[1], depth), -1, dtype=torch.long)
            root_ok = d2t[out.context_logits[b, roots].argmax(-1)] == _target_argmax(
                target_head, batch["label_hidden"][b, roots])
            table[roots.cpu(), 0] = root_ok.long().cpu()
            if node_ok is not None:
                valid = levels.valid[b]
                table[levels.roots[b][valid].cpu(), levels.depth[b][valid].cpu()] = node_ok[b][valid].long().cpu()
            results.append(table[roots.cpu()])
    model.train(was_training)
    if not results:
        raise ValueError("the evaluation data holds no tree roots.")
    table = torch.cat(results)
    summary: dict[str, Any] = {"roots": int(table.shape[0])}
    alive = torch.ones(table.shape[0], dtype=torch.bool)
    leading = torch.zeros(table.shape[0])
    for k in range(depth):
        known = table[:, k] >= 0
        ok = table[:, k] == 1
        summary[f"top1_d{k + 1}"] = round(float(ok[known].float().mean()), 4) if known.any() else None
        reached = alive & known
        summary[f"accept_d{k + 1}"] = round(float(ok[reached].float().mean()), 4) if reached.any() else None
        alive = reached & ok
        leading += alive.float()
    summary["mean_accepted"] = round(float(leading.mean()), 4)
    summary["tau_chain"] = round(1.0 + float(leading.mean()), 4)
    return summary


def _target_argmax(head: TargetHead, hidden: torch.Tensor) -> torch.Tensor:
    """The target's greedy token (full vocabulary: a token outside the draft vocabulary cannot be drafted)."""
    return head.log_probs(hidden).argmax(-1)
