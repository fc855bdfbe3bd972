#!/usr/bin/env bash
# Build llama.cpp (CPU, Release, native) as a benchmark peer for `slipstream bench`.
#
# Usage: scripts/build_llama_cpp.sh [OUT_DIR]
#   OUT_DIR  where the binaries end up (default ~/.cache/slipstream/llama.cpp);
#            must lie outside the repository. After the build OUT_DIR/bin holds
#            llama-bench, llama-cli, llama-completion and llama-server (those
#            the source has), and OUT_DIR/VERSION names the source they came from.
#            llama-server is the peer of `slipstream bench agent`; it is built
#            without its web UI (no npm, no download of prebuilt assets) and
#            without HTTPS (it only listens on loopback here).
#
# The source is the llama.cpp copy vendored in the llama-cpp-python sdist
# (vendor/llama.cpp), fetched with pip so that no git clone is needed:
#   pip download --no-deps --no-binary llama-cpp-python llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION
# (`--no-binary :all:` would also build the sdist's build backend from source
# just to read its metadata: minutes, where this takes seconds.)
# Needs: python3 + pip, cmake >= 3.14, a C/C++ compiler. Build takes ~8-10 min on 2 cores.
# Environment: LLAMA_CPP_PYTHON_VERSION (default 0.3.36), JOBS (default nproc).
set -euo pipefail

version="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
out="${1:-$HOME/.cache/slipstream/llama.cpp}"
jobs="${JOBS:-$(nproc)}"

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
case "$out/" in
  "$repo_root"/*) echo "error: OUT_DIR $out lies inside the repository $repo_root; pick a directory outside it" >&2; exit 2 ;;
esac

for tool in cmake python3; do
  command -v "$tool" >/dev/null || { echo "error: $tool not found (Debian/Ubuntu: apt-get install -y $tool)" >&2; exit 2; }
done

src_root="$out/src"
mkdir -p "$src_root"
sdist="$(ls "$src_root"/llama_cpp_python-"$version".tar.gz 2>/dev/null || true)"
if [ -z "$sdist" ]; then
  echo "fetching llama-cpp-python==$version sdist with pip" >&2
  python3 -m pip download --no-deps --no-binary llama-cpp-python --dest "$src_root" "llama-cpp-python==$version"
  sdist="$(ls "$src_root"/llama_cpp_python-"$version".tar.gz)"
fi

src="$src_root/llama_cpp_python-$version"
if [ ! -f "$src/vendor/llama.cpp/CMakeLists.txt" ]; then
  tar -xzf "$sdist" -C "$src_root"
fi
llama="$src/vendor/llama.cpp"
[ -f "$llama/CMakeLists.txt" ] || { echo "error: $llama/CMakeLists.txt missing: sdist layout changed?" >&2; exit 1; }

build="$out/build"
cmake -S "$llama" -B "$build" \
  -DCMAKE_BUILD_TYPE=Release \
  -DGGML_NATIVE=ON \
  -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF \
  -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
  -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF \
  -DBUILD_SHARED_LIBS=OFF

# Build only the targets the source defines.
# (the help text is captured first: `grep -q` in a pipe would end it early
# and pipefail would count that as a failure)
help_text="$(cmake --build "$build" --target help 2>/dev/null || true)"
targets=()
for t in llama-bench llama-cli llama-completion llama-server; do
  if printf '%s\n' "$help_text" | grep -E "^\.\.\. $t\$" >/dev/null; then
    targets+=("$t")
  fi
done
[ "${#targets[@]}" -gt 0 ] || { echo "error: none of llama-bench/llama-cli/llama-completion/llama-server is a target in $llama" >&2; exit 1; }
echo "building: ${targets[*]} with $jobs jobs" >&2
cmake --build "$build" --config Release -j "$jobs" --target "${targets[@]}"

mkdir -p "$out/bin"
for t in "${targets[@]}"; do
  cp -f "$build/bin/$t" "$out/bin/$t.tmp" && mv -f "$out/bin/$t.tmp" "$out/bin/$t"
done
printf 'llama-cpp-python %s (vendor/llama.cpp)\ntargets: %s\n' "$version" "${targets[*]}" >"$out/VERSION.tmp"
mv -f "$out/VERSION.tmp" "$out/VERSION"
echo "done: $out/bin" >&2
ls -l "$out/bin" >&2
