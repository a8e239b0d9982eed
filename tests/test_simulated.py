"""The simulated device: a GPU's capacity enforced on real CPU tensors, through the allocator model."""

from __future__ import annotations

import contextlib

import pytest
import torch

from batchfit import SimulatedDevice, get_device

MiB = 2**20


def test_oom_exactly_where_the_allocator_runs_out() -> None:
    with SimulatedDevice("64MiB") as gpu:
        a = torch.empty(10 * MiB // 4 * 4)  # 40 MiB of fp32: one 40 MiB segment
        assert gpu.stats().reserved_bytes == 40 * MiB
        b = torch.empty(5 * MiB // 4)  # 5 MiB: a new 20 MiB segment, 60 MiB reserved
        assert gpu.stats().reserved_bytes == 60 * MiB
        with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate"):
            torch.empty(5 * MiB // 4 * 4)  # 20 MiB more does not fit in the 4 MiB left
        del a, b


def test_freed_tensors_return_their_blocks_and_retry_frees_the_cache() -> None:
    with SimulatedDevice("64MiB") as gpu:
        a = torch.empty(10 * MiB)  # 40 MiB
        del a
        assert gpu.stats().allocated_bytes == 0 and gpu.stats().reserved_bytes == 40 * MiB
        b = torch.empty(12 * MiB)  # 48 MiB: fits only once the cached 40 MiB segment is released
        assert gpu.stats().num_alloc_retries == 1
        assert gpu.stats().reserved_bytes == 48 * MiB
        del b


def test_track_puts_existing_tensors_on_the_device() -> None:
    model = torch.nn.Linear(1024, 1024)  # 4 MiB + 4 KiB
    with SimulatedDevice("1GiB") as gpu:
        gpu.track(model)
        assert gpu.stats().allocated_bytes == 4 * MiB + 4096


def test_a_catalog_gpu_gives_its_capacity_less_the_context() -> None:
    dev = get_device("T4")
    sim = SimulatedDevice("T4")
    assert sim.capacity_bytes == dev.total_bytes - dev.context_bytes


def test_nothing_is_tracked_after_exit() -> None:
    sim = SimulatedDevice("64MiB")
    with sim:
        a = torch.empty(10)
    before = sim.stats().allocated_bytes
    b = torch.empty(10 * MiB)
    assert sim.stats().allocated_bytes == before
    del a, b


# -- what the simulated GPU holds: see NOTE [ What the simulated GPU holds ] --------------------------------------
def test_views_and_in_place_ops_of_a_host_tensor_allocate_nothing() -> None:
    host = torch.empty(MiB)  # 4 MiB of fp32, made before the device is entered
    with SimulatedDevice("64MiB") as gpu:
        piece = host[10:20]  # the micro-batch slice of a global batch
        host.add_(1.0)
        flat = host.view(-1)
        assert gpu.stats().allocated_bytes == 0 and gpu.stats().peak_allocated_bytes == 0
        assert not gpu.holds(piece) and not gpu.holds(flat)
        doubled = host * 2  # a fresh output: made on the device
        assert gpu.holds(doubled) and gpu.stats().allocated_bytes == 4 * MiB
        view = doubled[:5]  # a view of a device tensor is on the device, and allocates nothing more
        assert gpu.holds(view) and gpu.stats().allocated_bytes == 4 * MiB
        del doubled, view
    assert gpu.stats().allocated_bytes == 0


def test_to_device_copies_host_tensors_once_entered_or_not() -> None:
    host = torch.arange(1000, dtype=torch.float32)  # 4,000 B (values: NaN would make torch.equal fail)
    for entered in (True, False):
        gpu = SimulatedDevice("64MiB")
        with gpu if entered else contextlib.nullcontext():
            x, (y,) = gpu.to_device((host[:300], [host[300:]]))  # 1,200 B and 2,800 B
            assert gpu.holds(x) and gpu.holds(y) and torch.equal(torch.cat([x, y]), host)
            assert gpu.stats().allocated_bytes == 1536 + 3072  # each rounded up to 512 B
            assert gpu.to_device(x) is x  # already there: no second copy
            assert gpu.stats().allocated_bytes == 1536 + 3072
            del x, y
        assert gpu.stats().allocated_bytes == 0


def test_a_copy_that_does_not_fit_leaves_nothing_on_the_device() -> None:
    gpu = SimulatedDevice("64MiB")
    kept = gpu.to_device(torch.empty(10 * MiB))  # 40 MiB
    with pytest.raises(torch.OutOfMemoryError):
        gpu.to_device(torch.empty(10 * MiB))
    assert gpu.stats().allocated_bytes == 40 * MiB
    del kept


def test_using_enters_a_device_only_when_it_is_not_entered() -> None:
    gpu = SimulatedDevice("64MiB")
    with gpu.using():
        assert gpu.active
        with gpu.using():  # nested: the outer entry stays
            a = torch.empty(MiB)
        assert gpu.active and gpu.holds(a)
    assert not gpu.active
    b = torch.empty(MiB)
    assert not gpu.holds(b)
    del a, b


def test_labels_name_the_capacity_or_the_catalog_gpu() -> None:
    assert SimulatedDevice("64MiB").label == "a simulated 64.00 MiB GPU"
    assert SimulatedDevice("T4").label == "a simulated T4 GPU"


class _Pooled(torch.nn.Module):
    """Items of 1 MiB (128 x 1024 float64) averaged to 128 features, then a linear classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Linear(128, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x.mean(dim=-1))  # (b, 128) -> (b, 3)


def _pooled_loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(model(batch[0]), batch[1])


@pytest.mark.parametrize("entered", [True, False], ids=["entered", "not-entered"])
def test_a_global_batch_larger_than_the_simulated_gpu_runs_when_its_micro_batches_fit(entered: bool) -> None:
    from batchfit.train.trainer import Trainer

    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randn(64, 128, 1024, generator=gen, dtype=torch.float64), torch.randint(0, 3, (64,)))
               for _ in range(2)]  # fmt: skip
    assert batches[0][0].nbytes == 64 * MiB  # each global batch: 64 MiB on the host
    torch.manual_seed(0)
    reference = _Pooled().double()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for batch in batches:
        _pooled_loss(reference, batch).backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    model = _Pooled().double()
    gpu = SimulatedDevice("48MiB")
    with gpu if entered else contextlib.nullcontext():
        trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), _pooled_loss,
                          global_batch_size=64, micro_batch_size=4, device=gpu)  # fmt: skip
        results = [trainer.step(batch) for batch in batches]
    assert all(r.micro_batch_sizes == (4,) * 16 and not r.replanned for r in results)
    stats = gpu.stats()
    assert stats.num_ooms == 0 and stats.peak_reserved_bytes <= 48 * MiB < batches[0][0].nbytes
    assert stats.peak_allocated_bytes >= 4 * MiB  # one 4-item micro-batch on the device at a time
    for p, q in zip(model.parameters(), reference.parameters()):
        assert ((p - q).abs().max() / q.abs().max()).item() <= 1e-12


def test_scratch_a_kernel_holds_together_is_freed_on_return() -> None:
    # The CUDA kernel model keeps a kernel's buffers alive together and frees them when it returns (bitsandbytes'
    # dequantised weights): the simulated device must take and give back the same blocks.
    dev = SimulatedDevice("1GiB")
    ids = [dev.add_scratch(n, "scratch", transient=False) for n in (3 * 2**20, 512)]
    assert dev.allocator.allocated_bytes == 3 * 2**20 + 512
    dev.free_scratch(reversed(ids))
    assert dev.allocator.allocated_bytes == 0 and dev.allocator.peak_allocated_bytes == 3 * 2**20 + 512
