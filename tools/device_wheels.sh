#!/usr/bin/env bash
# `make device-wheels`: the wheels a lent GPU machine lacks, for its Python 3.12 on manylinux
# x86_64, into one git-ignored folder that travels with the working tree (docs/device_check.md).
#
# The machine has torch 2.11 (CUDA 13), transformers, safetensors, accelerate, pytest,
# hypothesis and tensorboard, so numpy, tokenizers, psutil, tqdm, PyYAML and packaging are
# there as their dependencies; it has no megatron-core, hydra-core or omegaconf, and no
# network. Carried: what ldt needs and nothing there brings (megatron-core at the version the
# local suite tests, hydra-core, omegaconf, antlr4, matplotlib and its dependencies), the
# small ones that might be missing, and setuptools + wheel to install ldt itself without
# build isolation. tools/device_check.sh installs only those that do not import there.
#
#   tools/device_wheels.sh [DIR]        (default .device-wheels; run from the repository root)
set -euo pipefail
DIR=${1:-.device-wheels}
PY=${PY:-.venv/bin/python}  # the local venv: its versions are the ones the suite tests
[ -x "$PY" ] || { echo "device-wheels: $PY is missing; run \`make install\` first" >&2; exit 2; }

# distribution names; pinned to the local venv's version where it has one
NAMES="megatron-core hydra-core omegaconf matplotlib contourpy cycler fonttools kiwisolver
pillow pyparsing python-dateutil six psutil tqdm packaging PyYAML setuptools wheel"
SPECS=$("$PY" - $NAMES <<'EOF'
import importlib.metadata as md, sys
for name in sys.argv[1:]:
    try:
        print(f"{name}=={md.version(name)}")
    except md.PackageNotFoundError:
        print(name)
EOF
)
ANTLR=$("$PY" -c "import importlib.metadata as m; print(m.version('antlr4-python3-runtime'))")

rm -rf "$DIR.tmp" && mkdir -p "$DIR.tmp"
quiet() { "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
# shellcheck disable=SC2086
quiet "$PY" -m pip download -q --no-deps --only-binary=:all: --dest "$DIR.tmp" \
    --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 $SPECS
# antlr4-python3-runtime 4.9.3 (what hydra-core 1.3 needs) is published as a source archive
# only: build its pure-Python wheel here
quiet "$PY" -m pip wheel -q --no-deps --no-binary=antlr4-python3-runtime --wheel-dir "$DIR.tmp" \
    "antlr4-python3-runtime==$ANTLR"
rm -rf "$DIR" && mv "$DIR.tmp" "$DIR"
ls -1 "$DIR"
SIZE=$(du -sm "$DIR" | cut -f1)
echo "device-wheels: $(ls "$DIR" | wc -l) wheels, ${SIZE} MiB in $DIR"
if [ "$SIZE" -ge 60 ]; then
    echo "device-wheels: $DIR is ${SIZE} MiB; what travels must stay under 64 MiB" >&2
    exit 1
fi
