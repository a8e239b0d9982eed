"""The fake step: a workload built and trained on fake tensors, every storage's birth and death recorded.

``fake_step.trace_workload`` is the entry; ``tracker`` is the dispatch mode that sees storages, ``tracer``
the recording, ``values`` and ``construct`` what a step needs on fake tensors, ``compat`` and
``overrides`` the libraries and kernels that need help, ``model_parallel`` one rank of a layout.
"""
