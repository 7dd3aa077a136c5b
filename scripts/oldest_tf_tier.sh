#!/usr/bin/env bash
# The short test tier on the oldest supported TensorFlow (scripts/run_tests.py's suite
# "tf-oldest"): a second environment with that TensorFlow and its own horovod wheel
# (cached like the default one), then the unit tests and the -np 2 exactness checks
# listed below, each against one plain Keras process as in the main suites.
#
# Usage: scripts/oldest_tf_tier.sh RESULTS_DIR [pytest args...]
# Environment: TFHYBRID_OLDEST_VENV (default .venv-tf<version>).
set -euo pipefail
cd "$(dirname "$0")/.."
RESULTS=${1:?usage: scripts/oldest_tf_tier.sh RESULTS_DIR [pytest args...]}
shift
# the supported versions, newest (the default) first: scripts/setup_env.sh --print-config
OLDEST=$(bash scripts/setup_env.sh --print-config | sed -n 's/^supported_tf=//p' | awk '{print $NF}')
[ -n "$OLDEST" ] || { echo "[tf-oldest] scripts/setup_env.sh --print-config names no supported_tf" >&2; exit 2; }
VENV=${TFHYBRID_OLDEST_VENV:-.venv-tf$OLDEST}
echo "[tf-oldest] TensorFlow $OLDEST in $VENV"
TFHYBRID_TF=$OLDEST TFHYBRID_VENV=$VENV bash scripts/setup_env.sh
PY=$VENV/bin/python
"$PY" -c "import tensorflow as tf; assert tf.__version__ == '$OLDEST', tf.__version__"
# Exactness against one process for the planned strategies, p and ls, the guards and
# a checkpoint resumed on another world size (tests/parallel/test_transform.py and the
# files after it); the unit tests cover the version-dependent code paths in one process.
NP2=(tests/parallel/test_transform.py tests/parallel/test_pipeline.py
     tests/parallel/test_layer_separation.py tests/parallel/test_optimizer_fit.py)
status=0
"$PY" -m pytest tests/unit -q -p no:cacheprovider --junitxml="$RESULTS/tf-oldest-unit.xml" "$@" || status=1
"$VENV/bin/horovodrun" -np 2 --gloo "$PY" -m pytest "${NP2[@]}" -q -p no:cacheprovider \
    --junitxml="$RESULTS/tf-oldest-np2-rank{rank}.xml" "$@" || status=1
exit $status
