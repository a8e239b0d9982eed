"""Search cost: how many training steps each batch-size finder runs, and whether it finds the true maximum.

Every finder runs on the same simulated GPU (``SimulatedDevice``: real CPU tensors, a CUDA caching-allocator
model that raises ``torch.OutOfMemoryError``), and every trial is the same thing: two real training steps
of the workload in a fresh simulated device, an OOM meaning "does not fit".

- **true max**: found independently of batchfit, with real steps only: double from 1 until a trial fails,
  then bisect (memory is assumed to grow with the batch size).
- **batchfit**: ``fit(workload, SimulatedDevice(capacity))``. Its trials are two traces on fake tensors
  (no memory used, nothing can crash) and the real steps that verify the answer and its successor.
  It should need four trials, so it gets ``--fit-seconds`` (30 s) and a row where it runs out of time
  counts as a failure.
- **binsearch**: Lightning's ``Tuner.scale_batch_size(mode="binsearch")`` (``_run_binary_scaling`` in
  ``lightning/pytorch/tuner/batch_size_scaling.py``): start at ``init_val=2``, double after each
  success until an OOM, then bisect between the last success and the failure; it stops after
  ``max_trials=25`` successes. Lightning runs ``steps_per_trial=3`` steps per trial; here a trial is
  the same two steps as for the others, and trials are counted.
- **x0.9**: Accelerate's ``find_executable_batch_size`` (``accelerate/utils/memory.py``) started at 512:
  on OOM, ``batch_size = int(batch_size * 0.9)``; the first size that runs is the answer. It never
  looks above its start, so its answer is only the maximum when the maximum is below 512.

A simulated trial is deterministic (allocation sizes do not depend on tensor values), so trials of
the true-max search and of the two baselines share one memo of results per (workload, capacity):
each method's trial count is what it would run on its own; only the benchmark's run time is saved.

A second table compares ``batchfit.sweep``'s knee (the smallest batch size within 3% of the best
measured throughput, over powers of two) with the best of an exhaustive sweep of every batch size
in the same range on this CPU: the knee should reach at least 97% of that best throughput. Throughput
is wall time on a possibly shared machine, so the verdict rests on re-timing the two head to head
(three rounds in alternating order, median ratio), not on the sweeps' single passes.

Run: ``.venv/bin/python benchmarks/search_cost.py`` (``--help`` for options). Exits with status 1
when batchfit is not exact in at most four trials on every row.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import signal
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from rich.console import Console
from rich.table import Table

from batchfit import SimulatedDevice, Workload, presets
from batchfit.memory.steps import loss_for_backward
from batchfit.planning.fit import fit
from batchfit.workload import trainable_parameters

CAPACITIES = ("32MiB", "96MiB", "192MiB")
MAX_BATCHFIT_TRIALS = 4
LIGHTNING_INIT_VAL = 2
LIGHTNING_MAX_TRIALS = 25
ACCELERATE_START = 512
KNEE_SHARE = 0.97
HEAD_TO_HEAD_ROUNDS = 3


def workloads(with_hf: bool) -> dict[str, Workload]:
    """Small presets, so that a real step takes milliseconds; a shrunk transformers GPT-2 if available."""
    out = {
        "mlp": presets.get("mlp"),
        "cnn": presets.get("cnn"),
        "gpt (2x64, T=32)": presets.get("gpt", n_layer=2, n_embd=64, n_head=2, vocab_size=256, seq_len=32),
    }
    if with_hf and "hf-gpt2" in presets.names():
        out["hf-gpt2 (2x64, T=32)"] = presets.get(
            "hf-gpt2", n_layer=2, n_embd=64, n_head=2, vocab_size=256, seq_len=32, n_positions=32
        )
    return out


# -- one trial: two real steps in a fresh simulated GPU ------------------------------------------------
def two_real_steps_fit(workload: Workload, batch_size: int, capacity: str) -> bool:
    """Two real training steps of ``workload`` at ``batch_size`` inside a fresh ``SimulatedDevice``.

    Two steps, because the first creates the optimizer's state and the second is the steady state.
    The optimizer's ``foreach=None`` is resolved to True as torch does for CUDA parameters, since the
    simulated device stands for a GPU. Returns False on the simulated OOM.
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
            for _ in range(2):
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


class Trials:
    """A finder's view of the device: ``trials(b)`` runs (or recalls) one trial and counts it."""

    def __init__(self, run: Callable[[int], bool], memo: dict[int, bool]) -> None:
        self._run, self._memo = run, memo
        self.count = 0

    def __call__(self, batch_size: int) -> bool:
        self.count += 1
        if batch_size not in self._memo:
            self._memo[batch_size] = self._run(batch_size)
        return self._memo[batch_size]


# -- the finders ------------------------------------------------------------------------------------------
def true_max(fits: Callable[[int], bool]) -> int:
    """The largest batch size that runs (0 if none): double from 1 until a failure, then bisect."""
    if not fits(1):
        return 0
    lo, hi = 1, 2
    while fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def lightning_binsearch(fits: Callable[[int], bool]) -> int:
    """Lightning's ``mode="binsearch"``, step for step (its ``low`` starts at 1, ``high`` unknown).

    As in Lightning, the answer after a failure at ``init_val`` is ``(2 + 1) // 2 == 1``, untried.
    """
    new_size, low, high, successes = LIGHTNING_INIT_VAL, 1, None, 0
    while True:
        if fits(new_size):
            successes += 1
            if successes > LIGHTNING_MAX_TRIALS:
                break
            low = new_size
            if high:
                if high - low <= 1:
                    break
                new_size = (high + low) // 2
            else:
                new_size *= 2
        else:
            high = new_size
            new_size = (high + low) // 2
            if high - low <= 1:
                break
    return new_size


def accelerate_decrement(fits: Callable[[int], bool]) -> int:
    """Accelerate's ``find_executable_batch_size`` from 512: shrink by 10% after each OOM (0: none ran)."""
    batch_size = ACCELERATE_START
    while batch_size > 0:
        if fits(batch_size):
            return batch_size
        batch_size = int(batch_size * 0.9)
    return 0


class TimeLimit(Exception):
    """The fitter ran past its time limit (it is meant to take a few steps, so this is a failure)."""


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise ``TimeLimit`` in the main thread after ``seconds`` (between two Python bytecodes)."""

    def expire(signum: int, frame: object) -> None:
        raise TimeLimit

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@dataclass
class Row:
    preset: str
    capacity: str
    true_max: int
    batchfit: tuple[int, int, int] | None
    """(found, trials, of which ran real steps); None when it ran past its time limit."""
    binsearch: tuple[int, int]
    decrement: tuple[int, int]

    @property
    def batchfit_ok(self) -> bool:
        if self.batchfit is None:
            return False
        found, trials, _ = self.batchfit
        return found == self.true_max and trials <= MAX_BATCHFIT_TRIALS


def measure(name: str, workload: Workload, capacity: str, fit_seconds: float) -> Row:
    memo: dict[int, bool] = {}

    def run(b: int) -> bool:
        return two_real_steps_fit(workload, b, capacity)

    truth = Trials(run, memo)
    best = true_max(truth)
    found: tuple[int, int, int] | None
    try:
        with time_limit(fit_seconds):
            result = fit(workload, SimulatedDevice(capacity))
        found = (result.max_batch_size, result.trials, sum(a.kind == "real" for a in result.attempts))
    except TimeLimit:
        found = None
    lightning = Trials(run, memo)
    found_lightning = lightning_binsearch(lightning)
    accelerate = Trials(run, memo)
    found_accelerate = accelerate_decrement(accelerate)
    return Row(
        name,
        capacity,
        best,
        found,
        (found_lightning, lightning.count),
        (found_accelerate, accelerate.count),
    )


def cell(found: int, trials: int, truth: int) -> str:
    mark = "[green]" if found == truth else "[yellow]"
    return f"{mark}{found}[/] / {trials}"


def search_table(rows: list[Row], limit: float) -> Table:
    table = Table(title="Batch-size search on a simulated GPU: found / trials (a trial = 2 real steps)")
    for header in ("preset", "capacity", "true max", "batchfit", "binsearch (Lightning)", "x0.9 (Accelerate)"):
        table.add_column(header, justify="left" if header == "preset" else "right")
    for r in rows:
        if r.batchfit is None:
            ours = f"[red]no answer in {limit:.0f} s[/]"
        else:
            found, trials, real = r.batchfit
            ours = f"{cell(found, trials, r.true_max)} ({real} real)"
        table.add_row(
            r.preset,
            r.capacity,
            str(r.true_max),
            ours,
            cell(*r.binsearch, r.true_max),
            cell(*r.decrement, r.true_max),
        )
    return table


# -- the sweep's knee against an exhaustive sweep -----------------------------------------------------------
def knee_table(console: Console, named: dict[str, Workload], steps: int) -> tuple[Table, bool]:
    """One row per workload: the knee over powers of two, the best of every size in the same range."""
    from batchfit.planning.sweep import default_batch_sizes, sweep

    title = f"Sweep knee vs the best of an exhaustive sweep on this CPU (>= {KNEE_SHARE:.0%} of its items/s)"
    table = Table(title=title)
    for header in ("preset", "knee", "exhaustive best", "knee / best (sweep)", "knee / best (head to head)", "ok"):
        table.add_column(header, justify="left" if header == "preset" else "right")
    all_ok = True
    for name, workload in named.items():
        start = time.perf_counter()
        knee = sweep(workload, "cpu", steps=steps, measure_memory=False).knee
        every = list(range(1, max(default_batch_sizes()) + 1))
        exhaustive = sweep(workload, "cpu", batch_sizes=every, steps=steps, measure_memory=False)
        speed = {p.batch_size: p.items_per_second for p in exhaustive.points}
        best = max(speed, key=speed.__getitem__)
        in_sweep = speed[knee] / speed[best]
        # Wall time on a shared machine is noisy: settle the verdict by timing the two again, longer,
        # in alternating order, and taking the median of the rounds' ratios.
        ratios = []
        for round_ in range(HEAD_TO_HEAD_ROUNDS):
            order = (knee, best) if round_ % 2 == 0 else (best, knee)
            timed = {
                b: sweep(workload, "cpu", batch_sizes=[b], steps=4 * steps, measure_memory=False).points[0]
                for b in order
            }
            ratios.append(timed[knee].items_per_second / timed[best].items_per_second)
        head_to_head = statistics.median(ratios)
        ok = head_to_head >= KNEE_SHARE
        all_ok &= ok
        table.add_row(
            name,
            str(knee),
            str(best),
            f"{in_sweep:.3f}",
            f"{head_to_head:.3f}",
            "[green]yes[/]" if ok else "[red]no[/]",
        )
        console.log(f"swept {name} in {time.perf_counter() - start:.0f} s")
    return table, all_ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--capacities", default=",".join(CAPACITIES), help="simulated GPU capacities")
    parser.add_argument("--fit-seconds", type=float, default=30.0, help="time limit of one batchfit fit")
    parser.add_argument("--hf", action="store_true", help="add a shrunk transformers GPT-2 (slower)")
    parser.add_argument("--no-sweep", action="store_true", help="skip the sweep-knee table")
    parser.add_argument("--sweep-steps", type=int, default=5, help="timed steps per batch size in the sweeps")
    # One thread by default: on a shared machine, OpenMP threads that spin-wait for a busy core make
    # wall times swing by 10x, and the knee is a comparison of wall times.
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: torch's choice)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    console = Console(width=None if sys.stdout.isatty() else 120)
    all_workloads = workloads(with_hf=args.hf)
    start = time.perf_counter()

    rows = []
    for name, workload in all_workloads.items():
        for capacity in args.capacities.split(","):
            t0 = time.perf_counter()
            rows.append(measure(name, workload, capacity.strip(), args.fit_seconds))
            console.log(f"{name} on {capacity}: {time.perf_counter() - t0:.0f} s")
    console.print(search_table(rows, args.fit_seconds))
    missed = [f"{r.preset} @ {r.capacity}" for r in rows if not r.batchfit_ok]
    verdict = "[green]yes[/]" if not missed else f"[red]NO[/] ({', '.join(missed)})"
    console.print(f"batchfit exact in <= {MAX_BATCHFIT_TRIALS} trials on every row: {verdict}")

    if args.no_sweep:
        console.print("sweep-knee table skipped (--no-sweep)")
    else:
        try:
            import batchfit.planning.sweep  # noqa: F401
        except ImportError:
            console.print("sweep-knee table skipped: batchfit.sweep is not available")
        else:
            own = {n: w for n, w in all_workloads.items() if not n.startswith("hf-")}
            table, knee_ok = knee_table(console, own, args.sweep_steps)
            console.print(table)
            console.print(
                f"sweep knee within {KNEE_SHARE:.0%} of the exhaustive best on every preset: "
                + ("[green]yes[/]" if knee_ok else "[red]no[/] (wall-time measurement; see the head-to-head column)")
            )
    console.print(f"threads: {torch.get_num_threads()}, total time: {time.perf_counter() - start:.0f} s")
    return 0 if not missed else 1


if __name__ == "__main__":
    sys.exit(main())
