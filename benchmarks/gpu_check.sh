#!/usr/bin/env bash
# One short check of batchlab's CUDA paths, for a session that is lent a GPU machine (device tool).
# That machine has torch, typer, rich, matplotlib, transformers and pytest but nothing can be installed
# from a registry: carry a platformdirs wheel in .whl/ (see the device tool's README) and run, from the repo
# root:   bash benchmarks/gpu_check.sh      (writes its figures under $OUT, else ./gpu-check)
# About 3-5 minutes on one H200.  Every step has its own timeout (STEP_TIMEOUT seconds, default 240) so one
# hung step cannot eat the session; a summary of every step's exit status goes to $OUT/summary.txt.
set -uo pipefail
OUT=${OUT:-gpu-check}
STEP_TIMEOUT=${STEP_TIMEOUT:-240}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:src
else
  export PYTHONPATH=src
fi
export PYTHONUNBUFFERED=1 XDG_CACHE_HOME=$OUT/cache XDG_DATA_HOME=$OUT/data
BL="python3 -m batchlab"
: > "$OUT/summary.txt"
step() {  # step NAME COMMAND...: run with a timeout, record the exit status
  local name=$1; shift
  local t0=$SECONDS
  timeout "$STEP_TIMEOUT" "$@"
  local rc=$?
  echo "$name rc=$rc $((SECONDS - t0))s" | tee -a "$OUT/summary.txt"
}
# 0. allocated, reserved, device view and tokens/s of a few configs beside the formula (formula/allocator.py)
step memory-check python3 benchmarks/gpu_memory_check.py --out "$OUT"
cat "$OUT/gpu_memory_check.md" >> "$OUT/summary.txt" 2>/dev/null
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())" | tee -a "$OUT/gpu.txt"
# 1. the GPU tests (allocator path, budget OOM, real OOM, 2-GPU DDP skips on one GPU)
step pytest-gpu python3 -m pytest -m gpu -ra tests > "$OUT/pytest-gpu.txt" 2>&1; tail -15 "$OUT/pytest-gpu.txt"
# 2. measured ceilings for the time model
step calibrate $BL calibrate --json > "$OUT/calibrate.json"; tail -c 600 "$OUT/calibrate.json"
# 3. formula vs allocator on a realistic shape, every policy (bf16-mixed, SDPA)
for ac in none full every:4 selective selective-op; do
  step "measure-$ac" $BL measure --model gpt2 --seq 1024 --micro-batch 8 --precision bf16-mixed --device local --ac "$ac" \
      --steps 5 --no-progress --json > "$OUT/measure-gpt2-$ac.json"
  python3 - "$OUT/measure-gpt2-$ac.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
rows = {r["figure"]: r for r in d.get("comparison", [])} if isinstance(d.get("comparison"), list) else {}
m, t = d.get("memory") or {}, d.get("time") or {}
print(sys.argv[1].split("/")[-1], d["outcome"], "peak", m.get("peak_bytes"), "reserved", m.get("reserved_bytes"),
      "phase", m.get("peak_phase"), "update s", t.get("update_seconds_median"),
      "| vs formula:", [(k, r.get("relative_difference")) for k, r in rows.items()])
PY
done
# 4. the main job on the GPU: one change, interleaved, judged
step compare $BL compare --change ac=none:full --model gpt2 --seq 1024 --micro-batch 8 --precision bf16-mixed --device local \
    --predict memory=down,time=up --notebook "$OUT/notebook.sqlite" --report "$OUT/report" --json < /dev/null \
    > "$OUT/compare-ac.json"
python3 -c "
import json; d = json.load(open('$OUT/compare-ac.json'))
for k, v in d['metrics'].items(): print(k, v.get('observed'), v.get('ratio'), v.get('band'), v.get('held'))"
# 5. trace on the GPU's device entry (fake tensors, no GPU memory) beside the formula
step trace $BL estimate --trace --model llama-2-7b --seq 4096 --micro-batch 1 --precision bf16-mixed --device h200 --ac full \
    --json > "$OUT/trace-llama.json"; tail -c 400 "$OUT/trace-llama.json"
# 6. fit --ac auto on CUDA : the plan in the reserved view, measured; planned vs allocator peak
step ac-plan $BL fit --ac auto --model gpt2 --seq 1024 --micro-batch 8 --precision bf16-mixed --device local \
    --memory-budget 9GiB --margin 0 --plan-out "$OUT/ac-plan.json" --report "$OUT/ac-plan-report" --json \
    > "$OUT/ac-plan.json.out"
python3 -c "
import json; t = open('$OUT/ac-plan.json.out').read(); d = json.loads(t[t.index('{'):])
p, v = d['plan'], d['verification'] or {}
print('ac plan', d['final'] and d['final']['ac'], 'planned', p['predicted_peak_bytes'], 'measured', v.get('peak_bytes'),
      'budget', p['budget_bytes'])"
echo "--- summary ($OUT/summary.txt)"; cat "$OUT/summary.txt"
