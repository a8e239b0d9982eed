"""Which autograd node made a storage: the tracker's tokens (NOTE [ Autograd node tokens ] in
``memory/trace/tracker.py``), and the engine's in-place accumulation they decide."""

from __future__ import annotations

import torch

from batchfit.memory.trace.construct import fake_session
from batchfit.memory.trace.tracer import Tracer
from batchfit.memory.trace.tracker import StorageTracker


class _Wrapper:
    """Stands for the Python wrapper ``torch._C._current_autograd_node()`` hands out for a running node."""


def _tracker() -> StorageTracker:
    return StorageTracker(lambda sid, nbytes: None, lambda sid: None)


def test_a_node_keeps_its_token_while_it_runs_and_the_next_gets_another() -> None:
    tracker = _tracker()
    first = _Wrapper()
    token = tracker.node_token(first)
    assert tracker.node_token(first) == token  # every call while it runs
    assert tracker.node_token(None) is None  # no node: the forward
    second = _Wrapper()
    assert tracker.node_token(second) not in (None, token)


def test_a_wrapper_at_an_earlier_nodes_address_is_another_node() -> None:
    """A node's wrapper dies when nothing references it, and CPython gives its address to the next object of its
    size: an earlier node's storages must not pass for the running node's (by ``id`` they would)."""
    tracker = _tracker()
    earlier = _Wrapper()
    earlier_token = tracker.node_token(earlier)
    tracker.node_token(_Wrapper())  # the next node: the tracker now holds its wrapper, not the earlier one's
    address = id(earlier)
    del earlier
    running = _Wrapper()
    assert id(running) == address  # the freed address, taken again (what makes ``id`` unfit to name a node)
    assert tracker.node_token(running) != earlier_token


def test_two_gradients_that_meet_are_added_in_place_in_every_block() -> None:
    """A tensor used twice in each of four blocks: the engine adds its two gradients into the first one's
    storage (``input_buffer.cpp``), in every block, so the backward holds no third gradient-sized buffer."""

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(256, 256, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.linear(x)
            return y.sin() * y.cos()  # y's two gradients meet

    with fake_session():
        model = torch.nn.Sequential(*[Block() for _ in range(4)])
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        tracer = Tracer(model, optimizer)
        with tracer:
            tracer.mark("backward", 0)
            model(torch.ones(64, 256, requires_grad=True)).sum().backward()
    trace = tracer.trace
    adds = [e for e in trace.events if e >= 0 and trace.op.get(e) == "aten.add.Tensor"]
    assert adds == []  # each accumulation ran in place: no storage made by an add
