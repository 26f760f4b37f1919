"""Training data: chat tokenization, prepared target states, self-distilled answers, target trees, NDE rows, and the
resumable chunk folders they are written to."""
