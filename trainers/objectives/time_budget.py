"""Training to a wall-clock budget (``max_train_seconds``): a lease on a rented GPU, a preemptible machine, a CI slot.

Stopping a step-scheduled run early leaves its weights at a high learning rate, and guessing ``max_steps`` needs the
step time, which is unknown until the run starts. With a budget the learning-rate schedule follows the *clock*: the
warm-up and the cosine / linear decay are fractions of ``max_train_seconds``, and the run stops (and saves, as at its
end) once the budget is spent, so it ends annealed whatever the hardware. ``num_train_epochs`` still bounds it; when
the epochs run out first the schedule has not reached zero. The clock is this process's: a resumed run starts the
clock and the schedule again, so give it the budget that is left.
"""

from __future__ import annotations

import math
import time

import torch
from torch.optim.lr_scheduler import LambdaLR
from transformers import TrainerCallback

#: schedules that can follow the clock (``lr_scheduler_type`` values)
TIME_SCHEDULES = ("cosine", "linear", "constant", "constant_with_warmup")


class WallClock:
    """Seconds since :meth:`start`, read once per optimizer step (:meth:`tick`): the one clock the schedule and the
    stopping rule share. Across processes (DDP) every process takes the slowest one's reading, so all stop after the
    same step and step at the same learning rate (their weights stay identical)."""

    def __init__(self) -> None:
        self.started: float | None = None
        self.elapsed = 0.0

    def start(self) -> None:
        self.started, self.elapsed = time.monotonic(), 0.0

    def tick(self, device) -> float:
        elapsed = 0.0 if self.started is None else time.monotonic() - self.started
        if torch.distributed.is_available() and torch.distributed.is_initialized() \
                and torch.distributed.get_world_size() > 1:
            reading = torch.tensor([elapsed], dtype=torch.float64, device=device)
            torch.distributed.all_reduce(reading, op=torch.distributed.ReduceOp.MAX)
            elapsed = float(reading)
        self.elapsed = elapsed
        return elapsed


def time_budget_factor(fraction: float, schedule: str, warmup_fraction: float) -> float:
    """Learning-rate factor at ``fraction`` of the budget: linear warm-up, then the schedule's decay to 0 at 1."""
    if schedule not in TIME_SCHEDULES:
        raise ValueError(f"max_train_seconds schedules the learning rate by the clock and supports lr_scheduler_type "
                         f"{', '.join(TIME_SCHEDULES)}; got {schedule!r}.")
    fraction = min(max(fraction, 0.0), 1.0)
    if schedule != "constant" and fraction < warmup_fraction:
        return fraction / warmup_fraction
    if schedule in ("constant", "constant_with_warmup"):
        return 1.0
    progress = (fraction - warmup_fraction) / max(1.0 - warmup_fraction, 1e-9)
    if schedule == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def check_time_budget(seconds: float, schedule: str, warmup: float) -> None:
    """Refuses a budget the clock cannot schedule: ``seconds`` <= 0, a schedule other than :data:`TIME_SCHEDULES`, or a
    warm-up that is not a fraction of the budget (a whole number of steps means nothing against a clock)."""
    if seconds <= 0:
        raise ValueError(f"max_train_seconds must be > 0, got {seconds}.")
    if not 0 <= warmup < 1:
        raise ValueError(f"with max_train_seconds, warmup_steps is a fraction of the budget (0 <= w < 1), got "
                         f"{warmup}.")
    time_budget_factor(0.0, schedule, warmup)


def time_budget_scheduler(optimizer, seconds: float, schedule: str, warmup: float, clock: WallClock) -> LambdaLR:
    """A ``LambdaLR`` whose factor follows ``clock`` over ``seconds`` (see :func:`check_time_budget`)."""
    check_time_budget(seconds, schedule, warmup)

    def factor(step: int) -> float:  # a plain function: LambdaLR checkpoints no state of it, so a resume restarts it
        return time_budget_factor(clock.elapsed / seconds, schedule, warmup)

    return LambdaLR(optimizer, factor)


class TimeBudgetCallback(TrainerCallback):
    """Starts the clock when training starts, reads it once per optimizer step, and stops training once ``seconds``
    have passed (the Trainer then ends as after its last step: final logs, and the caller's save)."""

    def __init__(self, seconds: float, clock: WallClock) -> None:
        self.seconds = seconds
        self.clock = clock

    def on_train_begin(self, args, state, control, **kwargs):
        self.clock.start()

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.clock.tick(args.device)  # after the update, before the scheduler reads the clock for the next one

    def on_step_end(self, args, state, control, **kwargs):
        if self.clock.elapsed >= self.seconds:
            control.should_training_stop = True
        return control
