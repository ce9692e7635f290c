#!/usr/bin/env bash
# `make device-check OUT=DIR`, or `bash tools/device_check.sh DIR`: what only a GPU can show,
# in under 9 minutes on one NVIDIA GPU (docs/device_check.md). Without one it says so in one
# line and exits 0.
#
# On the GPU machine (python3 with torch, no megatron-core / hydra-core, no network) it makes
# a venv with the system's packages (.device-venv; the machine's torch stays), installs from
# the carried wheel folder (.device-wheels, `make device-wheels`) only what does not import
# there, then ldt itself (editable, no dependencies, no build isolation), and runs
# `python -m bench.device_check DIR`: one JSON line per check in DIR/checks.jsonl, DIR/summary.md,
# DIR/logs.tar.gz (logs/ and runs/). A python3 that is already a venv gets the wheels itself. Environment:
#   PYTHON                       the interpreter to start from (default python3)
#   LDT_DEVICE_CHECK_REHEARSE=1  no GPU needed: the CUDA stage runs on the CPU, tiny sizes
#   LDT_DEVICE_CHECK_ONLY="a b"  only these checks (a rerun of the failed ones)
#   LDT_DEVICE_WHEELS / LDT_DEVICE_VENV   the wheel folder / the venv (defaults above)
set -uo pipefail
STARTED=$(date +%s.%N)
OUT=${1:-outputs/device-check}
PY=${PYTHON:-python3}
WHEELS=${LDT_DEVICE_WHEELS:-.device-wheels}
VENV=${LDT_DEVICE_VENV:-.device-venv}
REHEARSE=${LDT_DEVICE_CHECK_REHEARSE:-0}
cd "$(dirname "$0")/.." || exit 2
say() { echo "device-check: $*"; }

if [ "$REHEARSE" = 0 ] || [ -z "$REHEARSE" ]; then
    REHEARSE=0
    GPU_NAME=$("$PY" -c 'import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")' 2>/dev/null)
    if [ -z "$GPU_NAME" ]; then
        say "no CUDA device here ($PY sees none through torch); nothing to check"
        exit 0
    fi
    say "$GPU_NAME"
else
    say "REHEARSAL: the CUDA stage runs on the CPU, tiny sizes (LDT_DEVICE_CHECK_REHEARSE=$REHEARSE)"
fi
export LDT_DEVICE_CHECK_REHEARSE=$REHEARSE
mkdir -p "$OUT/logs"
OUT=$(cd "$OUT" && pwd)
LOG="$OUT/logs/setup.log"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1

# ---- the interpreter: a venv over the system's packages ---------------------------------
if "$PY" -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)'; then
    VPY=$PY  # already a venv: the wheels go into it
elif [ -x "$VENV/bin/python" ]; then
    VPY=$VENV/bin/python  # made by an earlier run on this machine
else
    { "$PY" -m venv --system-site-packages "$VENV" \
        || { rm -rf "$VENV" && "$PY" -m venv --system-site-packages --without-pip "$VENV"; }
    } >>"$LOG" 2>&1 || { say "cannot make a venv with $PY (see $LOG)"; exit 2; }
    VPY=$VENV/bin/python
fi
VPY=$("$VPY" -c 'import sys; print(sys.executable)')  # absolute: used from other folders
if "$VPY" -m pip --version >/dev/null 2>&1; then
    PIP=("$VPY" -m pip)
else
    PIP=("$PY" -m pip --python "$VPY")  # a venv made --without-pip (pip >= 22.3)
fi

# ---- the carried wheels that do not import here, then ldt --------------------------------
NEED=$("$VPY" - "$WHEELS" 2>>"$LOG" <<'EOF'
import importlib.metadata as md, os, sys

folder = sys.argv[1]
exact = {"megatron-core"}  # the version the suite tests, whatever the machine has
at_least = {"setuptools": (68,)}  # ldt's build backend (pyproject.toml)
if not os.path.isdir(folder):
    sys.exit(f"no wheel folder {folder}: run `make device-wheels` and carry it")
for f in sorted(os.listdir(folder)):
    if not f.endswith(".whl"):
        continue
    dist, version = f.split("-")[:2]
    dist = dist.replace("_", "-").lower()
    try:
        have = md.version(dist)
    except md.PackageNotFoundError:
        have = None
    old = have and dist in at_least and \
        tuple(int(x) for x in have.split(".")[:1]) < at_least[dist]
    if have is None or old or (dist in exact and have != version):
        print(os.path.join(folder, f))
        print(f"install {dist} {version}" + (f" (have {have})" if have else ""), file=sys.stderr)
    else:
        print(f"present {dist} {have}", file=sys.stderr)
EOF
) || { say "$(tail -1 "$LOG")"; exit 2; }
if [ -n "$NEED" ]; then
    # shellcheck disable=SC2086
    "${PIP[@]}" install -q --no-index --no-deps $NEED >>"$LOG" 2>&1 \
        || { say "installing the carried wheels failed (see $LOG)"; tail -5 "$LOG"; exit 2; }
fi
HERE=$(pwd)
if ! (cd / && "$VPY" -c "import ldt.patches, os, sys; sys.exit(os.path.dirname(ldt.__file__) != os.path.join('$HERE', 'ldt'))") 2>/dev/null; then
    "${PIP[@]}" install -q --no-index --no-deps --no-build-isolation -e . >>"$LOG" 2>&1 \
        || { say "installing ldt failed (see $LOG)"; tail -5 "$LOG"; exit 2; }
fi
say "set up in $(awk "BEGIN {printf \"%.0f\", $(date +%s.%N) - $STARTED}") s: $(grep -c '^install' "$LOG") wheels installed, $VPY"

# shellcheck disable=SC2086
"$VPY" -m bench.device_check "$OUT" --started "$STARTED" \
    ${LDT_DEVICE_CHECK_ONLY:+--only $LDT_DEVICE_CHECK_ONLY}
rc=$?
# The device tool brings back at most 8 files of OUT: the logs and the runs' folders travel as
# one archive beside checks.jsonl and summary.md (the first GPU run lost every log so).
PACK=$(cd "$OUT" && ls -d logs runs 2>/dev/null)
# shellcheck disable=SC2086
if [ -n "$PACK" ] && tar czf "$OUT/logs.tar.gz" -C "$OUT" $PACK; then
    (cd "$OUT" && rm -rf $PACK)
    say "logs and runs: $OUT/logs.tar.gz"
fi
exit $rc
