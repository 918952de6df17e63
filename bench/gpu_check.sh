#!/usr/bin/env bash
# The CUDA path, proved in one go on a machine with NVIDIA GPUs (two or more
# for the NCCL parts: NCCL refuses two ranks of one group on one GPU).
# Bootstraps the venv (`make venv` takes vLLM's CUDA build where nvidia-smi
# sees a GPU), then prints one RESULT line each for: vLLM CUDA rollout with
# in-flight NCCL weight updates, the FSDP2 trainer step on CUDA, the test
# suite's `gpu` tests, and 20 steps of the default run on GPU pools with the
# held-out accuracy before and after. Meant to finish within 8 minutes once
# the venv exists; without a GPU it says so and exits 2.
set -uo pipefail
cd "$(dirname "$0")/.."

if ! nvidia-smi -L >/dev/null 2>&1; then
  echo "bench/gpu_check.sh: no NVIDIA GPU here (nvidia-smi -L failed); run it on a machine with CUDA GPUs" >&2
  exit 2
fi
GPUS=$(nvidia-smi -L | wc -l)
echo "gpu_check: $GPUS GPU(s): $(nvidia-smi -L | head -1)"
make venv >/dev/null || { echo "gpu_check: make venv failed" >&2; exit 1; }
PY=.venv/bin/python
$PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
  || { echo "gpu_check: the venv's torch sees no CUDA device (is the CPU build installed? rm -rf .venv)" >&2; exit 1; }
FAILED=0

# 1. vLLM CUDA rollout with in-flight NCCL weight updates (two GPUs).
if [ "$GPUS" -ge 2 ]; then
  timeout 180 $PY bench/gpu_rollout.py --seconds 20 | grep '^RESULT' || { echo "RESULT gpu_rollout failed=1"; FAILED=1; }
else
  echo "RESULT gpu_rollout skipped=needs_2_gpus"
fi

# 2. The FSDP2 trainer step on CUDA (one rank, bf16 compute, fp32 reduction).
timeout 120 $PY - <<'PYEOF' || { echo "RESULT gpu_fsdp_step failed=1"; FAILED=1; }
import sys, time, tempfile, pathlib
sys.path.insert(0, "tests")
import torch
from models import tiny_model
from test_trainer import fixed_batch
from rlflow.config import TorchTrainer
from rlflow.data.net import free_port
from rlflow.services.trainer.fsdp import Sharded
from rlflow.services.trainer.torch_engine import TorchEngine

path = tiny_model(pathlib.Path(tempfile.mkdtemp()) / "model", tied=False, hidden=1024, layers=8)
cfg = TorchTrainer(lr=1e-5, micro_batch_tokens=4096)
batch = fixed_batch(TorchEngine(cfg, str(path)))
ranks = Sharded(0, 1, "127.0.0.1", free_port("127.0.0.1"))
engine = TorchEngine(cfg, str(path), ranks=ranks)
engine.train(batch)  # warm-up
torch.cuda.synchronize()
start = time.perf_counter()
for _ in range(5):
    stats = engine.train(batch)
torch.cuda.synchronize()
step_ms = (time.perf_counter() - start) / 5 * 1e3
ok = all(map(lambda v: v == v, stats.values()))
print(f"RESULT gpu_fsdp_step step_ms={step_ms:.1f} loss={stats['loss']:.4f} grad_norm={stats['grad_norm']:.4f} finite={int(ok)}")
ranks.close()
PYEOF

# 3. The test suite's gpu tests.
OUT=$(timeout 240 $PY -m pytest -m gpu -q -rs -p no:cacheprovider tests/test_gpu.py 2>&1); RC=$?
echo "$OUT" | tail -5
PASSED=$(echo "$OUT" | grep -oE '[0-9]+ passed' | grep -oE '[0-9]+' || echo 0)
SKIPPED=$(echo "$OUT" | grep -oE '[0-9]+ skipped' | grep -oE '[0-9]+' || echo 0)
echo "RESULT gpu_tests passed=${PASSED:-0} skipped=${SKIPPED:-0} rc=$RC"
[ "$RC" -eq 0 ] || FAILED=1

# 4. 20 steps of the default run on GPU pools, held-out accuracy before and after.
if [ "$GPUS" -ge 2 ]; then
  RUN=runs/gpu_check_$(date +%s)
  timeout 300 .venv/bin/rlflow up --steps 20 --run-dir "$RUN" \
    --set pools.generate.gpus_per_bundle=1 --set pools.generate.cpus_per_bundle=2 \
    --set pools.train.gpus_per_bundle=1 --set pools.train.cpus_per_bundle=2 \
    --set roles.rollout.engine.gpu_memory_utilization=0.5 --set eval.every_steps=0 >"$RUN.log" 2>&1
  RC=$?
  $PY - "$RUN" "$RC" <<'PYEOF'
import pathlib, sys
from rlflow.rundir import EvalRow, read_jsonl
run, rc = pathlib.Path(sys.argv[1]), sys.argv[2]
rows = read_jsonl(run / "evals.jsonl", EvalRow) if (run / "evals.jsonl").exists() else []
acc = [r.accuracy for r in rows if r.accuracy is not None]
before = f"{acc[0]:.3f}" if acc else "nan"
after = f"{acc[-1]:.3f}" if len(acc) > 1 else "nan"
print(f"RESULT gpu_default_run steps=20 accuracy_before={before} accuracy_after={after} rc={rc}")
PYEOF
  [ "$RC" -eq 0 ] || FAILED=1
else
  echo "RESULT gpu_default_run skipped=needs_2_gpus"
fi
exit $FAILED
