#!/usr/bin/env bash
# On a GPU machine: real steps of gpu_truth.py's cases at the batches given, each with its allocator stream.
#
#   OUT=/some/dir bash benchmarks/record_probes.sh "CASE[:PRECISION][@CAPACITY]=B1,B2" ...
#
# Wheels in .whl/ (a transformers or bitsandbytes other than the machine's) are installed into /tmp/site first
# and put ahead of the machine's packages, so that the steps run with the versions the estimates are made with.
# What comes back: the log (with the versions), the rows (jsonl + CSV) and the snapshots as a tar in pieces of
# at most 15 MiB. BUDGET_S bounds the steps (default 400 s); each case's worker has WORKER_S (default 150 s).
set -u
: "${OUT:?set OUT to a folder for the results}"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
work=$(mktemp -d)
log="$OUT/log.txt"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 - <<'PY'
import importlib, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version())
for name in ("transformers", "peft", "bitsandbytes", "regex"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as e:  # noqa: BLE001 - a missing package is a line of the log
        print(name, "not importable:", type(e).__name__, e)
PY
} >"$log" 2>&1
timeout "${BUDGET_S:-400}" python3 benchmarks/gpu_truth.py --real-only --snapshots "$work/snaps" --out "$work" \
  --timeout "${WORKER_S:-150}" --runs "$@" >>"$log" 2>&1
echo "gpu_truth exit $?" >>"$log"
cp "$work"/rows.jsonl "$work"/*.csv "$OUT"/ 2>/dev/null
(cd "$work" && tar cf - snaps | split -b 15m - "$OUT/snaps.tar.part-")
ls -l "$OUT" >>"$log"
