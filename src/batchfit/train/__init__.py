"""Training: exact gradient accumulation, OOM recovery, data parallelism, checkpoints."""
