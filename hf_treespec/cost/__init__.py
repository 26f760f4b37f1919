"""What a step costs on this machine: the cost curve c(rows, context), the speed model behind
``tree_budget="auto"`` and its per-step rule (`TreeSizer`), the loops' clock and the hardware facts (CPU flags,
fast dtype)."""

from .curve import CostCurve, calibrate_target, load_or_calibrate
from .sizer import TreeSizer
from .speed_model import AcceptanceTable, SpeedModel, forget_speed_models, speed_model_for

__all__ = ["AcceptanceTable", "CostCurve", "SpeedModel", "TreeSizer", "calibrate_target", "forget_speed_models",
           "load_or_calibrate", "speed_model_for"]
