#!/usr/bin/env bash
# Create the project's virtual environment (.venv) with the pinned stack:
# tensorflow-cpu 2.18.1, Keras 3, numpy, horovod 0.28.1 built from source with Gloo.
# The horovod wheel is built once and cached outside the clone, keyed by the
# horovod, TensorFlow and Python versions, so later set-ups take seconds.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
VENV=${TFHYBRID_VENV:-.venv}
TF_VERSION=2.18.1
HVD_VERSION=0.28.1
PYTAG=$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
CACHE=${TFHYBRID_CACHE:-$HOME/.cache/tfhybrid}
WHEEL_DIR="$CACHE/wheels/horovod-$HVD_VERSION-tf$TF_VERSION-$PYTAG-gloo"
STAMP="$VENV/.tfhybrid-setup"
SIG="tf=$TF_VERSION hvd=$HVD_VERSION py=$PYTAG req=$(cat requirements.txt setup.py | cksum | cut -d' ' -f1)"

say() { echo "[setup] $*"; }
# pip on some machines warns about unreachable local indexes: keep the log readable.
quiet() { "$@" 2> >(grep -v "is ignored: it is neither" >&2); }

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$SIG" ]; then
  say "environment $VENV is up to date ($SIG)"
  exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
  say "creating virtual environment $VENV with $PY"
  "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
say "upgrading pip/wheel/setuptools"
quiet "$VPY" -m pip install -q --upgrade pip wheel "setuptools<80"
say "installing tensorflow-cpu==$TF_VERSION, Keras 3, numpy and test tools (about a minute)"
quiet "$VPY" -m pip install -q -r requirements.txt

if ! ls "$WHEEL_DIR"/horovod-*.whl >/dev/null 2>&1; then
  say "no cached horovod wheel in $WHEEL_DIR"
  say "building horovod==$HVD_VERSION with Gloo against TensorFlow $TF_VERSION (4-6 minutes on 2 cores)"
  mkdir -p "$WHEEL_DIR"
  tmp=$(mktemp -d)
  ( HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 \
    HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 HOROVOD_WITHOUT_GPU=1 \
    MAKEFLAGS="-j$(nproc)" \
    "$VPY" -m pip wheel --no-build-isolation --no-deps --no-cache-dir \
      "horovod==$HVD_VERSION" -w "$tmp" ) > "$tmp/build.log" 2>&1 &
  pid=$!
  start=$(date +%s)
  while kill -0 $pid 2>/dev/null; do
    sleep 30
    say "  ... still building horovod ($(( $(date +%s) - start ))s)"
  done
  if ! wait $pid; then
    tail -40 "$tmp/build.log"
    say "horovod build FAILED; full log: $tmp/build.log"
    exit 1
  fi
  mv "$tmp"/horovod-*.whl "$WHEEL_DIR"/
  say "cached $(ls "$WHEEL_DIR")"
else
  say "using cached horovod wheel $(ls "$WHEEL_DIR")"
fi
say "installing horovod wheel"
quiet "$VPY" -m pip install -q --no-deps --force-reinstall "$WHEEL_DIR"/horovod-*.whl
quiet "$VPY" -m pip install -q cloudpickle psutil pyyaml packaging
say "installing tfhybrid (editable)"
quiet "$VPY" -m pip install -q --no-deps --no-build-isolation -e .
say "checking horovod: $("$VPY" -c 'import horovod.tensorflow as h; print("horovod", __import__("horovod").__version__, "gloo built:", h.gloo_built())')"
echo "$SIG" > "$STAMP"
say "done"
