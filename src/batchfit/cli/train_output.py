"""What ``batchfit train`` shows: a progress bar on stderr while it runs, a table or JSON at the end.

The bar carries the last step's loss, micro-batch split, items per second and peak memory, and
batchfit's log (out-of-memory re-plans, advice) is routed through its console so the two do not
interleave; the table lists every step with its notes. rich is imported only when these run.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from ..units import format_bytes


def _split_text(sizes: tuple[int, ...]) -> str:
    """``16 x 4`` for even micro-batches, ``4+3+3`` for short uneven ones."""
    if len(set(sizes)) == 1:
        return f"{sizes[0]} x {len(sizes)}"
    if len(sizes) <= 4:
        return "+".join(str(s) for s in sizes)
    return f"{len(sizes)} of {min(sizes)}-{max(sizes)}"


class _Progress:
    """A rich progress bar on stderr showing the last step's loss, split, items/s and memory."""

    def __init__(self, steps: int) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.console = Console(stderr=True)
        self._bar = Progress(
            TextColumn("train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[status]}"),
            TimeElapsedColumn(),
            console=self.console,
            transient=True,
        )
        self._task = self._bar.add_task("train", total=steps, status="")

    def advance(self, row: dict[str, Any]) -> None:
        """One more step done; ``row`` is the step's row of the run's summary."""
        split = _split_text(tuple(row["micro_batch_sizes"]))
        memory = "" if row["peak_reserved_bytes"] is None else f"  peak {format_bytes(row['peak_reserved_bytes'])}"
        status = f"loss {row['loss']:.4f}  micro x accum {split}  {row['items_per_s']:,.0f} items/s{memory}"
        self._bar.update(self._task, advance=1, status=status)


@contextlib.contextmanager
def _progress(steps: int) -> Iterator[_Progress]:
    progress = _Progress(steps)
    with progress._bar:
        yield progress


def _log_to(stack: contextlib.ExitStack, console: Any) -> None:
    """Route batchfit's log (OOM re-plans, advice) through the progress bar's console while it runs."""
    from rich.logging import RichHandler

    logger = logging.getLogger("batchfit")
    handler = RichHandler(console=console, show_time=False, show_path=False, level=logging.INFO)
    logger.addHandler(handler)
    stack.callback(logger.removeHandler, handler)
    if logger.level == logging.NOTSET or logger.level > logging.INFO:
        old = logger.level
        logger.setLevel(logging.INFO)
        stack.callback(logger.setLevel, old)


def _print_table(summary: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    rows = summary["steps"]
    first = rows[0]
    console = Console()
    if "accumulation_steps" not in first:  # resumed from a checkpoint of the last step: no step ran
        console.print(
            f"batchfit train {summary['preset']}: the checkpoint is already at step {first['step']}; "
            "nothing left to run (ask for more --steps to continue)",
            soft_wrap=True,
        )
        return
    console.print(
        f"batchfit train {summary['preset']}: global batch {summary['global_batch_size']} = micro-batch "
        f"{first['micro_batch_size']} x {first['accumulation_steps']} accumulation steps on {summary['device']}"
        + (f", FSDP over {summary['world_size']} ranks" if summary["sharded"] else "")
        + (" (planned)" if summary["plan"] else ""),
        soft_wrap=True,
    )
    table = Table()
    for name in ("step", "loss", "micro x accum", "items/s"):
        table.add_column(name, justify="right")
    show_memory = rows[0]["peak_reserved_bytes"] is not None
    if show_memory:
        table.add_column("peak reserved", justify="right")
    table.add_column("note")
    for row in rows:
        cells = [str(row["step"] + 1), f"{row['loss']:.4f}", _split_text(tuple(row["micro_batch_sizes"]))]
        cells.append(f"{row['items_per_s']:,.0f}")
        if show_memory:
            cells.append(format_bytes(row["peak_reserved_bytes"]))
        notes = [
            f"OOM in {r['phase']}: micro {r['from_micro_batch_size']} -> {r['to_micro_batch_size']}"
            for r in row["replanned"]
        ]
        if row["skipped"]:
            notes.append("fp16 overflow: step skipped")
        table.add_row(*cells, "; ".join(notes))
    console.print(table)
    for text in summary["advice"]:
        console.print(f"advice: {text}", soft_wrap=True)
    if summary["saved"]:
        console.print(f"saved the final weights to {summary['saved']}")
