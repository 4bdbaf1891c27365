#!/usr/bin/env bash
# Install the appliance into a virtual environment (development / CI / quick start).
#   ./install.sh [--venv DIR] [--dev]
# --dev adds the test dependencies. The CPU build of torch that lies on disk is taken because
# pyproject pins torch>=2.6,<2.14 (a range admitting 2.14 pulls gigabytes of CUDA wheels).
set -euo pipefail
cd "$(dirname "$0")"
venv=".venv"
extras=""
while [ $# -gt 0 ]; do
  case "$1" in
    --venv) venv="$2"; shift 2 ;;
    --dev) extras="[test]"; shift ;;
    -h|--help) sed -n '2,5p' "$0"; exit 0 ;;
    *) echo "install.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip >/dev/null 2>&1 || true
"$venv/bin/python" -m pip install --quiet -e ".${extras}"
echo "installed into $venv: $("$venv/bin/python" -c 'import torch; print("torch", torch.__version__)')"
