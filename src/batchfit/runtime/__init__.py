"""Steps run for real: on a simulated GPU (the allocator model enforcing a capacity on CPU tensors), on
the CUDA GPU at hand (fit's verification, ``calibrate``), and watched while they run (the monitor)."""
