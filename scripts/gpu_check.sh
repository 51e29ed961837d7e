#!/usr/bin/env bash
# The GPU check (scripts/gpu_check.py): one call on a machine with one CUDA GPU, torch, transformers
# and peft, nothing else installed, no network. Its summary goes to $OUT/gpu_check.json step by step.
#   bash scripts/gpu_check.sh --prepare      here, where pip reaches PyPI: the wheels it needs, into .whl/
#   bash scripts/gpu_check.sh                on the GPU machine (carry .whl along)
#   bash scripts/gpu_check.sh --rehearse     the same steps on this machine's CPU, tiny shapes (slow suite)
set -uo pipefail
cd "$(dirname "$0")/.."
if [[ "${1:-}" == "--prepare" ]]; then
  # Hydra and OmegaConf (pure Python); omegaconf's antlr4 runtime exists only as an sdist: build its wheel
  rm -rf .whl && mkdir -p .whl
  python3 -m pip download -q --no-deps --only-binary=:all: -d .whl "hydra-core==1.3.2" "omegaconf==2.3.0" || exit 1
  python3 -m pip wheel -q --no-deps -w .whl "antlr4-python3-runtime==4.9.3" || exit 1
  grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
  ls .whl
  exit 0
fi
if ! python3 -c "import hydra, omegaconf" 2>/dev/null; then
  if ! ls .whl/*.whl >/dev/null 2>&1; then
    echo "gpu_check: hydra and omegaconf are not installed and .whl/ holds no wheels: run bash scripts/gpu_check.sh --prepare where PyPI is reachable, and carry .whl" >&2
    exit 2
  fi
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gpu_check_site .whl/*.whl || exit 2
  export PYTHONPATH="/tmp/gpu_check_site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT="${OUT:-$(mktemp -d /tmp/gpu_check.XXXXXX)}"
exec timeout "${GPU_CHECK_TIMEOUT:-300}" python3 scripts/gpu_check.py --out "$OUT" "$@"
