#!/usr/bin/env bash
# Real steps and allocator snapshots on a GPU machine, for benchmarks/results/ (no estimates: those are made
# on any machine afterwards with `gpu_truth.py --replay`, and the snapshots with `snapshot_replay.py`).
#
#   OUT=/some/dir bash benchmarks/record_truth.sh
#
# Capped probes (CASE@CAPACITY=b*,b*+1) cap the caching allocator at CAPACITY with
# torch.cuda.set_per_process_memory_fraction, so that a large GPU behaves near a smaller one's capacity: the
# two LoRA recipes at the capacity batchfit's catalog gives an H100-80GB (84,220,837,888 B), the smaller
# models at b* and b*+1 of `batchfit.fit` for that capacity. The uncapped runs are the shared H100 rows' steps
# again, with their streams. What comes back: $OUT/rows.jsonl, the CSV, the log, the GPU and package
# versions, and the snapshots as a tar in pieces of at most 15 MiB.
set -u
: "${OUT:?set OUT to a folder for the results}"
export PYTHONUNBUFFERED=1
H100=84220837888
work=$(mktemp -d)
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, transformers, peft; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'transformers', transformers.__version__, 'peft', peft.__version__)"
} >"$OUT/versions.txt" 2>&1
timeout "${BUDGET_S:-450}" python3 benchmarks/gpu_truth.py --real-only --snapshots "$work/snaps" --out "$work" \
  --timeout 150 --runs \
  "llama31-8b-lora-qv-ckpt-s2048@$H100=15,16,17" \
  "qwen25-7b-lora-all-ckpt-s4096@$H100=7,8,9" \
  "tv-resnet50-sgd@16GiB=188,189" \
  "gpt2-small:bf16@16GiB=14,15" \
  "t5-small-adamw@12GiB=28,29" \
  "hf-bert-large@24GiB=24,25" \
  "lstm-lm-adam@8GiB=220,221" \
  "llama-gqa@8GiB=12,13" \
  "tv-resnet50-sgd=64,128" "tv-resnet50-sgd-bf16=128" "tv-densenet121-sgd=64" "tv-vgg16-adam=32" \
  "tv-inception_v3-299-adam=32" "lstm-lm-adam=64" "t5-small-adamw=32" "mlp=4096" \
  "hf-bert-large=170,171" >"$OUT/log.txt" 2>&1
echo "gpu_truth exit $?" >>"$OUT/log.txt"
cp "$work"/rows.jsonl "$work"/*.csv "$OUT"/ 2>/dev/null
(cd "$work" && tar cf - snaps | split -b 15m - "$OUT/snaps.tar.part-")
ls -l "$OUT" >>"$OUT/log.txt"
