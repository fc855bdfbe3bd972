#!/usr/bin/env bash
# All tests: the Rust workspace, then the server's end-to-end tests with the
# official openai/anthropic Python SDKs and headless Chromium (the browser
# test is skipped when Debian's chromium + chromium-driver are absent;
# .ci/run installs them), then the coding-agent clients (Claude Code, Codex,
# Qwen Code, opencode, aider) each through a tool round trip
# (tests/clients; pinned, installed from npm and PyPI into target/clients/).
# Between the two: every fuzz target for 15 s (SLIPSTREAM_FUZZ_SECONDS).
set -euo pipefail
cd "$(dirname "$0")/.."
# NVIDIA's NVRTC wheel (pinned in crates/cuda/nvrtc-requirements.txt) so the
# CUDA kernels' compile test runs without a GPU or toolkit; the test fails
# instead of skipping when NVRTC is required and absent.
nv=target/nvrtc-venv
[ -x "$nv/bin/python" ] || python3 -m venv "$nv"
if ! cmp -s crates/cuda/nvrtc-requirements.txt "$nv/.requirements" 2>/dev/null; then
    "$nv/bin/pip" install --quiet --disable-pip-version-check -r crates/cuda/nvrtc-requirements.txt
    cp crates/cuda/nvrtc-requirements.txt "$nv/.requirements"
fi
nvrtc_lib=$("$nv/bin/python" -c 'import nvidia, glob, os; print(os.path.dirname(sorted(glob.glob(os.path.join(nvidia.__path__[0], "*", "lib", "libnvrtc.so*")))[0]))')
export LD_LIBRARY_PATH="$nvrtc_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export SLIPSTREAM_REQUIRE_NVRTC=1
cargo test --workspace
# Mutation fuzzing of every reader of untrusted bytes (crates/fuzz), a few
# seconds a target; a panic fails the run and leaves its input in
# target/fuzz-findings/.
cargo run --quiet -p slipstream-fuzz --profile test -- --seconds "${SLIPSTREAM_FUZZ_SECONDS:-15}"
bash tests/server/run.sh
bash tests/clients/run.sh
