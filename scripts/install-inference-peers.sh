#!/usr/bin/env bash
# The inference routers keel's lab compares with (`keel lab --peers vllm-router,smg`), from PyPI
# in a virtual environment of their own: vLLM Router 0.1.17 (`vllm-router`) and SGLang's model
# gateway SMG 1.13 (`smg`). Prints the environment's bin directory; the lab finds the routers
# there (KEEL_INFERENCE_PEERS_VENV, default ~/.cache/keel/inference-peers).
# Usage: bash scripts/install-inference-peers.sh
set -euo pipefail
. "$(dirname "$0")/install-lib.sh"
venv=${KEEL_INFERENCE_PEERS_VENV:-$HOME/.cache/keel/inference-peers}
if [ ! -x "$venv/bin/vllm-router" ] || [ ! -x "$venv/bin/smg" ]; then
    make_venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check vllm-router==0.1.17 smg==1.13.0
fi
"$venv/bin/vllm-router" --help >/dev/null
"$venv/bin/smg" launch --help >/dev/null
echo "$venv/bin"
