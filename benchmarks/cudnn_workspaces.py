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
  it leaves allocated.

``torch.backends.cudnn.benchmark`` stays off (PyTorch's default: heuristics, no timing search). Rows go to
``--out`` as JSON lines as they are measured, so a run stopped at its deadline keeps what it measured.

Run on a GPU: ``python benchmarks/cudnn_workspaces.py [--out DIR] [--seconds 100]`` (without a GPU it says so and
measures nothing).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from datetime import date
from functools import partial
from pathlib import Path
from typing import Any

import torch

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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="a folder for the two tables (default: benchmarks/results/cudnn-<GPU>-<date>)")
    parser.add_argument("--seconds", type=float, default=100.0, help="start no convolution problem after this long")
    parser.add_argument("--seed", type=int, default=0)
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
