#!/usr/bin/env bash
# On a GPU machine: cuDNN's workspaces over a sample of convolutions and LSTMs (benchmarks/cudnn_workspaces.py),
# real steps with bitsandbytes (a QLoRA base, 8-bit and paged AdamW states) and fit probes at the batch
# `batchfit.fit` answers for a capped allocator and the batches after it, each step with its allocator stream.
#
#   OUT=/some/dir bash benchmarks/record_bnb_and_probes.sh
#
# bitsandbytes must be importable (carried as a wheel where the machine has none). The probes' batches are
# `fit`'s answers for these caps when the script was written (gpu_truth.py --replay makes them again); the ones
# after b* find how far the real maximum is. What comes back: the log (with the versions), the cuDNN tables, the
# rows (jsonl + CSV) and the snapshots as a tar in pieces of at most 15 MiB.
set -u
: "${OUT:?set OUT to a folder for the results}"
export PYTHONUNBUFFERED=1
work=$(mktemp -d)
log="$OUT/log.txt"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, transformers, peft, bitsandbytes; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'cudnn', torch.backends.cudnn.version(), 'transformers', transformers.__version__, 'peft', peft.__version__,
'bitsandbytes', bitsandbytes.__version__)"
} >"$log" 2>&1
timeout "${CUDNN_BUDGET_S:-120}" python3 benchmarks/cudnn_workspaces.py --out "$OUT" --seconds "${CUDNN_SECONDS:-80}" \
  >>"$log" 2>&1
echo "cudnn_workspaces exit $?" >>"$log"
timeout "${BUDGET_S:-330}" python3 benchmarks/gpu_truth.py --real-only --snapshots "$work/snaps" --out "$work" \
  --timeout 120 --runs \
  "llama31-8b-2l-qlora-qv-ckpt-s2048=4,8" "hf-gpt2-adamw8bit=8" "hf-gpt2-paged-adamw8bit=8" \
  "hf-vit-base@8GiB=90,91,92,93" "mixtral-moe@4GiB=17,18,19" "lora-llama@4GiB=7,8,9" \
  "cnn-resnet18@8GiB=34,35" "lstm-bi@2GiB=138,139" "hf-resnet50:bf16@8GiB=177,178" >>"$log" 2>&1
echo "gpu_truth exit $?" >>"$log"
cp "$work"/rows.jsonl "$work"/*.csv "$OUT"/ 2>/dev/null
(cd "$work" && tar cf - snaps | split -b 15m - "$OUT/snaps.tar.part-")
ls -l "$OUT" >>"$log"
