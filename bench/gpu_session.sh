#!/usr/bin/env bash
# One GPU session's checks and figures, in one call (docs/gpu.md).
#
#   bash bench/gpu_session.sh [STAGE ...]     (default: every stage, in order)
#
# For a GPU machine with its own CUDA build of torch, triton, transformers and peft but no package
# registry: the wheels loraplex needs beyond those travel in .whl/ (docs/gpu.md says which) and are
# installed under /tmp/site; loraplex is imported from this checkout through a namespace folder.
# Each stage runs under its own time limit, so one that hangs or fails costs only itself; logs go
# to $OUT/logs/ (packed into $OUT/logs.tgz at the end) and a summary line per stage to
# $OUT/summary.txt and stdout.
set -u
OUT=${OUT:-/tmp/gpu_out}
LOGS=$OUT/logs
mkdir -p "$LOGS"
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
PY=${PY:-python3}
export PY
export PYTHONUNBUFFERED=1

setup() {
    if [ -d .whl ]; then
        $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site .whl/*.whl || return 1
    fi
    mkdir -p /tmp/ns/loraplex
    for d in adapters engine gateway hashing kernels migrations; do
        ln -sfn "$REPO/$d" "/tmp/ns/loraplex/$d"
    done
    export PYTHONPATH=/tmp/ns:/tmp/site:$REPO
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
    $PY - <<'EOF'
import importlib, sys, torch, triton, transformers, peft
print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__,
      "transformers", transformers.__version__, "peft", peft.__version__)
print("cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0),
      torch.cuda.get_device_properties(0).multi_processor_count, "SMs")
for m in ["loraplex.engine.client.llm", "loraplex.kernels.triton_attention",
          "loraplex.kernels.triton_lora", "loraplex.gateway.cli", "llguidance", "zmq", "msgspec",
          "imagehash", "re2", "sqlalchemy", "litestar", "jsonschema", "xdist", "pytest_timeout"]:
    try:
        importlib.import_module(m)
    except Exception as e:  # noqa: BLE001
        print("IMPORT FAILED", m, type(e).__name__, e)
EOF
}

smoke() {
    # The tiny model on the GPU with both attention backends and a LoRA-free greedy request.
    $PY - <<'EOF'
import os, tempfile, time, torch
DEV = os.environ.get("SMOKE_DEVICE", "cuda")
from loraplex.engine.client.llm import LLM
from loraplex.engine.config import EngineConfig
from loraplex.engine.models.tiny_model import init_tiny
from loraplex.engine.sampling.params import SamplingParams
d = init_tiny(tempfile.mkdtemp() + "/text", seed=0, text_only=True)
outs = {}
for backend in ("torch", "triton") if DEV == "cuda" else ("torch",):
    t = time.perf_counter()
    llm = LLM(EngineConfig(model=str(d), device=DEV, attention_backend=backend))
    msgs = [[{"role": "user", "content": f"hello world {i}"}] for i in range(3)]
    o = llm.chat(msgs, SamplingParams(max_tokens=16, temperature=0.0))
    outs[backend] = [x.outputs[0].token_ids for x in o]
    print(backend, "ok", round(time.perf_counter() - t, 1), "s", outs[backend][0])
    llm.shutdown()
print("torch == triton:", outs["torch"] == outs.get("triton"))
EOF
}

tests_torch() {
    OMP_NUM_THREADS=2 LORAPLEX_TEST_DEVICE=cuda LORAPLEX_TEST_ATTENTION_BACKEND=torch $PY -m pytest -v \
        -p no:cacheprovider -n "${WORKERS:-8}" --timeout 300 -m "not service" -rfE -s \
        ${TESTS_TORCH:-tests/engine tests/models tests/sampling tests/kernels tests/adapters tests/hashing}
}

tests_triton() {
    # The product's GPU path: Triton kernels, and every engine captures its CUDA graphs.
    OMP_NUM_THREADS=2 LORAPLEX_TEST_CUDA_GRAPHS=1 LORAPLEX_TEST_DEVICE=cuda LORAPLEX_TEST_ATTENTION_BACKEND=triton $PY -m pytest -v \
        -p no:cacheprovider -n "${WORKERS:-8}" --timeout 300 -m "not service" -rfE -s \
        ${TESTS_TRITON:-tests/engine tests/models tests/kernels}
}

parity() {
    # bf16/fp16 against transformers on the GPU, both attention backends (PARITY lines; -s).
    for backend in torch triton; do
        LORAPLEX_TEST_DEVICE=cuda LORAPLEX_TEST_ATTENTION_BACKEND=$backend $PY -m pytest -q -s \
            -p no:cacheprovider --timeout 120 tests/models/test_low_precision_parity.py
    done
}

kernels() { $PY -m bench.kernels; }
kernel_tuning() { $PY -m bench.kernel_tuning; }
cuda_graphs() { $PY -m bench.cuda_graphs --device cuda --steps 30; }
# End to end on the llama-1b shape (random weights, bfloat16), the Triton attention and LoRA path.
throughput() {
    $PY -m bench.throughput --device cuda --attention-backend triton --requests 128 --tokens 64
}
mbu() {
    $PY -m bench.mbu --device cuda --attention-backend triton --batch 64 --context 1024 --steps 32
}
multi_lora() {
    $PY -m bench.multi_lora --device cuda --attention-backend triton --requests 128 --tokens 32 \
        --adapters 1,64 --passes 1
}
speculative() {
    $PY -m bench.speculative --device cuda --attention-backend triton --requests 8 --tokens 96 \
        --rounds 3
}

run_stage() {
    local name=$1 limit=$2
    local start=$SECONDS
    timeout --kill-after=10 "$limit" bash -c "$(declare -f "$name"); $name" >"$LOGS/$name.log" 2>&1
    local rc=$?
    local line
    line="stage $name rc=$rc $((SECONDS - start))s: $(grep -E 'passed|failed|error' "$LOGS/$name.log" | tail -1)"
    echo "$line" | tee -a "$OUT/summary.txt"
    tail -n "${TAIL:-15}" "$LOGS/$name.log"
}

pack() { tar -czf "$OUT/logs.tgz.part" -C "$OUT" logs && mv "$OUT/logs.tgz.part" "$OUT/logs.tgz"; }

declare -A LIMIT=(
    [smoke]=60 [tests_torch]=240 [tests_triton]=240 [parity]=90 [kernels]=45 [kernel_tuning]=80
    [cuda_graphs]=75 [throughput]=150 [mbu]=45 [multi_lora]=180 [speculative]=50
)
setup >"$LOGS/setup.log" 2>&1
echo "setup rc=$?" | tee "$OUT/summary.txt"
cat "$LOGS/setup.log"
export PYTHONPATH=/tmp/ns:/tmp/site:$REPO
STAGES=("$@")
# Default: what the second GPU session (2026-11-27, docs/gpu.md) left to measure or to re-run.
[ ${#STAGES[@]} -eq 0 ] && STAGES=(tests_torch+tests_triton throughput multi_lora kernel_tuning)
# A stage named A+B runs A and B at once (the test stages: light on the GPU, heavy on the CPU).
for s in "${STAGES[@]}"; do
    IFS=+ read -ra group <<<"$s"
    for g in "${group[@]}"; do
        run_stage "$g" "${LIMIT[$g]:-180}" &
    done
    wait
    pack  # after every stage: a run cut short still brings back what it did
done
rm -rf "$LOGS"
cat "$OUT/summary.txt"
