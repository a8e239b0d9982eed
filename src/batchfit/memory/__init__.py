"""Memory of a training step: trace it on fake tensors, replay it through a CUDA allocator model."""
