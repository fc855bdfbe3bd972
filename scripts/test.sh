#!/usr/bin/env bash
# All tests: the Rust workspace, then the server's end-to-end tests with the
# official openai/anthropic Python SDKs and headless Chromium (the browser
# test is skipped when Debian's chromium + chromium-driver are absent;
# .ci/run installs them).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo test --workspace
bash tests/server/run.sh
