"""Kernel models: what a kernel allocates on the target beyond the outputs a fake tensor shows.

CUDA (``cuda``: cuBLAS and the caching allocator's view of a step; ``cudnn``: convolution workspaces;
``cuda_reduce``, ``fused_loss``, ``quantized``, ``lowbit``, ``paged``), the CPU (``cpu_probe``: CPU
kernels run for real beside the trace) and gloo's collectives.
"""
