"""The GPU side: what a device is, and how batchfit measures a real one.

``catalog`` names the GPUs (capacity, architecture, context and workspace constants) and parses
capacities; ``profiles`` stores what ``calibrate`` measured on a GPU; ``context`` picks the CUDA
context an estimate assumes (profile, override, eager or default); ``_cuda`` holds the few helpers
that touch ``torch.cuda`` (kept small so tests replace them with fakes); ``monitor`` reads memory
during training (``torch.cuda`` stats and NVML); ``simulated`` is a capacity enforced by the
allocator model, standing in for a GPU on a CPU-only machine.
"""
