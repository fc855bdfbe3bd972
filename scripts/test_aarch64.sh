#!/bin/bash
# Runs the kernel tests (NEON included) for aarch64 under qemu user emulation.
# Needs: rustup target add aarch64-unknown-linux-gnu;
#        apt-get install gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user
set -euo pipefail
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -L /usr/aarch64-linux-gnu"
cargo clippy --target aarch64-unknown-linux-gnu -p slipstream-kernels --all-targets -- -D warnings
cargo test --target aarch64-unknown-linux-gnu --release -p slipstream-kernels "$@"
