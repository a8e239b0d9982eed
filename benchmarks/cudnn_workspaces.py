"""cuDNN's workspaces on this GPU: what each convolution and LSTM call takes from the caching allocator.

``memory/kernels/cudnn.py`` cannot know which engine cuDNN's heuristics pick for a convolution (NOTE [ cuDNN
convolution workspaces ], item 4), nor the transient workspace of a cuDNN RNN call. This script measures them
on a GPU, one problem at a time, so that a rule can be read off many problems rather than off the convolutions
of the few networks whose steps were recorded:

- convolutions: a seeded random sample of 2-d problems (batch, channels, map size, kernel, stride, padding,
  groups, fp32 / bf16, NCHW), each direction called alone as a training step calls it (``aten.convolution``,
  ``aten.convolution_backward`` with only the input's or only the weight's gradient), twice: the first call
  builds cuDNN's plan, the second reuses it. The workspace is the call's peak of allocated bytes above what
  was allocated before it, less its output (each rounded as the caching allocator rounds it);
- LSTMs: forward and backward of ``nn.LSTM`` in train mode, each call's peak above its start and the bytes
  it leaves allocated;
- with ``--rnn-seconds``: one-dimensional sweeps around a 512-wide LSTM and GRU, then seeded random recurrent
  problems (LSTM with or without a projection, GRU, RNN; fp32, bf16, fp16; any depth and direction), each
  ``_cudnn_rnn`` / ``_cudnn_rnn_backward`` call's caching-allocator events (from the allocator's own history)
  and output sizes: the reserve, the transient workspace and what the backward takes, call by call.

``torch.backends.cudnn.benchmark`` stays off (PyTorch's default: heuristics, no timing search). Rows go to
``--out`` as JSON lines as they are measured, so a run stopped at its deadline keeps what it measured.

Run on a GPU: ``python benchmarks/cudnn_workspaces.py [--out DIR] [--seconds 100]
[--rnn-seconds 150 [--only-rnn]]`` (without a GPU it says so and
measures nothing).
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import time
from datetime import date
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.utils._python_dispatch

KERNELS = (  # (kernel, stride, padding) as CNNs use them
    ((1, 1), 1, (0, 0)), ((3, 3), 1, (1, 1)), ((3, 3), 2, (1, 1)), ((1, 1), 2, (0, 0)), ((7, 7), 2, (3, 3)),
    ((5, 5), 1, (2, 2)), ((1, 7), 1, (0, 3)), ((7, 1), 1, (3, 0)), ((3, 3), 1, (0, 0)), ((3, 3), 2, (0, 0)),
    ((4, 4), 4, (0, 0)), ((7, 7), 1, (3, 3)),
)  # fmt: skip
CHANNELS = (3, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 512, 768, 1024, 2048)
MAPS = (7, 8, 14, 17, 28, 35, 56, 73, 112, 147, 224)
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_LIMIT = 1 << 30  # the largest operand of a problem, in bytes


def _round(n: int) -> int:
    """The caching allocator's block size for a request of ``n`` bytes (``round_size``)."""
    return 512 * max(1, -(-n // 512)) if n else 0


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _peak_of(call: Any) -> tuple[int, Any]:
    """``call()``'s peak of allocated bytes above what was allocated before it, and what it returned."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = call()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before, out


def conv_problem(rng: random.Random) -> dict[str, Any] | None:
    (kh, kw), stride, (ph, pw) = rng.choice(KERNELS)
    c, k, h, n = rng.choice(CHANNELS), rng.choice(CHANNELS), rng.choice(MAPS), rng.choice(BATCHES)
    groups = c if rng.random() < 0.1 and c > 3 else 1  # some depthwise problems (k a multiple of c)
    if groups > 1:
        k = c * rng.choice((1, 1, 2))
    dtype = rng.choice(("fp32", "bf16"))
    size = 4 if dtype == "fp32" else 2
    oh, ow = (h + 2 * ph - kh) // stride + 1, (h + 2 * pw - kw) // stride + 1
    if oh < 1 or ow < 1 or max(n * c * h * h, n * k * oh * ow) * size > _LIMIT:
        return None
    return {"n": n, "c": c, "h": h, "w": h, "k": k, "kh": kh, "kw": kw, "stride": stride, "ph": ph, "pw": pw,
            "groups": groups, "dtype": dtype, "oh": oh, "ow": ow}  # fmt: skip


def measure_conv(p: dict[str, Any]) -> list[dict[str, Any]]:
    dtype = torch.float32 if p["dtype"] == "fp32" else torch.bfloat16
    x = torch.randn(p["n"], p["c"], p["h"], p["w"], device="cuda", dtype=dtype)
    w = torch.randn(p["k"], p["c"] // p["groups"], p["kh"], p["kw"], device="cuda", dtype=dtype)
    stride, padding, dilation = [p["stride"]] * 2, [p["ph"], p["pw"]], [1, 1]
    args = (stride, padding, dilation, False, [0, 0], p["groups"])
    dy = torch.randn(p["n"], p["k"], p["oh"], p["ow"], device="cuda", dtype=dtype)
    calls = {
        "forward": lambda: torch.ops.aten.convolution(x, w, None, *args),
        "backward data": lambda: torch.ops.aten.convolution_backward(dy, x, w, None, *args, [True, False, False])[0],
        "backward filter": lambda: torch.ops.aten.convolution_backward(dy, x, w, None, *args, [False, True, False])[1],
    }  # fmt: skip
    rows = []
    for direction, call in calls.items():
        for attempt in (1, 2):
            peak, out = _peak_of(call)
            rows.append({**p, "direction": direction, "call": attempt, "peak": peak, "output": _nbytes(out),
                         "workspace": peak - _round(_nbytes(out)),
                         "operands": _nbytes(x) + _nbytes(w) + _nbytes(dy)})  # fmt: skip
            del out
    return rows


LSTMS = (  # (input, hidden, layers, bidirectional, batch, sequence, dtype)
    (512, 1024, 2, False, 64, 128, "fp32"), (512, 1024, 2, False, 220, 128, "fp32"),
    (300, 256, 2, True, 64, 200, "fp32"), (300, 256, 2, True, 256, 200, "fp32"),
    (256, 256, 1, False, 32, 64, "fp32"), (256, 256, 1, True, 32, 64, "fp32"),
    (1024, 1024, 1, False, 32, 256, "fp32"), (1024, 1024, 4, False, 32, 256, "fp32"),
    (512, 512, 3, True, 16, 512, "fp32"), (128, 2048, 1, False, 8, 1024, "fp32"),
    (512, 1024, 2, False, 64, 128, "bf16"), (300, 256, 2, True, 64, 200, "bf16"),
    (1024, 1024, 2, True, 128, 64, "bf16"), (64, 64, 1, False, 1, 16, "fp32"),
)  # fmt: skip


def measure_lstm(spec: tuple) -> dict[str, Any]:
    inp, hidden, layers, bidirectional, batch, seq, name = spec
    dtype = torch.float32 if name == "fp32" else torch.bfloat16
    lstm = torch.nn.LSTM(inp, hidden, layers, batch_first=True, bidirectional=bidirectional).to("cuda", dtype)
    x = torch.randn(batch, seq, inp, device="cuda", dtype=dtype, requires_grad=True)
    row: dict[str, Any] = {"input": inp, "hidden": hidden, "layers": layers, "bidirectional": bidirectional,
                           "batch": batch, "seq": seq, "dtype": name}  # fmt: skip
    for attempt in (1, 2):
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        fwd_peak, (y, _) = _peak_of(lambda: lstm(x))
        kept = torch.cuda.memory_allocated() - start
        grad = torch.ones_like(y)
        before_bwd = torch.cuda.memory_allocated()
        bwd_peak, _ = _peak_of(partial(y.backward, grad))
        row.update({f"forward_peak_{attempt}": fwd_peak, f"forward_kept_{attempt}": kept,
                    f"output_{attempt}": _nbytes(y), f"backward_peak_{attempt}": bwd_peak,
                    f"backward_start_{attempt}": before_bwd - start})  # fmt: skip
        del y, grad
        x.grad = None
        lstm.zero_grad(set_to_none=True)
    return row


# -- a sample of recurrent problems, each cuDNN call with its own allocator events ---------------------------------
RNN_MODES = ("LSTM", "LSTM", "LSTM", "GRU", "GRU", "RNN_TANH")
RNN_SIZES = (16, 32, 50, 64, 100, 128, 200, 256, 300, 512, 650, 768, 1024, 1500, 2048, 4096)
RNN_BATCHES = (1, 2, 3, 5, 8, 16, 17, 32, 50, 64, 100, 128, 200, 256, 384, 512, 1000)
RNN_SEQS = (1, 2, 5, 16, 32, 50, 64, 100, 128, 200, 256, 512, 1024)
_RNN_OPS = ("_cudnn_rnn", "_cudnn_rnn_backward")


def _device_trace() -> list[dict[str, Any]]:
    return torch.cuda.memory._snapshot()["device_traces"][0]


def _events_of(call: Any) -> tuple[Any, list[list]]:
    """``call()``'s result and the caching allocator's events during it: ``[action, size, block]`` with the
    block numbered in order of first appearance within the call (addresses mean nothing elsewhere)."""
    torch.cuda.synchronize()
    start = len(_device_trace())
    out = call()
    torch.cuda.synchronize()
    names: dict[int, int] = {}
    events = []
    for e in _device_trace()[start:]:
        if e["action"] in ("alloc", "free_requested", "segment_alloc", "segment_free", "oom"):
            events.append([e["action"], e["size"], names.setdefault(e["addr"], len(names))])
    return out, events


class _CudnnCalls(torch.utils._python_dispatch.TorchDispatchMode):
    """Records each cuDNN RNN call's allocator events and its outputs' sizes."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[dict[str, Any]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        name = func.overloadpacket.__name__
        if name not in _RNN_OPS:
            return func(*args, **(kwargs or {}))
        out, events = _events_of(lambda: func(*args, **(kwargs or {})))
        flat = out if isinstance(out, (tuple, list)) else (out,)
        sizes = [_nbytes(t) if isinstance(t, torch.Tensor) else None for t in flat]
        self.calls.append({"op": name, "events": events, "outputs": sizes})
        return out


def rnn_problem(rng: random.Random) -> dict[str, Any] | None:
    mode = rng.choice(RNN_MODES)
    hidden, inp = rng.choice(RNN_SIZES), rng.choice(RNN_SIZES)
    proj = rng.choice((0, 0, 0, hidden // 2, hidden // 4)) if mode == "LSTM" else 0
    p = {"mode": mode, "input": inp, "hidden": hidden, "proj": proj if proj < hidden else 0,
         "layers": rng.choice((1, 1, 2, 2, 3, 4)), "bidirectional": rng.random() < 0.4,
         "batch": rng.choice(RNN_BATCHES), "seq": rng.choice(RNN_SEQS), "dtype": rng.choice(("fp32", "bf16", "fp16")),
         "batch_first": rng.random() < 0.5}  # fmt: skip
    return p if _rnn_elements(p) * (4 if p["dtype"] == "fp32" else 2) <= 4 * _LIMIT else None


def _rnn_elements(p: dict[str, Any]) -> int:
    gates = {"LSTM": 4, "GRU": 3}.get(p["mode"], 1)
    dirs = 2 if p["bidirectional"] else 1
    return p["seq"] * p["batch"] * (p["input"] + p["layers"] * dirs * p["hidden"] * (gates + 3))


def rnn_sweeps() -> list[dict[str, Any]]:
    """One-dimensional sweeps around a base LSTM and GRU: each size alone, so its shape shows."""
    out = []
    for mode in ("LSTM", "GRU"):
        for dtype in ("fp32", "bf16"):
            base = {"mode": mode, "input": 512, "hidden": 512, "proj": 0, "layers": 1, "bidirectional": False,
                    "batch": 64, "seq": 128, "dtype": dtype, "batch_first": False}  # fmt: skip
            for key, values in (("batch", (1, 2, 4, 7, 8, 9, 16, 31, 32, 33, 48, 64, 96, 128, 160, 192, 256, 320,
                                          384, 512, 640, 768, 1024)),
                                ("seq", (1, 2, 3, 4, 8, 16, 32, 33, 64, 100, 128, 256, 512, 1024, 2048)),
                                ("hidden", (8, 16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 4096)),
                                ("input", (1, 16, 64, 128, 256, 512, 1024, 2048, 4096)),
                                ("layers", (1, 2, 3, 4, 6, 8)), ("bidirectional", (False, True))):  # fmt: skip
                for v in values:
                    out.append({**base, key: v})
    return out


def measure_rnn(p: dict[str, Any]) -> dict[str, Any]:
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[p["dtype"]]
    cls = {"LSTM": torch.nn.LSTM, "GRU": torch.nn.GRU}.get(p["mode"], torch.nn.RNN)
    extra = {"proj_size": p["proj"]} if p["mode"] == "LSTM" and p["proj"] else {}
    rnn = cls(p["input"], p["hidden"], p["layers"], batch_first=p["batch_first"], bidirectional=p["bidirectional"],
              **extra).to("cuda", dtype)  # fmt: skip
    shape = (p["batch"], p["seq"], p["input"]) if p["batch_first"] else (p["seq"], p["batch"], p["input"])
    x = torch.randn(*shape, device="cuda", dtype=dtype, requires_grad=True)
    row: dict[str, Any] = {**p, "calls": []}
    for _ in range(2):  # the first call builds cuDNN's plans, the second reuses them
        mode = _CudnnCalls()
        with mode:
            y, _ = rnn(x)
            y.backward(torch.ones_like(y))
        row["calls"].append(mode.calls)
        del y
        x.grad = None
        rnn.zero_grad(set_to_none=True)
    return row


def sample_rnns(out: Path, seconds: float, seed: int) -> int:
    """The sweeps, then seeded random problems until ``seconds`` have passed; one JSON line each."""
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, context=None, stacks="python")
    rng, done, deadline = random.Random(seed), 0, time.monotonic() + seconds
    problems = iter(rnn_sweeps())
    with gzip.open(out / "rnn_events.jsonl.gz", "wt") as f:
        while time.monotonic() < deadline:
            p = next(problems, None) or rnn_problem(rng)
            if p is None:
                continue
            try:
                row = measure_rnn(p)
            except Exception as e:  # noqa: BLE001 - a problem that fails is recorded, the others still run
                row = {**p, "error": f"{type(e).__name__}: {e}"[:300]}
            f.write(json.dumps(row) + "\n")
            done += 1
            torch.cuda.memory._record_memory_history(None)  # a fresh history for the next problem
            torch.cuda.empty_cache()
            torch.cuda.memory._record_memory_history(max_entries=1_000_000, context=None, stacks="python")
    torch.cuda.memory._record_memory_history(None)
    return done


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="a folder for the two tables (default: benchmarks/results/cudnn-<GPU>-<date>)")
    parser.add_argument("--seconds", type=float, default=100.0, help="start no convolution problem after this long")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rnn-seconds", type=float, default=0.0,
                        help="then sample recurrent problems this long, each cuDNN call's allocator events kept")
    parser.add_argument("--only-rnn", action="store_true", help="measure only the recurrent sample")
    args = parser.parse_args()
    if not torch.cuda.is_available():  # nothing to measure: not a failure of ``make bench`` on a CPU machine
        print("cudnn_workspaces: no CUDA GPU is visible here; run it on a machine with one (nothing was measured)")
        return 0
    torch.backends.cudnn.benchmark = False
    gpu = torch.cuda.get_device_name(0).removeprefix("NVIDIA ").replace(" ", "_")
    out = Path(args.out or Path(__file__).resolve().parent / "results" / f"cudnn-{gpu}-{date.today()}")
    out.mkdir(parents=True, exist_ok=True)
    meta = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(), "allow_tf32": torch.backends.cudnn.allow_tf32}  # fmt: skip
    if args.rnn_seconds:
        print(f"{sample_rnns(out, args.rnn_seconds, args.seed)} recurrent problems measured on {meta['gpu']}")
    if args.only_rnn:
        return 0
    with open(out / "lstm_workspaces.jsonl", "w") as f:
        f.write(json.dumps({"meta": meta}) + "\n")
        for spec in LSTMS:
            try:
                f.write(json.dumps(measure_lstm(spec)) + "\n")
            except Exception as e:  # noqa: BLE001 - a row that fails is recorded, the others still run
                f.write(json.dumps({"spec": list(spec), "error": f"{type(e).__name__}: {e}"[:300]}) + "\n")
            f.flush()
            torch.cuda.empty_cache()
    rng, done, deadline = random.Random(args.seed), 0, time.monotonic() + args.seconds
    with open(out / "conv_workspaces.jsonl", "w") as f:
        f.write(json.dumps({"meta": meta}) + "\n")
        while time.monotonic() < deadline:
            p = conv_problem(rng)
            if p is None:
                continue
            try:
                rows = measure_conv(p)
            except Exception as e:  # noqa: BLE001
                rows = [{**p, "error": f"{type(e).__name__}: {e}"[:300]}]
            f.write("".join(json.dumps(r) + "\n" for r in rows))
            f.flush()
            done += 1
            if done % 50 == 0:
                torch.cuda.empty_cache()
    print(f"{done} convolution problems, {len(LSTMS)} LSTMs measured on {meta['gpu']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
