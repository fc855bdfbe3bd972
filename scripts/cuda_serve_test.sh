#!/usr/bin/env bash
# `slipstream serve --backend cuda` under the server's SDK tests (tests/server:
# the official openai and anthropic Python SDKs at the pinned versions), on
# the device machine, which has no network and whose whole working tree
# travels within 64 MiB: the pinned clients and their needs travel as one
# site-packages tarball for the device's python3 (3.12, which already holds
# pytest), the binary xz-compressed.
#
#   bash scripts/cuda_serve_test.sh build   # here: .devbin/slipstream.xz and
#                                           # .devsite/site.tar.xz
#   bash scripts/cuda_serve_test.sh run     # on the device, both carried:
#       run(command="bash scripts/cuda_serve_test.sh run",
#           carry=[".devbin/slipstream.xz", ".devsite"])
#
# The chat-page test needs Chromium and the soak is a CPU-memory test: both
# are left to the CPU run of tests/server. Prefix reuse on the device is
# checked by test_openai_sdk's usage assertions (cached_tokens).
set -uo pipefail
cd "$(dirname "$0")/.."
B=.devbin
mode=${1:-run}

# The clients under test, pinned in tests/server/requirements.txt.
clients=$(grep -E '^(openai|anthropic)==' tests/server/requirements.txt)

if [ "$mode" = build ]; then
    set -e
    for d in /.devbin/ /.devsite/; do
        grep -qx "$d" .git/info/exclude 2>/dev/null || echo "$d" >> .git/info/exclude
    done
    [ -x $B/slipstream ] || { echo "run scripts/cuda_device_test.sh build first"; exit 1; }
    xz -9e -T2 -c $B/slipstream > $B/slipstream.xz
    wheels=$(mktemp -d) site=$(mktemp -d)
    # shellcheck disable=SC2086
    pip download -q --dest "$wheels" --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 $clients
    pip install -q --no-deps --no-index --target "$site" --python-version 3.12 --implementation cp \
        --only-binary=:all: --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 "$wheels"/*.whl
    find "$site" -name __pycache__ -prune -exec rm -rf {} +
    mkdir -p .devsite
    tar -C "$site" -cf - . | xz -9e -T2 > .devsite/site.tar.xz
    rm -rf "$wheels" "$site"
    du -sh $B/slipstream.xz .devsite/site.tar.xz
    exit 0
fi

OUT=${OUT:-/tmp/cuda_out}
mkdir -p "$OUT"
mkdir -p /tmp/site $B
python3 -c 'import lzma, shutil, sys
with lzma.open(sys.argv[1]) as f, open(sys.argv[2], "wb") as o: shutil.copyfileobj(f, o)' \
    $B/slipstream.xz $B/slipstream || exit 1
chmod +x $B/slipstream
tar -C /tmp/site -xJf .devsite/site.tar.xz || exit 1
export PYTHONPATH=/tmp/site
python3 -c 'import openai, anthropic, pytest; print("openai", openai.__version__, "anthropic", anthropic.__version__, "pytest", pytest.__version__)' \
    | tee "$OUT/clients.txt" || exit 1
export SLIPSTREAM_SERVE="$PWD/$B/slipstream serve --backend cuda"
export SLIPSTREAM_CACHE=/tmp/serve-cache
mkdir -p $SLIPSTREAM_CACHE
cd tests/server
python3 -m pytest -q -p no:cacheprovider -k "not soak and not chat_page" \
    test_openai_sdk.py test_anthropic_sdk.py test_openai_responses.py 2>&1 | tee "$OUT/serve.log"
rc=${PIPESTATUS[0]}
echo "cuda serve SDK tests: $([ "$rc" = 0 ] && echo PASS || echo FAIL)" | tee -a "$OUT/summary.txt"
exit "$rc"
