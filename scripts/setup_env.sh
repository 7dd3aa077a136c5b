#!/usr/bin/env bash
# Create the project's virtual environment (.venv) with the pinned stack:
# TensorFlow (CPU build, or the CUDA build on GPU nodes; version chosen by TFHYBRID_TF),
# Keras 3, numpy, and horovod 0.28.1 built from its source distribution with the
# project's patches (patches/horovod/*.patch, then patches/horovod/tf<major.minor>/*.patch
# of that TensorFlow, each in name order; Gloo, plus NCCL GPU operations on GPU nodes).
# The horovod wheel is built once and cached outside the clone, keyed by the horovod,
# TensorFlow and Python versions, the device, the controllers and the hash of the patch
# set, so later set-ups take seconds.
#
# Usage: scripts/setup_env.sh [--device cpu|gpu|auto] [--mpi] [--no-project] [--print-config]
#   --device        cpu: tensorflow-cpu; gpu: tensorflow[and-cuda] (the CUDA, cuDNN and
#                   NCCL pip wheels that TensorFlow pins) and horovod with
#                   HOROVOD_GPU_OPERATIONS=NCCL; auto (default): gpu when an NVIDIA
#                   driver is present (nvidia-smi on PATH or /proc/driver/nvidia), else cpu.
#                   The environment variable TFHYBRID_DEVICE sets the same.
#   --mpi           also build horovod's MPI controller (needs mpicxx; for mpirun and the
#                   Kubernetes MPI Operator). TFHYBRID_WITH_MPI=1 sets the same.
#   --no-project    install the stack but not tfhybrid itself (Docker layer caching).
#   --print-config  print what would be installed and the wheel cache used, then exit.
# Other environment: TFHYBRID_TF (TensorFlow version: 2.21.0 (default), 2.20.0, 2.19.1
# or 2.18.1; 2.21 means 2.21.0), PYTHON (interpreter), TFHYBRID_VENV (default .venv),
# TFHYBRID_CACHE (default ~/.cache/tfhybrid), CUDA_HOME (gpu builds, default
# /usr/local/cuda), HOROVOD_NCCL_HOME (default: the nvidia-nccl-cu12 wheel).
set -euo pipefail
cd "$(dirname "$0")/.."

usage() { sed -n '11,24p' "$0" | sed 's/^# \{0,1\}//'; }
die() { echo "[setup] error: $*" >&2; exit 2; }

DEVICE=${TFHYBRID_DEVICE:-auto}
WITH_MPI=${TFHYBRID_WITH_MPI:-0}
INSTALL_PROJECT=1
PRINT_ONLY=0
while [ $# -gt 0 ]; do
  case "$1" in
    --device) [ $# -ge 2 ] || die "--device needs a value: cpu, gpu or auto"; DEVICE=$2; shift 2 ;;
    --device=*) DEVICE=${1#--device=}; shift ;;
    --mpi) WITH_MPI=1; shift ;;
    --no-project) INSTALL_PROJECT=0; shift ;;
    --print-config) PRINT_ONLY=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown argument '$1'; expected --device cpu|gpu|auto, --mpi, --no-project, --print-config (see --help)" ;;
  esac
done

nvidia_driver_present() {
  command -v nvidia-smi >/dev/null 2>&1 || [ -d /proc/driver/nvidia ]
}
case "$DEVICE" in
  auto|"") if nvidia_driver_present; then DEVICE=gpu; DEVICE_WHY="NVIDIA driver found";
           else DEVICE=cpu; DEVICE_WHY="no NVIDIA driver found"; fi ;;
  cpu|gpu) DEVICE_WHY="requested" ;;
  *) die "device '$DEVICE' (TFHYBRID_DEVICE or --device): expected cpu, gpu or auto" ;;
esac
case "$WITH_MPI" in 0|1) ;; *) die "TFHYBRID_WITH_MPI=$WITH_MPI: expected 0 or 1" ;; esac

PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
VENV=${TFHYBRID_VENV:-.venv}
# TensorFlow versions horovod 0.28.1 builds against with patches/horovod/ applied
# (docs/horovod-patches.md; 2.19 without Horovod's XLA operations, tf2.19/), newest
# first; the first is the default, the last the oldest (scripts/oldest_tf_tier.sh tests
# it too).
SUPPORTED_TF="2.21.0 2.20.0 2.19.1 2.18.1"
TF_VERSION=${TFHYBRID_TF:-${SUPPORTED_TF%% *}}
for v in $SUPPORTED_TF; do      # 2.21 names the supported 2.21.x
  [ "$TF_VERSION" = "${v%.*}" ] && TF_VERSION=$v
done
case " $SUPPORTED_TF " in
  *" $TF_VERSION "*) ;;
  *) die "TFHYBRID_TF=$TF_VERSION is not a supported TensorFlow version; choose one of: ${SUPPORTED_TF// /, } (e.g. TFHYBRID_TF=2.21.0), or unset it for the default ${SUPPORTED_TF%% *}" ;;
esac
HVD_VERSION=0.28.1
# The project's horovod patches, applied to the sdist in name order: patches/horovod/*.patch
# for every TensorFlow, then patches/horovod/tf<major.minor>/*.patch for that version only.
# Their names (relative to patches/horovod) and contents key the wheel cache.
PATCH_DIR=patches/horovod
PATCHES=()
for p in "$PATCH_DIR"/*.patch "$PATCH_DIR/tf${TF_VERSION%.*}"/*.patch; do
  [ -f "$p" ] && PATCHES+=("$p")
done
if [ ${#PATCHES[@]} -gt 0 ]; then
  PATCH_HASH=$(for p in "${PATCHES[@]}"; do echo "${p#"$PATCH_DIR"/}"; cat "$p"; done | sha256sum | cut -c1-12)
else
  PATCH_HASH=none
fi
if [ "$DEVICE" = gpu ]; then
  TF_REQ="tensorflow[and-cuda]==$TF_VERSION"; TF_OTHER=tensorflow-cpu
else
  TF_REQ="tensorflow-cpu==$TF_VERSION"; TF_OTHER=tensorflow
fi
CONTROLLERS=gloo
[ "$WITH_MPI" = 1 ] && CONTROLLERS=gloo-mpi
PYTAG=$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
CACHE=${TFHYBRID_CACHE:-$HOME/.cache/tfhybrid}
WHEEL_DIR="$CACHE/wheels/horovod-$HVD_VERSION-tf$TF_VERSION-$PYTAG-$DEVICE-$CONTROLLERS-patches-$PATCH_HASH"
STAMP="$VENV/.tfhybrid-setup"
SIG="tf=$TF_VERSION hvd=$HVD_VERSION patches=$PATCH_HASH py=$PYTAG device=$DEVICE controllers=$CONTROLLERS project=$INSTALL_PROJECT req=$(cat requirements.txt setup.py | cksum | cut -d' ' -f1)"

say() { echo "[setup] $*"; }
# pip on some machines warns about unreachable local indexes: keep the log readable.
quiet() { "$@" 2> >(grep -v "is ignored: it is neither" >&2); }

if [ "$PRINT_ONLY" = 1 ]; then
  echo "device=$DEVICE ($DEVICE_WHY)"
  echo "tensorflow=$TF_REQ"
  echo "supported_tf=$SUPPORTED_TF"
  echo "tf_version=$TF_VERSION ($([ -n "${TFHYBRID_TF:-}" ] && echo "TFHYBRID_TF" || echo "default"); supported: ${SUPPORTED_TF// /, })"
  echo "patches=$PATCH_HASH ($([ ${#PATCHES[@]} -gt 0 ] && printf '%s\n' "${PATCHES[@]#"$PATCH_DIR"/}" | paste -sd, - || echo "none in $PATCH_DIR"))"
  echo "horovod=$HVD_VERSION controllers=$CONTROLLERS gpu_operations=$([ "$DEVICE" = gpu ] && echo NCCL || echo none)"
  echo "python=$PY ($PYTAG) venv=$VENV"
  echo "wheel_dir=$WHEEL_DIR"
  echo "wheel_cached=$(ls "$WHEEL_DIR"/horovod-*.whl >/dev/null 2>&1 && echo yes || echo no)"
  echo "up_to_date=$([ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$SIG" ] && echo yes || echo no)"
  exit 0
fi

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$SIG" ]; then
  say "environment $VENV is up to date ($SIG)"
  exit 0
fi
say "device: $DEVICE ($DEVICE_WHY; TFHYBRID_DEVICE=cpu|gpu or --device overrides)"

if [ ! -x "$VENV/bin/python" ]; then
  say "creating virtual environment $VENV with $PY"
  "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
say "upgrading pip/wheel/setuptools"
quiet "$VPY" -m pip install -q --upgrade pip wheel "setuptools<80"
# tensorflow and tensorflow-cpu install the same package directory: never both.
if "$VPY" -m pip show -q "$TF_OTHER" >/dev/null 2>&1; then
  say "removing $TF_OTHER (switching to $TF_REQ)"
  quiet "$VPY" -m pip uninstall -q -y "$TF_OTHER"
fi
say "installing $TF_REQ, Keras 3, numpy and test tools (about a minute; more for CUDA)"
reqs=$(mktemp)
grep -v '^tensorflow' requirements.txt > "$reqs"
quiet "$VPY" -m pip install -q "$TF_REQ" -r "$reqs"
rm -f "$reqs"

# Horovod build flags per device and controllers.
HVD_ENV=(HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1)
if [ "$WITH_MPI" = 1 ]; then
  command -v mpicxx >/dev/null 2>&1 || die "--mpi: mpicxx not found; install Open MPI (apt-get install libopenmpi-dev openmpi-bin) or drop --mpi"
  HVD_ENV+=(HOROVOD_WITH_MPI=1)
else
  HVD_ENV+=(HOROVOD_WITHOUT_MPI=1)
fi
if [ "$DEVICE" = gpu ]; then
  CUDA_DIR=${HOROVOD_CUDA_HOME:-${CUDA_HOME:-/usr/local/cuda}}
  [ -x "$CUDA_DIR/bin/nvcc" ] || die "building horovod with NCCL needs the CUDA 12 toolkit (nvcc), not found in $CUDA_DIR; set CUDA_HOME, install cuda-toolkit-12-5, or use docker/Dockerfile.gpu"
  if [ -n "${HOROVOD_NCCL_HOME:-}" ]; then
    NCCL_INC=$HOROVOD_NCCL_HOME/include; NCCL_LIB=$HOROVOD_NCCL_HOME/lib
  else   # the NCCL that TensorFlow itself loads (nvidia-nccl-cu12, pinned by tensorflow[and-cuda])
    NCCL_DIR=$("$VPY" -c 'import nvidia.nccl as n; print(list(n.__path__)[0])')
    NCCL_INC=$NCCL_DIR/include; NCCL_LIB=$NCCL_DIR/lib
    [ -e "$NCCL_LIB/libnccl.so" ] || ln -s libnccl.so.2 "$NCCL_LIB/libnccl.so"
  fi
  [ -f "$NCCL_INC/nccl.h" ] || die "nccl.h not found in $NCCL_INC; set HOROVOD_NCCL_HOME to an NCCL 2 install (the version tensorflow[and-cuda] pins)"
  HVD_ENV+=(HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_NCCL_LINK=SHARED HOROVOD_CUDA_HOME="$CUDA_DIR"
            HOROVOD_NCCL_INCLUDE="$NCCL_INC" HOROVOD_NCCL_LIB="$NCCL_LIB"
            LDFLAGS="-Wl,-rpath,$NCCL_LIB ${LDFLAGS:-}")
else
  HVD_ENV+=(HOROVOD_WITHOUT_GPU=1)
fi

if ! ls "$WHEEL_DIR"/horovod-*.whl >/dev/null 2>&1; then
  say "no cached horovod wheel in $WHEEL_DIR"
  command -v patch >/dev/null 2>&1 || die "applying $PATCH_DIR needs the 'patch' program; install it (apt-get install patch, or build-essential)"
  tmp=$(mktemp -d)
  SDIST_DIR="$CACHE/sdist"
  SDIST="$SDIST_DIR/horovod-$HVD_VERSION.tar.gz"
  if [ ! -f "$SDIST" ]; then
    say "downloading the horovod==$HVD_VERSION source distribution"
    mkdir -p "$SDIST_DIR"
    quiet "$VPY" -m pip download -q --no-binary :all: --no-deps --no-build-isolation \
      "horovod==$HVD_VERSION" -d "$tmp/sdist" || die "could not download the horovod==$HVD_VERSION sdist from the package index"
    mv "$tmp/sdist/horovod-$HVD_VERSION.tar.gz" "$SDIST"
  fi
  mkdir -p "$tmp/src"
  tar -xzf "$SDIST" -C "$tmp/src"
  SRC="$tmp/src/horovod-$HVD_VERSION"
  [ -f "$SRC/setup.py" ] || die "$SDIST did not unpack to horovod-$HVD_VERSION/setup.py"
  for p in "${PATCHES[@]}"; do
    if ! patch -d "$SRC" -p1 --forward --batch --dry-run < "$p" > "$tmp/patch.log" 2>&1; then
      cat "$tmp/patch.log" >&2
      die "patch $p does not apply to the horovod $HVD_VERSION sdist (after the patches before it in name order); fix or regenerate it against the sdist tree (diff -u a/<path> b/<path>, applied with patch -p1)"
    fi
    patch -d "$SRC" -p1 --forward --batch --silent < "$p"
    say "applied ${p#"$PATCH_DIR"/}"
  done
  say "building horovod==$HVD_VERSION ($DEVICE, $CONTROLLERS, patches $PATCH_HASH) against TensorFlow $TF_VERSION (4-6 minutes on 2 cores)"
  say "  ${HVD_ENV[*]}"
  mkdir -p "$WHEEL_DIR"
  ( env "${HVD_ENV[@]}" MAKEFLAGS="-j$(nproc)" \
    "$VPY" -m pip wheel --no-build-isolation --no-deps --no-cache-dir \
      "$SRC" -w "$tmp" ) > "$tmp/build.log" 2>&1 &
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
  rm -rf "$tmp"
  say "cached $(ls "$WHEEL_DIR")"
else
  say "using cached horovod wheel $(ls "$WHEEL_DIR"/horovod-*.whl)"
fi
say "installing horovod wheel"
quiet "$VPY" -m pip install -q --no-deps --force-reinstall "$WHEEL_DIR"/horovod-*.whl
quiet "$VPY" -m pip install -q cloudpickle psutil pyyaml packaging
if [ "$INSTALL_PROJECT" = 1 ]; then
  say "installing tfhybrid (editable)"
  quiet "$VPY" -m pip install -q --no-deps --no-build-isolation -e .
fi
say "checking horovod: $("$VPY" -c 'import horovod.tensorflow as h; print("horovod", __import__("horovod").__version__, "gloo built:", h.gloo_built(), "mpi built:", h.mpi_built(), "nccl built:", bool(h.nccl_built()))')"
echo "$SIG" > "$STAMP"
say "done"
