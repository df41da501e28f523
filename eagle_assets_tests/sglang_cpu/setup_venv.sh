#!/usr/bin/env bash
# Build a CPU virtualenv in which SGLang 0.5.23's server runs (test-only; eagle_assets_tests/real_sglang.py calls it).
#
#   usage: setup_venv.sh VENV_DIR        (python3.11; pip's configured index or find-links must serve the packages)
#
# With BASE_PYTHON set (the tests set it to their own venv's python, which has torch 2.13.0), the new venv sees that
# venv's packages after its own (a .pth line): pip then installs only what SGLang needs in another version or what
# the base lacks (sglang, triton, transformers 5.19 ...), not torch and the ~70 packages both share. pip then reports
# that the base's own packages want other versions (e.g. eagle-assets: transformers 5.24): the base is unchanged.
#
# PyPI has no x86 CPU build of SGLang's compiled kernel package: sglang is installed --no-deps beside its non-CUDA
# requirements on CPU torch 2.13.0, and the server runs with the stand-in eagle_assets_tests/sglang_cpu/sgl_kernel on
# PYTHONPATH (it defines the names SGLang's CPU path imports and raises if one is ever called). About 70 s and 3 GB from
# a local package index on an idle 2-core machine; 40 s and 1.8 GB with BASE_PYTHON.
set -euo pipefail
VENV=${1:?usage: $0 VENV_DIR}
PYTHON=${PYTHON:-python3}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

"$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q --no-compile)
SITE=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
if [ -n "${BASE_PYTHON:-}" ]; then
  "$BASE_PYTHON" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" > "$SITE/eagle_assets_base_venv.pth"
fi
echo "torch==2.13.0" > "$WORK/constraints.txt"
"${PIP[@]}" -c "$WORK/constraints.txt" torch==2.13.0
# sglang imports triton at module level; on a CPU host it is imported, never run
"${PIP[@]}" -c "$WORK/constraints.txt" triton==3.8.0
# sglang 0.5.23's Requires-Dist without the CUDA and kernel packages (sglang-kernel, flashinfer, cuda-python,
# nvidia-*, flash-attn, torchaudio, torchvision)
cat > "$WORK/requirements.txt" <<'REQ'
aiohttp
anthropic>=0.20.0
blobfile==3.0.0
build
compressed-tensors==0.18.0
datasets
distro
easydict
einops
fastapi
gguf
interegular
IPython
llguidance<2.0.0,>=1.7.6
mistral_common>=1.11.5
modelscope
msgspec
ninja
numba==0.65.1
numpy
nvidia-ml-py
openai==2.8.0
openai-harmony==0.0.4
orjson
outlines==0.1.11
packaging
partial_json_parser
pillow
prometheus-client>=0.20.0
psutil
py-spy
pybase64
pydantic
python-dateutil<3
python-multipart
pyzmq>=25.1.2
regex
requests
scipy
sentencepiece==0.2.1
setproctitle
smg-grpc-servicer>=0.9.0
soundfile==0.13.1
tiktoken
timm==1.0.25
tokenizers==0.23.2
tqdm
transformers==5.19.0
uvicorn>=0.51
uvloop
watchfiles
xgrammar==0.2.7
xxhash
zstandard
REQ
"${PIP[@]}" -c "$WORK/constraints.txt" -r "$WORK/requirements.txt"
"${PIP[@]}" --no-deps sglang==0.5.23
# SpecForge 0.2.0 beside it, for the tests that hold our block-drafter objectives to its modules (its own
# requirements are SGLang's, already here)
"${PIP[@]}" --no-deps specforge==0.2.0
# timm pulls torchvision, whose PyPI wheels are CUDA builds: their C extension does not load with CPU torch, and
# torchvision's _meta_registrations then fails at import ("operator torchvision::nms does not exist"), which breaks
# `import transformers.image_utils` inside SGLang. Register those fake kernels only when the extension loaded.
"$VENV/bin/python" - "$SITE/torchvision/_meta_registrations.py" <<'PY'
import sys
from pathlib import Path

path = Path(sys.argv[1])
source = path.read_text()
anchor = "import torchvision.extension  # noqa: F401\n"
if "_register_if_loaded" not in source and anchor in source:
    source = source.replace("@torch.library.register_fake(", "@_register_if_loaded(")
    source = source.replace(anchor, anchor + (
        "\n\ndef _register_if_loaded(name):\n"
        "    return torch.library.register_fake(name) if torchvision.extension._has_ops() else (lambda fn: fn)\n"
    ), 1)
    path.write_text(source)
PY
"$VENV/bin/python" -c "import sglang, torch; print('sglang', sglang.__version__, 'torch', torch.__version__)"
