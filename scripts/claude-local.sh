#!/usr/bin/env bash
# Point Claude Code at a local slipstream server.
#
#   scripts/claude-local.sh [--model PATH] [claude args...]
#
# Starts `slipstream serve` on 127.0.0.1:$SLIPSTREAM_PORT (default 8091) if
# nothing answers there yet (with --any-model, since Claude Code asks for
# its own model names), then runs `claude` with ANTHROPIC_BASE_URL and a key
# pointing at it. The server started here stops when claude exits.
#
# Claude Code is told the served model's name for every model it asks for
# (main, sub-agents, background tasks) and the server's context
# (CLAUDE_CODE_MAX_CONTEXT_TOKENS: its window for a model it does not know,
# so it compacts the conversation before the server has to refuse it).
#
# Environment: SLIPSTREAM_PORT, SLIPSTREAM_API_KEY (default: a random key
# for a server started here), SLIPSTREAM_BIN (default: slipstream on PATH,
# else target/release/slipstream), SLIPSTREAM_SERVE_ARGS (extra flags),
# CLAUDE_BIN (default: claude on PATH).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
port="${SLIPSTREAM_PORT:-8091}"
base="http://127.0.0.1:$port"

model_args=()
if [ "${1:-}" = "--model" ]; then
    model_args=(--model "$2")
    shift 2
fi

bin="${SLIPSTREAM_BIN:-}"
if [ -z "$bin" ]; then
    if command -v slipstream >/dev/null; then bin=slipstream; else bin="$root/target/release/slipstream"; fi
fi

server_pid=""
cleanup() { if [ -n "$server_pid" ]; then kill "$server_pid" 2>/dev/null || true; fi; }
trap cleanup EXIT

if ! curl -fsS "$base/health" >/dev/null 2>&1; then
    key="${SLIPSTREAM_API_KEY:-$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')}"
    # shellcheck disable=SC2086
    "$bin" serve --host 127.0.0.1 --port "$port" --api-key "$key" --any-model \
        "${model_args[@]}" ${SLIPSTREAM_SERVE_ARGS:-} >/dev/null 2>"${TMPDIR:-/tmp}/slipstream-serve.log" &
    server_pid=$!
    for _ in $(seq 1 600); do
        curl -fsS "$base/health" >/dev/null 2>&1 && break
        kill -0 "$server_pid" 2>/dev/null || { cat "${TMPDIR:-/tmp}/slipstream-serve.log" >&2; exit 1; }
        sleep 0.2
    done
else
    key="${SLIPSTREAM_API_KEY:-none}"
fi

models="$(curl -fsS -H "x-api-key: $key" "$base/v1/models")"
model="$(printf '%s' "$models" | sed -n 's/.*"id":"\([^"]*\)".*/\1/p')"
model="${model:-slipstream}"
context="$(printf '%s' "$models" | sed -n 's/.*"max_context":\([0-9]*\).*/\1/p')"
export ANTHROPIC_BASE_URL="$base"
export ANTHROPIC_API_KEY="$key"
export ANTHROPIC_MODEL="$model"
export ANTHROPIC_SMALL_FAST_MODEL="$model"
export ANTHROPIC_DEFAULT_HAIKU_MODEL="$model"
export ANTHROPIC_DEFAULT_SONNET_MODEL="$model"
export ANTHROPIC_DEFAULT_OPUS_MODEL="$model"
export CLAUDE_CODE_SUBAGENT_MODEL="$model"
if [ -n "$context" ]; then export CLAUDE_CODE_MAX_CONTEXT_TOKENS="$context"; fi
export CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1
export DISABLE_TELEMETRY=1
# Long local prefills: give requests time.
export API_TIMEOUT_MS="${API_TIMEOUT_MS:-3000000}"
"${CLAUDE_BIN:-claude}" "$@"
