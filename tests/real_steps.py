"""Real training steps inside a ``SimulatedDevice``, written apart from the fitter's own verification so that
agreeing with it means something (``test_fit.py``, ``test_fit_seq_len.py``)."""

from __future__ import annotations

import gc

import torch

from batchfit import SimulatedDevice, Workload
from batchfit.memory.steps import loss_for_backward
from batchfit.workload import trainable_parameters


def two_real_steps_fit(workload: Workload, batch_size: int, capacity: str) -> bool:
    """Two real training steps inside a fresh ``SimulatedDevice``; False when it raises its OOM.

    Written independently of the fitter's own verification, so that agreeing with it means something.
    The optimizer's ``foreach=None`` is resolved to True, as torch does for CUDA parameters: the
    simulated device stands for a GPU, and the foreach step allocates temporaries the loop version
    does not.
    """
    model = workload.build_model()
    model.train()
    optimizer = workload.optimizer(trainable_parameters(model))
    for group in optimizer.param_groups:
        if group.get("foreach", False) is None:
            group["foreach"] = True
    gpu = SimulatedDevice(capacity)
    try:
        with gpu:
            gpu.track(model)
            for _ in range(2):  # the first step creates the optimizer state, the second is the steady state
                batch = workload.batch(batch_size)
                loss = loss_for_backward(workload.loss(model, batch))
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            del batch, loss
        return True
    except torch.OutOfMemoryError:
        return False
    finally:
        del model, optimizer
        gc.collect()
