#!/usr/bin/env bash
# The carry of benchmarks/gpu/gpu_check.py: the wheels a bare GPU machine lacks (Python 3.12, PyTorch 2.11+cu130,
# transformers, NVML's bindings, pytest; no DeepSpeed, no Optuna; offline), at the versions this venv has.
#
#   benchmarks/gpu/gpu_carry.sh [DEST]        # DEST: .whl (default), ignored by git through .git/info/exclude
#
# Downloads the binary wheels for CPython 3.12 on x86-64 (pip download --no-deps), builds DeepSpeed's (PyPI has
# only its sdist: pip wheel --no-deps, no op pre-built; the GPU JIT-builds FusedAdam with its nvcc), then prints
# each wheel's size, their total and the total with the checkout's tracked files, and fails past 64 MiB.
# There, first in the command: python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site
# .whl/*.whl && export PYTHONPATH=/tmp/site (benchmarks/gpu/gpu_check.py --install does it).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python}
DEST=${1:-.whl}
LIMIT=$((64 * 1024 * 1024))

version() { "$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }

# DeepSpeed's own needs the image lacks (hjson, pydantic and pydantic's), the search's (optuna and its database:
# sqlalchemy, alembic, mako, colorlog) and fp8's (torchao); the image has numpy, packaging, tqdm, PyYAML,
# typing-extensions, markupsafe, psutil, ninja, py-cpuinfo, msgpack, einops (docs/guides/cuda.md)
BINARY=(hjson pydantic pydantic_core annotated-types typing-inspection optuna sqlalchemy alembic mako colorlog torchao)

mkdir -p "$DEST"
exclude=$(git rev-parse --git-path info/exclude)
grep -qxF "/$DEST/" "$exclude" 2>/dev/null || echo "/$DEST/" >> "$exclude"
rm -f "$DEST"/*.whl

specs=()
for name in "${BINARY[@]}"; do specs+=("$name==$(version "$name")"); done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$DEST" "${specs[@]}"
DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation "deepspeed==$(version deepspeed)" -w "$DEST"

wheels=$(du -cb "$DEST"/*.whl | tail -1 | cut -f1)
checkout=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | awk '$2 == "total" {s += $1} END {print s}')
ls -l "$DEST"/*.whl | awk '{printf "%12d  %s\n", $5, $9}'
echo "wheels: $(ls "$DEST"/*.whl | wc -l) files, $wheels bytes; checkout (tracked files): $checkout bytes; together: $((wheels + checkout)) of $LIMIT"
if [ $((wheels + checkout)) -ge $LIMIT ]; then
    echo "gpu_carry: over 64 MiB with the checkout" >&2
    exit 1
fi
