"""What a byte of training memory is for.

A storage can play several roles over its life (an op output that autograd then saves is an
activation; a gradient produced by a backward op and then accumulated into ``.grad`` is a gradient
from birth). Each storage gets the strongest role it ever plays, by ``PRIORITY`` below, so a breakdown
at any instant says why each byte is still alive.
"""

from __future__ import annotations

from enum import Enum


class Category(str, Enum):
    """The six components of training memory (the keys of ``Estimate.breakdown``)."""

    PARAMETERS = "parameters"
    """Parameters and buffers: alive for the whole run."""
    GRADIENTS = "gradients"
    """``.grad`` of trainable parameters, from the backward op that makes them to ``zero_grad``."""
    OPTIMIZER_STATES = "optimizer_states"
    """Tensors held in ``optimizer.state`` (Adam moments, momentum buffers, step counters)."""
    ACTIVATIONS = "activations"
    """Tensors autograd saved in the forward pass for the backward pass."""
    BATCH_DATA = "batch_data"
    """The batch itself, as the batch function made it."""
    TEMPORARIES = "temporaries"
    """Everything else: op outputs not kept, gradients of activations, optimizer scratch, workspaces."""


#: Strongest role first: a storage is counted under the first of these it ever plays.
PRIORITY: tuple[Category, ...] = (
    Category.PARAMETERS,
    Category.OPTIMIZER_STATES,
    Category.GRADIENTS,
    Category.BATCH_DATA,
    Category.ACTIVATIONS,
    Category.TEMPORARIES,
)
RANK = {c: i for i, c in enumerate(PRIORITY)}

#: The order in which tables and plots list the categories (the order of the memory equation).
ORDER: tuple[Category, ...] = (
    Category.PARAMETERS,
    Category.GRADIENTS,
    Category.OPTIMIZER_STATES,
    Category.ACTIVATIONS,
    Category.BATCH_DATA,
    Category.TEMPORARIES,
)


def stronger(a: Category, b: Category) -> Category:
    """The role that wins when a storage plays both ``a`` and ``b``."""
    return a if RANK[a] <= RANK[b] else b
