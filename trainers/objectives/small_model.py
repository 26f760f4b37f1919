"""`SmallModelTrainerMixin`: what a Trainer of a small policy component (delay selector, C2T classifier) shares.

Those models are plain ``nn.Module``s with their own ``save_pretrained`` / ``from_pretrained``; checkpoints and the
final output must be folders the inference side loads directly (``tree_selector=``, ``c2t_classifier=``), and their
evaluation is the loss alone.
"""

from __future__ import annotations

import os

import torch


class SmallModelTrainerMixin:
    """Mix in before ``transformers.Trainer``."""

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    def _save(self, output_dir: str | None = None, state_dict=None) -> None:
        """Checkpoints and the final output are the model's own ``save_pretrained`` folders."""
        from transformers.trainer import TRAINING_ARGS_NAME

        if not self.args.should_save:  # several processes: the main one writes
            return
        output_dir = output_dir or self.args.output_dir
        os.makedirs(output_dir, exist_ok=True)
        self.accelerator.unwrap_model(self.model).save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))
