#!/usr/bin/env bash
# Python integration tests of `slipstream serve`: the official openai and
# anthropic SDKs, headless Chromium on the chat page, and a bounded soak.
#
# Needs python3 with venv, and for the page test Debian's chromium and
# chromium-driver (apt-get install -y chromium chromium-driver); without
# them that test is skipped. Extra arguments go to pytest.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
cd "$root"

venv="$here/.venv"
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
stamp="$venv/.requirements"
if ! cmp -s "$here/requirements.txt" "$stamp" 2>/dev/null; then
    "$venv/bin/pip" install --quiet --disable-pip-version-check -r "$here/requirements.txt"
    cp "$here/requirements.txt" "$stamp"
fi

cargo build --release --quiet -p slipstream-cli --bin slipstream
export SLIPSTREAM_SERVE="$root/target/release/slipstream serve"
# The demo model is repacked once into a cache of the test run's own.
export SLIPSTREAM_CACHE="${SLIPSTREAM_CACHE:-$root/target/tmp/server-tests-cache}"
mkdir -p "$SLIPSTREAM_CACHE"

cd "$here"
exec "$venv/bin/python" -m pytest -q -p no:cacheprovider "$@"
