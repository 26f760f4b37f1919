"""`NDETrainer`: trains the delay selector of ``tree_policy="nde"`` on ``nde-data`` rows (delayed-expansion paper,
Section 6 and Appendix E).

Objective per minibatch of roots i, with the selector's action probabilities pi_i, the block-efficiency estimates
tau_i(a) and step times T_i(a) of the data (Equations 3 and 11):

- Equation 4, the policy's expected throughput: ``TPS_i = sum_a pi_i(a) tau_i(a) / sum_a pi_i(a) T_i(a)``;
- Equation 5, baseline-aware: maximise the mean of ``r_i = TPS_i / TPS_i(a_base)``, where a_base is the static
  baseline action of the row's sampling setting (by default the single action with the best total throughput
  ``sum tau / sum T`` over the training rows of that setting: the best tuned ``delayed`` configuration);
- Equation 12, regression penalty: ``+ penalty_weight x mean of the largest penalty_fraction of (1 - r_i)+`` in the
  minibatch, so the selector does not buy small average gains with rare large slow-downs. [inferred: the extracted
  paper lost the equation; the text fixes the weight, the top-fraction selection and "regressions below the
  baseline", we use the hinge (1 - r)+.]

The loss is a per-minibatch mean (not a sum over items), so ``loss_is_scaled_for_ga = False``: the Trainer divides it
by the gradient-accumulation steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import Trainer, TrainingArguments

from hf_treespec.api import FEATURE_SETS, LATENCY_FEATURES, SCALAR_FEATURES, Action, DelaySelector, DelaySelectorConfig

from .metrics import BatchMetrics, MetricsMixin
from ..data.nde_dataset import NDEData
from .small_model import SmallModelTrainerMixin
from .trainer import pin_memory_field


# ------------------------------------------------------------------------------------------------------ objective
def throughput_objective(
    logits: torch.Tensor, tau: torch.Tensor, seconds: torch.Tensor, baseline: torch.Tensor,
    penalty_weight: float = 1.0, penalty_fraction: float = 0.1,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss of Equations 4, 5 and 12 for ``[B, A]`` logits / tau / seconds and ``[B]`` baseline action indices.

    Returns the loss and per-row diagnostics: ``ratio`` (soft policy vs baseline), ``argmax_ratio`` (the action the
    policy would pick at inference), ``oracle_ratio`` (best action of the row)."""
    probs = logits.float().softmax(-1)
    tau, seconds = tau.float(), seconds.float()
    tps = (probs * tau).sum(-1) / (probs * seconds).sum(-1)
    rate = tau / seconds
    base = rate.gather(1, baseline[:, None]).squeeze(1)
    ratio = tps / base
    shortfall = (1 - ratio).clamp(min=0)
    worst = shortfall.topk(max(1, math.ceil(penalty_fraction * ratio.numel()))).values
    loss = -ratio.mean() + penalty_weight * worst.mean()
    with torch.no_grad():
        argmax_ratio = rate.gather(1, logits.argmax(-1, keepdim=True)).squeeze(1) / base
        stats = {"ratio": ratio.detach(), "argmax_ratio": argmax_ratio, "oracle_ratio": rate.max(-1).values / base,
                 "regression": (argmax_ratio < 1).float()}
    return loss, stats


def setting_key(temperature: float, top_p: float) -> str:
    """Name of a sampling setting (the unit that has one static baseline)."""
    return f"T={float(temperature):g},top_p={float(top_p):g}"


def best_static_actions(tau: torch.Tensor, seconds: torch.Tensor, keys: list[str]) -> dict[str, int]:
    """Per sampling setting, the action with the best total throughput ``sum tau / sum T`` over its rows."""
    out = {}
    for key in sorted(set(keys)):
        rows = torch.tensor([k == key for k in keys])
        out[key] = int((tau[rows].sum(0) / seconds[rows].sum(0)).argmax())
    return out


# -------------------------------------------------------------------------------------------------------- config
@dataclass
class NDEConfig(TrainingArguments):
    """``TrainingArguments`` with the NDE objective's settings (Appendix E) and small-MLP defaults."""

    penalty_weight: float = field(default=1.0, metadata={"help": "lambda, weight of the regression penalty"})
    penalty_fraction: float = field(default=0.1, metadata={"help": "rho, share of the minibatch's worst "
                                                                   "regressions the penalty averages"})
    baseline_action: str | None = field(default=None, metadata={
        "help": "static baseline 'k,l1,l2' for every row (default: best static action per sampling setting)"})
    learning_rate: float = field(default=1e-3, metadata={"help": "peak learning rate"})
    num_train_epochs: float = field(default=20.0, metadata={"help": "epochs over the roots"})
    per_device_train_batch_size: int = field(default=64, metadata={"help": "roots per step"})
    per_device_eval_batch_size: int = field(default=256, metadata={"help": "roots per eval step"})
    lr_scheduler_type: str = field(default="cosine", metadata={"help": "learning-rate schedule"})
    weight_decay: float = field(default=0.01, metadata={"help": "AdamW weight decay"})
    remove_unused_columns: bool = field(default=False, metadata={"help": "the collator reads named columns"})
    prediction_loss_only: bool = field(default=True, metadata={"help": "evaluation reports loss and ratios"})
    dataloader_pin_memory: bool = pin_memory_field()
    report_to: None | str | list[str] = field(default="none", metadata={"help": "experiment trackers"})
    logging_steps: float = field(default=20, metadata={"help": "log every N steps"})
    save_strategy: str = field(default="epoch", metadata={"help": "when to checkpoint: epoch, steps or no"})
    save_total_limit: int | None = field(default=2, metadata={"help": "checkpoints kept"})

    def __post_init__(self):
        super().__post_init__()
        if self.penalty_weight < 0 or not 0 < self.penalty_fraction <= 1:
            raise ValueError("need penalty_weight >= 0 and 0 < penalty_fraction <= 1.")


# ------------------------------------------------------------------------------------------------------ collator
@dataclass
class NDECollator:
    """Rows -> tensors: the selector's scalar features (picked by name), hidden inputs, targets, baseline index."""

    scalar_index: list[int]
    hidden_inputs: list[str]
    baselines: dict[str, int]
    fixed_baseline: int | None = None

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch = {
            "scalars": torch.tensor([row["scalars"] for row in rows], dtype=torch.float32)[:, self.scalar_index],
            "block_efficiency": torch.tensor([row["block_efficiency"] for row in rows], dtype=torch.float32),
            "seconds": torch.tensor([row["seconds"] for row in rows], dtype=torch.float32),
        }
        for name in self.hidden_inputs:
            batch[name] = torch.tensor([row[name] for row in rows], dtype=torch.float32)
        if self.fixed_baseline is not None:
            baseline = [self.fixed_baseline] * len(rows)
        else:
            keys = [setting_key(row["temperature"], row["top_p"]) for row in rows]
            missing = sorted(set(keys) - set(self.baselines))
            if missing:
                raise ValueError(f"no baseline action for sampling settings {missing} (absent from the training "
                                 "data); pass baseline_action='k,l1,l2'.")
            baseline = [self.baselines[k] for k in keys]
        batch["baseline"] = torch.tensor(baseline, dtype=torch.long)
        return batch


def build_selector(data: NDEData, shared_dim: int = 64, dropout: float = 0.1, use_hidden: bool = True,
                   latency_features: bool = False, scalar_features: list[str] | None = None,
                   feature_set: str = "root") -> DelaySelector:
    """A fresh selector for ``data``'s actions reading the inputs of ``feature_set`` (:data:`FEATURE_SETS`:
    ``root``, ours, or ``paper``, Appendix E's); ``use_hidden=False`` drops the hidden-state blocks.

    The latency features are left out unless ``latency_features``: data from one machine has them nearly constant
    (they follow the context length, itself a feature), while the running means measured while decoding include the
    policy's own overhead and sit off the microbenchmark's scale, so they would only add a train / inference gap.
    The step times of the objective carry the hardware either way. Use them when the data mixes machines.
    """
    if feature_set not in FEATURE_SETS:
        raise ValueError(f"unknown feature set {feature_set!r}; known: {sorted(FEATURE_SETS)}.")
    chosen = FEATURE_SETS[feature_set]
    available = list(data.meta["scalar_features"])
    if scalar_features is None:
        scalar_features = [n for n in available if n in chosen.scalars or (latency_features and n in LATENCY_FEATURES)]
        missing = [n for n in chosen.scalars if n not in available]
        if missing:
            raise ValueError(f"feature_set={feature_set!r} reads {missing}, which this nde-data lacks (made by an "
                             "older version): regenerate it with `hf-treespec train nde-data`.")
    widths = {"target_hidden": data.meta.get("hidden_size"), "draft_hidden": data.meta.get("draft_hidden_size")}
    hidden = {name: int(widths[name]) for name in chosen.hidden if widths[name]} if use_hidden else {}
    if use_hidden and len(hidden) != len(chosen.hidden):
        raise ValueError(f"feature_set={feature_set!r} reads the hidden states {list(chosen.hidden)}; this nde-data "
                         "has no drafter hidden state (made by an older version): regenerate it.")
    config = DelaySelectorConfig(
        actions=[list(a) for a in data.actions], scalar_features=list(scalar_features), hidden_inputs=hidden,
        shared_dim=shared_dim, dropout=dropout, verifier=data.meta.get("verifier"), feature_set=feature_set,
    )
    return DelaySelector(config)


# ------------------------------------------------------------------------------------------------------- trainer
class NDETrainer(MetricsMixin, SmallModelTrainerMixin, Trainer):
    """Trains a :class:`~hf_treespec.policies.nde.DelaySelector` on :class:`~.nde_data.NDEData`.

    On construction it fits the selector's feature standardisation on the training rows (unless already fitted),
    fixes the static baseline per sampling setting (recorded in the selector config) and builds the collator.
    ``save_model`` writes the selector folder (``config.json`` + ``model.safetensors``) that ``tree_selector=``
    loads.
    """

    loss_is_scaled_for_ga = False

    def __init__(
        self, model: DelaySelector, args: NDEConfig | None = None, *, train_dataset: NDEData | Any = None,
        eval_dataset: NDEData | Any = None, data_collator: Any = None, **kwargs: Any,
    ):
        if args is None:
            args = NDEConfig(output_dir="nde-selector")
        if not isinstance(args, NDEConfig):
            raise TypeError(f"NDETrainer needs an NDEConfig, got {type(args).__name__}.")
        if not isinstance(model, DelaySelector):
            raise TypeError(f"NDETrainer trains a DelaySelector, got {type(model).__name__}.")
        meta = next((d.meta for d in (train_dataset, eval_dataset) if isinstance(d, NDEData)), None)
        data_features = list(meta["scalar_features"]) if meta else list(SCALAR_FEATURES)
        if meta is not None and [list(a) for a in meta["actions"]] != model.config.actions:
            raise ValueError("the selector's actions differ from the data's (its logits index the data's actions); "
                             "build it with build_selector(data).")
        missing = [n for n in model.config.scalar_features if n not in data_features]
        if missing:
            raise ValueError(f"the data has no scalar features {missing}.")
        train = train_dataset.dataset if isinstance(train_dataset, NDEData) else train_dataset
        evaluation = eval_dataset.dataset if isinstance(eval_dataset, NDEData) else eval_dataset
        scalar_index = [data_features.index(n) for n in model.config.scalar_features]
        fixed = None
        if args.baseline_action:
            wanted = Action(*(int(x) for x in args.baseline_action.split(",")))
            if list(wanted) not in model.config.actions:
                raise ValueError(f"baseline_action {tuple(wanted)} is not among the selector's actions.")
            fixed = model.config.actions.index(list(wanted))
        baselines: dict[str, int] = {}
        if train is not None:
            columns = train.with_format("torch")[:]
            tau, seconds = columns["block_efficiency"].float(), columns["seconds"].float()
            if tau.shape[-1] != len(model.config.actions):
                raise ValueError(f"the data has {tau.shape[-1]} actions per row, the selector {len(model.config.actions)}.")
            keys = [setting_key(t, p) for t, p in zip(train["temperature"], train["top_p"])]
            baselines = best_static_actions(tau, seconds, keys) if fixed is None else {k: fixed for k in set(keys)}
            model.config.baseline_actions = {k: model.config.actions[i] for k, i in baselines.items()}
            if not model.config.standardised:
                hidden = {name: columns[name].float() for name in model.config.hidden_inputs}
                model.fit_standardisation(columns["scalars"].float()[:, scalar_index], **hidden)
        if data_collator is None:
            data_collator = NDECollator(scalar_index, list(model.config.hidden_inputs), baselines, fixed)
        super().__init__(model=model, args=args, data_collator=data_collator, train_dataset=train,
                         eval_dataset=evaluation, **kwargs)

    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        hidden = {name: inputs[name] for name in self.accelerator.unwrap_model(model).config.hidden_inputs}
        logits = model(inputs["scalars"], **hidden)
        loss, stats = throughput_objective(logits, inputs["block_efficiency"], inputs["seconds"], inputs["baseline"],
                                           self.args.penalty_weight, self.args.penalty_fraction)
        metrics = BatchMetrics()
        for key, values in stats.items():
            metrics.add(key, values)
        self.record(model, metrics)
        return (loss, {"logits": logits.detach()}) if return_outputs else loss

