"""cuDNN's RNN workspace and reserve sizes, asked of cuDNN itself over a dense grid of problems.

``memory/kernels/cuda.py`` (NOTE [ CPU and CUDA kernels that keep different memory ], item 5a) models the
transient workspace of a cuDNN LSTM by a rule read off 975 problems whose allocator events were recorded on an
H200 (``benchmarks/cudnn_workspaces.py --rnn-seconds``). Those leave parts of the space open: 257-511 time steps,
inputs wider than the hidden size in deeper or bidirectional stacks, the persistent kernels PyTorch picks for small
hidden sizes and for some fp16 stacks, projections, GRUs and plain RNNs. Recording allocator events costs a real
forward and backward per problem; the size itself is one call, ``cudnnGetRNNTempSpaceSizes``, which this script
makes through ctypes on the libcudnn that torch loaded, with the RNN descriptor set as PyTorch sets it
(``aten/src/ATen/native/cudnn/RNN.cpp`` and ``aten/src/ATen/cudnn/Descriptors.h``: ``get_algo``'s algorithm, double
bias, linear input, the input's dtype as data type and float as math precision for fp16/bf16, tensor-op math for
fp16 and FMA math for fp32 without TF32, padded I/O for unpacked input, a no-dropout descriptor, and the input as a
sequence-major unpacked data descriptor with every sequence full length). It asks, for each problem, the standard
algorithm and, where PyTorch would use them, the persistent ones, in training mode (the question RNN.cpp asks in the
forward and both halves of the backward): thousands of problems a second.

Then it cross-checks a few problems against real ``_cudnn_rnn`` / ``_cudnn_rnn_backward`` calls: the workspace each
call took from the caching allocator (its own history) against the size asked for the algorithm PyTorch picks.

Rows go to ``--out`` as JSON lines while they are measured (``rnn_sizes.jsonl.gz``, then ``rnn_sizes_check.jsonl``),
so a run stopped at its deadline keeps what it measured. Every failure is printed and recorded; nothing waits on
the GPU without a deadline (``--seconds`` bounds the grid, and an alarm the whole run).

Run on a GPU: ``python3 benchmarks/cudnn_rnn_sizes.py --out DIR [--seconds 60] [--seed 0] [--checks 8]`` (without
one it says so and measures nothing).
"""

from __future__ import annotations

import argparse
import ctypes
import gzip
import json
import random
import signal
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

MODES = {"RNN_RELU": 0, "RNN_TANH": 1, "LSTM": 2, "GRU": 3}  # cudnnRNNMode_t
DTYPES = {"fp32": 0, "fp16": 2, "bf16": 9}  # cudnnDataType_t: FLOAT, HALF, BFLOAT16
ITEMSIZE = {"fp32": 4, "fp16": 2, "bf16": 2}
STANDARD, PERSIST_STATIC, PERSIST_DYNAMIC, PERSIST_STATIC_SMALL_H = 0, 1, 2, 3  # cudnnRNNAlgo_t
DEFAULT_MATH, TENSOR_OP_MATH, FMA_MATH = 0, 1, 3  # cudnnMathType_t
DOUBLE_BIAS, LINEAR_INPUT, PADDED_IO_ENABLED, SEQ_MAJOR_UNPACKED, FWD_TRAINING = 2, 0, 1, 0, 1


def torch_algo(p: dict[str, Any], forward: bool, major: int = 9, minor: int = 0, sms: int = 132) -> int:
    """The algorithm ``get_algo`` in RNN.cpp picks for an unpacked input (an H200's compute capability and SMs)."""
    if p["proj"]:
        return STANDARD
    mode, h = p["mode"], p["hidden"]
    if major >= 6:
        limit = (384 if forward else 256) if mode.startswith("RNN") else (192 if forward else 128)
        if h <= limit:
            return PERSIST_STATIC_SMALL_H
    if p["dtype"] == "fp16" and _persist_common(p) and _persist_device(p, major, minor, sms):
        return PERSIST_STATIC
    return STANDARD


def _persist_common(p: dict[str, Any]) -> bool:
    return (p["layers"] == 1 and p["hidden"] <= 1024 and not p["bidirectional"] and p["hidden"] % 128 == 0
            and p["input"] % 128 == 0)  # fmt: skip


def _persist_device(p: dict[str, Any], major: int, minor: int, sms: int) -> bool:
    b = p["batch"]
    if major == 7:
        if minor == 5:
            return False
        return ((b % 16 == 0 and b not in (80, 112)) or b == 8) and (
            (p["seq"] >= 40 and b <= 128) or (p["seq"] >= 20 and b <= 96) or (p["seq"] >= 10 and b <= 32))
    if major >= 8 and sms >= 98 and minor != 6:
        if p["mode"] == "GRU":
            return False
        if p["mode"] == "LSTM":
            return b % 8 == 0 and b <= 128
        return b % 8 == 0 and b <= 128 and (b < 96 or p["hidden"] < 896)
    return False


def descriptor_args(p: dict[str, Any], algo: int, allow_tf32: bool = True) -> tuple[int, ...]:
    """``cudnnSetRNNDescriptor_v8``'s arguments after the descriptor and before the dropout descriptor, as
    ``RNNDescriptor::set`` gives them: algo, cell mode, bias mode, direction, input mode, data type, math precision,
    math type, input size, hidden size, projection size, layers."""
    dtype = DTYPES[p["dtype"]]
    math_type = TENSOR_OP_MATH if p["dtype"] == "fp16" else (DEFAULT_MATH if allow_tf32 or p["dtype"] != "fp32"
                                                             else FMA_MATH)  # fmt: skip
    return (algo, MODES[p["mode"]], DOUBLE_BIAS, int(bool(p["bidirectional"])), LINEAR_INPUT, dtype,
            DTYPES["fp32"], math_type, p["input"], p["hidden"], p["proj"] or p["hidden"], p["layers"])  # fmt: skip


def _problem(mode: str, dtype: str, i: int, h: int, layers: int = 1, bi: bool = False, b: int = 64, t: int = 128,
             proj: int = 0) -> dict[str, Any]:  # fmt: skip
    return {"mode": mode, "dtype": dtype, "input": i, "hidden": h, "proj": proj if 0 < proj < h else 0,
            "layers": layers, "bidirectional": bi, "batch": b, "seq": t}  # fmt: skip


def problems(seed: int = 0) -> Iterator[dict[str, Any]]:
    """One-dimensional sweeps, dense where the recorded sample left the rule open, then seeded random problems."""
    for mode in ("LSTM", "GRU", "RNN_TANH"):
        for dtype in ("fp32", "bf16", "fp16"):
            for layers, bi in ((1, False), (2, False), (1, True), (2, True)):
                for t in list(range(1, 65)) + list(range(96, 1025, 32)) + [1536, 2048]:  # the step regimes
                    for i, h in ((256, 512), (512, 512), (1024, 512)):
                        yield _problem(mode, dtype, i, h, layers, bi, 64, t)
                for b in list(range(1, 129)) + list(range(136, 1025, 8)):
                    yield _problem(mode, dtype, 512, 512, layers, bi, b, 100)
                for h in range(8, 2049, 8):
                    yield _problem(mode, dtype, 512, h, layers, bi, 32, 100)
                for i in range(8, 4097, 8):
                    yield _problem(mode, dtype, i, 512, layers, bi, 32, 100)
            for layers in range(1, 9):
                for bi in (False, True):
                    for i in (64, 512, 1024, 2048):
                        yield _problem(mode, dtype, i, 512, layers, bi, 32, 100)
    for dtype in ("fp32", "bf16", "fp16"):  # projections: the projection's width, then the hidden size
        for proj in range(8, 1024, 8):
            yield _problem("LSTM", dtype, 512, 1024, 1, False, 32, 100, proj)
        for layers, bi in ((1, False), (2, False), (2, True)):
            for h in range(16, 2049, 16):
                yield _problem("LSTM", dtype, 512, h, layers, bi, 32, 100, h // 4)
    rng = random.Random(seed)
    log = lambda lo, hi: int(round(2 ** rng.uniform(lo, hi)))  # noqa: E731
    while True:
        mode = rng.choice(("LSTM", "LSTM", "LSTM", "GRU", "RNN_TANH", "RNN_RELU"))
        h = log(0, 12)
        yield _problem(mode, rng.choice(tuple(DTYPES)), log(0, 12), h, rng.randint(1, 8), rng.random() < 0.5,
                       log(0, 10), log(0, 11), rng.randint(1, h - 1) if mode == "LSTM" and h > 1 and rng.random() < 0.25
                       else 0)  # fmt: skip


class Cudnn:
    """The size queries of the libcudnn this process loaded (found in its memory map), one handle and descriptors
    reused for every problem."""

    def __init__(self) -> None:
        path = _loaded_cudnn()
        self.path = path
        self.lib = ctypes.CDLL(path)
        for name in ("cudnnGetRNNTempSpaceSizes", "cudnnGetRNNWeightSpaceSize", "cudnnSetRNNDescriptor_v8",
                     "cudnnSetRNNDataDescriptor", "cudnnGetErrorString"):  # fmt: skip
            if not hasattr(self.lib, name):
                raise RuntimeError(f"{path} has no {name} (cuDNN {self.version()}?)")
        self.lib.cudnnGetErrorString.restype = ctypes.c_char_p
        self.handle = ctypes.c_void_p()
        self._check(self.lib.cudnnCreate(ctypes.byref(self.handle)), "cudnnCreate")
        self.dropout = ctypes.c_void_p()
        self._check(self.lib.cudnnCreateDropoutDescriptor(ctypes.byref(self.dropout)), "cudnnCreateDropoutDescriptor")
        self._check(self.lib.cudnnSetDropoutDescriptor(self.dropout, self.handle, ctypes.c_float(0.0), None,
                                                       ctypes.c_size_t(0), ctypes.c_ulonglong(0)),
                    "cudnnSetDropoutDescriptor")  # fmt: skip
        self.rnn = ctypes.c_void_p()
        self._check(self.lib.cudnnCreateRNNDescriptor(ctypes.byref(self.rnn)), "cudnnCreateRNNDescriptor")
        self.x = ctypes.c_void_p()
        self._check(self.lib.cudnnCreateRNNDataDescriptor(ctypes.byref(self.x)), "cudnnCreateRNNDataDescriptor")

    def version(self) -> int:
        self.lib.cudnnGetVersion.restype = ctypes.c_size_t
        return int(self.lib.cudnnGetVersion())

    def _check(self, status: int, what: str) -> None:
        if status:
            raise RuntimeError(f"{what}: {self.error(status)}")

    def error(self, status: int) -> str:
        try:
            return f"{status} {self.lib.cudnnGetErrorString(status).decode()}"
        except Exception:  # noqa: BLE001 - the status alone still says what failed
            return str(status)

    def sizes(self, p: dict[str, Any], algo: int, allow_tf32: bool = True) -> dict[str, Any]:
        """``{"workspace", "reserve", "weights"}`` for ``p`` under ``algo``, or ``{"status": ...}`` where cuDNN refused
        (a persistent algorithm outside what it supports, say)."""
        c_int = ctypes.c_int
        args = [c_int(a) for a in descriptor_args(p, algo, allow_tf32)]
        status = self.lib.cudnnSetRNNDescriptor_v8(self.rnn, *args, self.dropout, ctypes.c_uint(PADDED_IO_ENABLED))
        if status:
            return {"status": f"cudnnSetRNNDescriptor_v8: {self.error(status)}"}
        lengths = (c_int * p["batch"])(*([p["seq"]] * p["batch"]))
        status = self.lib.cudnnSetRNNDataDescriptor(self.x, c_int(DTYPES[p["dtype"]]), c_int(SEQ_MAJOR_UNPACKED),
                                                    c_int(p["seq"]), c_int(p["batch"]), c_int(p["input"]), lengths,
                                                    None)  # fmt: skip
        if status:
            return {"status": f"cudnnSetRNNDataDescriptor: {self.error(status)}"}
        work, reserve, weights = ctypes.c_size_t(), ctypes.c_size_t(), ctypes.c_size_t()
        status = self.lib.cudnnGetRNNTempSpaceSizes(self.handle, self.rnn, c_int(FWD_TRAINING), self.x,
                                                    ctypes.byref(work), ctypes.byref(reserve))  # fmt: skip
        if status:
            return {"status": f"cudnnGetRNNTempSpaceSizes: {self.error(status)}"}
        self.lib.cudnnGetRNNWeightSpaceSize(self.handle, self.rnn, ctypes.byref(weights))
        return {"workspace": work.value, "reserve": reserve.value, "weights": weights.value}


def _loaded_cudnn() -> str:
    """The path of the libcudnn torch loaded (after it initialised cuDNN), else the ``nvidia-cudnn`` wheel's."""
    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if "libcudnn.so" in line and "/" in line}
    exact = sorted(p for p in paths if Path(p).name.startswith("libcudnn.so"))
    if exact:
        return exact[0]
    try:
        import nvidia.cudnn  # type: ignore[import-not-found]

        for lib in sorted(Path(next(iter(nvidia.cudnn.__path__))).glob("lib/libcudnn.so*")):
            return str(lib)
    except Exception:  # noqa: BLE001
        pass
    raise RuntimeError(f"no libcudnn.so in this process's memory map (cuDNN libraries seen: {sorted(paths)})")


def query(cudnn: Cudnn, out: Path, seconds: float, seed: int, meta: dict[str, Any], props: tuple[int, int, int],
          limit: int = 300_000) -> int:  # fmt: skip
    """The problems of ``problems(seed)`` until ``seconds`` have passed or ``limit`` were asked: one row per problem,
    the sizes under the standard algorithm and under each one PyTorch would pick instead, forward and backward."""
    done, failures, deadline = 0, 0, time.monotonic() + seconds
    with gzip.open(out / "rnn_sizes.jsonl.gz", "wt") as f:
        f.write(json.dumps({"meta": meta}) + "\n")
        for p in problems(seed):
            if time.monotonic() > deadline or done >= limit:
                break
            row = dict(p)
            row["algo_forward"], row["algo_backward"] = (torch_algo(p, fw, *props) for fw in (True, False))
            for algo in sorted({STANDARD, row["algo_forward"], row["algo_backward"]}):
                try:
                    row[f"algo{algo}"] = cudnn.sizes(p, algo)
                except Exception as e:  # noqa: BLE001 - recorded, the next problem still runs
                    row[f"algo{algo}"] = {"status": f"{type(e).__name__}: {e}"[:300]}
                failures += "status" in row[f"algo{algo}"] and algo == STANDARD
            f.write(json.dumps(row, separators=(",", ":")) + "\n")
            done += 1
            if done % 20000 == 0:
                print(f"cudnn_rnn_sizes: {done} problems, {failures} refused on the standard algorithm", flush=True)
    print(f"cudnn_rnn_sizes: {done} problems asked in {seconds:.0f} s; {failures} refused on the standard algorithm")
    return done


CHECKS = (  # problems also run for real: (mode, dtype, input, hidden, layers, bidirectional, batch, seq, proj)
    ("LSTM", "fp32", 256, 512, 2, True, 64, 128, 0), ("LSTM", "fp32", 512, 1024, 2, False, 64, 128, 0),
    ("LSTM", "bf16", 1024, 512, 2, True, 32, 300, 0), ("LSTM", "fp16", 512, 512, 1, False, 64, 100, 0),
    ("LSTM", "fp32", 128, 160, 1, False, 16, 50, 0), ("GRU", "bf16", 300, 650, 2, False, 17, 64, 0),
    ("RNN_TANH", "fp32", 100, 300, 1, True, 8, 32, 0), ("LSTM", "bf16", 512, 1024, 1, False, 32, 64, 256),
)  # fmt: skip


def cross_check(cudnn: Cudnn, out: Path, count: int, props: tuple[int, int, int]) -> int:
    """The workspace each real cuDNN call of a few problems took from the caching allocator, beside the size asked
    for the algorithm PyTorch picks; returns how many disagree (each printed)."""
    import importlib.util

    import torch

    path = Path(__file__).resolve().parent / "cudnn_workspaces.py"
    module_spec = importlib.util.spec_from_file_location("cudnn_workspaces", path)
    assert module_spec is not None and module_spec.loader is not None
    recorder = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(recorder)
    wrong = 0
    torch.cuda.memory._record_memory_history(max_entries=100_000, context=None, stacks="python")
    with open(out / "rnn_sizes_check.jsonl", "w") as f:
        for spec_row in CHECKS[:count]:
            mode, dtype, i, h, layers, bi, b, t, proj = spec_row
            p = {**_problem(mode, dtype, i, h, layers, bi, b, t, proj), "batch_first": False}
            row: dict[str, Any] = dict(p)
            try:
                measured = recorder.measure_rnn(p)
                calls = measured["calls"][1]
                real = _real_workspaces(calls)
                asked = {fw: cudnn.sizes(p, torch_algo(p, fw, *props)) for fw in (True, False)}
                expected = [asked[True].get("workspace"), asked[False].get("workspace"), asked[False].get("workspace")]
                row.update(real=real, asked=expected, agree=real == expected)
                wrong += real != expected
                print(f"cudnn_rnn_sizes: check {spec_row}: allocator {real}, asked {expected}"
                      f"{'' if real == expected else '  <- DIFFERENT'}", flush=True)  # fmt: skip
            except Exception as e:  # noqa: BLE001 - recorded and printed, the next check still runs
                row["error"] = f"{type(e).__name__}: {e}"[:300]
                wrong += 1
                print(f"cudnn_rnn_sizes: check {spec_row} failed: {row['error']}", flush=True)
            f.write(json.dumps(row) + "\n")
            f.flush()
            torch.cuda.memory._record_memory_history(None)
            torch.cuda.empty_cache()
            torch.cuda.memory._record_memory_history(max_entries=100_000, context=None, stacks="python")
    torch.cuda.memory._record_memory_history(None)
    return wrong


def _real_workspaces(calls: list[dict[str, Any]]) -> list[int | None]:
    """Forward, backward-data and backward-weights workspaces from one step's recorded cuDNN calls: the forward's
    block taken just before the reserve, the backward's blocks freed as soon as they are taken."""
    out: list[int | None] = []
    for call in calls:
        events = call["events"]
        allocs = [(k, size, block) for k, (action, size, block) in enumerate(events) if action == "alloc"]
        if call["op"] == "_cudnn_rnn":
            reserve = call["outputs"][3]
            found = [size for (_, size, _), (_, nxt, _) in zip(allocs, allocs[1:]) if nxt == reserve]
            out.append(found[0] if found else None)
        else:
            found = [size for k, size, block in allocs
                     if k + 1 < len(events) and events[k + 1][0] == "free_requested" and events[k + 1][2] == block]
            out += (found + [None, None])[:2]
    return out


def _alarm(seconds: int) -> None:
    def stop(signum: int, frame: Any) -> None:
        raise TimeoutError(f"cudnn_rnn_sizes: still running after {seconds} s; stopped (what was written is kept)")

    signal.signal(signal.SIGALRM, stop)
    signal.alarm(seconds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="a folder for rnn_sizes.jsonl.gz and rnn_sizes_check.jsonl")
    parser.add_argument("--seconds", type=float, default=60.0, help="ask no new problem after this long")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checks", type=int, default=len(CHECKS), help="problems also run for real (0: none)")
    parser.add_argument("--max-problems", type=int, default=300_000, help="ask no more problems than this")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("cudnn_rnn_sizes: no CUDA GPU is visible here; run it on a machine with one (nothing was measured)")
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    _alarm(int(args.seconds) + 60 * max(1, args.checks) + 120)
    try:
        torch.zeros(1, device="cuda")
        torch.backends.cudnn.benchmark = False
        version = torch.backends.cudnn.version()  # loads libcudnn
        prop = torch.cuda.get_device_properties(0)
        props = (prop.major, prop.minor, prop.multi_processor_count)
        cudnn = Cudnn()
        meta = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
                "cudnn": version, "cudnn_loaded": cudnn.version(), "lib": cudnn.path, "capability": props[:2],
                "multiprocessors": props[2], "allow_tf32": torch.backends.cudnn.allow_tf32,
                "algos": {"standard": STANDARD, "persist_static": PERSIST_STATIC,
                          "persist_static_small_h": PERSIST_STATIC_SMALL_H}}  # fmt: skip
        print(f"cudnn_rnn_sizes: {meta['gpu']}, torch {meta['torch']}, cuDNN {version} from {cudnn.path}", flush=True)
        probe = cudnn.sizes(_problem("LSTM", "fp32", 512, 512), STANDARD)
        print(f"cudnn_rnn_sizes: LSTM 512 -> 512, 64 x 128, fp32: {probe} (an H200 with cuDNN 9.19 took a workspace"
              f" of 118883072 bytes)", flush=True)  # fmt: skip
        query(cudnn, out, args.seconds, args.seed, meta, props, args.max_problems)
        wrong = cross_check(cudnn, out, args.checks, props) if args.checks else 0
        print(f"cudnn_rnn_sizes: {wrong} of {min(args.checks, len(CHECKS))} real calls disagree with the sizes asked")
        return 1 if wrong else 0
    except Exception:  # noqa: BLE001 - said in full, and the rows written so far stay
        traceback.print_exc()
        return 1
    finally:
        signal.alarm(0)


if __name__ == "__main__":
    sys.exit(main())
