#!/usr/bin/env bash
# `slipstream serve --backend cuda` under the server's SDK tests (tests/server:
# the official openai and anthropic Python SDKs), on the device machine,
# which has no network: the pinned clients travel as wheels.
#
#   bash scripts/cuda_serve_test.sh build   # here: wheels into .devbin/wheels
#                                           # (after cuda_device_test.sh build)
#   bash scripts/cuda_serve_test.sh run     # on the device, .devbin carried
#
# The chat-page test needs Chromium and the soak is a CPU-memory test: both
# are left to the CPU run of tests/server. Prefix reuse on the device is
# checked by test_openai_sdk's usage assertions (cached_tokens).
set -uo pipefail
cd "$(dirname "$0")/.."
B=.devbin
mode=${1:-run}
reqs=$(grep -v -e '^#' -e '^selenium' tests/server/requirements.txt)

if [ "$mode" = build ]; then
    set -e
    mkdir -p $B/wheels
    # Python versions the device may have; pure wheels are shared.
    for v in 3.10 3.11 3.12 3.13; do
        # shellcheck disable=SC2086
        pip download -q --dest $B/wheels --only-binary=:all: \
            --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
            --python-version $v $reqs
    done
    du -sh $B/wheels
    exit 0
fi

OUT=${OUT:-/tmp/cuda_out}
mkdir -p "$OUT"
venv=/tmp/serve-venv
python3 -m venv $venv || exit 1
# shellcheck disable=SC2086
$venv/bin/pip install -q --no-index --find-links $B/wheels $reqs || exit 1
export SLIPSTREAM_SERVE="$PWD/$B/slipstream serve --backend cuda"
export SLIPSTREAM_CACHE=/tmp/serve-cache
mkdir -p $SLIPSTREAM_CACHE
cd tests/server
$venv/bin/python -m pytest -q -p no:cacheprovider -k "not soak and not chat_page" \
    test_openai_sdk.py test_anthropic_sdk.py test_openai_responses.py 2>&1 | tee "$OUT/serve.log"
rc=${PIPESTATUS[0]}
echo "cuda serve SDK tests: $([ "$rc" = 0 ] && echo PASS || echo FAIL)" | tee -a "$OUT/summary.txt"
exit "$rc"
