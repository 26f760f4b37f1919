"""Measurements of a trained drafter: held-out acceptance per depth, rank calibration, the step latency model."""
