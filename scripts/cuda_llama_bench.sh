#!/usr/bin/env bash
# llama.cpp's llama-bench on the GPU machine, for comparison with
# `scripts/cuda_bench.sh` and `scripts/cuda_prefill_bench.sh` (same synthetic
# 35B model, written as GGUF).
#
#   here:   bash scripts/cuda_llama_bench.sh source   # the pinned llama.cpp
#           (llama-cpp-python 0.3.36's vendored copy, models/docs/tests and
#           other backends removed) into .llamacpp/llama.tar.xz (git-ignored)
#   device: run(command="bash scripts/cuda_llama_bench.sh", carry=[".llamacpp", ".devbin"])
#
# Builds llama-bench as users build it: CUDA for sm_90 with FlashAttention
# (GGML_CUDA_FA=ON, the default; FA=OFF builds without), statically linked,
# unless .llamacpp/llama-bench.xz holds one built earlier (BUILD_ONLY=1
# builds, writes $OUT/llama-bench.xz and stops: a build and the benchmark
# then fit separate device calls). Then generates /tmp/m.gguf with
# `slipstream synth --format gguf` and runs prefill and decode (-p $PP -n 64,
# flash attention on where built with it) fully offloaded and with the
# routed experts of all but a few layers on the CPU (--n-cpu-moe $NCMOE),
# sampling VRAM use.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = source ]; then
    set -e
    d=$(mktemp -d)
    (cd "$d" && curl -sL "$(curl -s https://pypi.org/simple/llama-cpp-python/ \
        | grep -o 'https://[^"#]*llama_cpp_python-0.3.36.tar.gz' | head -1)" | tar xz)
    L=$d/llama_cpp_python-0.3.36/vendor/llama.cpp
    rm -rf "$L"/{docs,models,tests,benches,media,app,pocs,gguf-py,conversion} "$L"/examples/* "$L"/tools/{ui,server}
    for b in cann et hexagon hip metal musa opencl openvino sycl virtgpu vulkan webgpu zdnn zendnn blas rpc; do
        rm -rf "$L/ggml/src/ggml-$b"
    done
    mkdir -p .llamacpp
    tar cJf .llamacpp/llama.tar.xz -C "$(dirname "$L")" llama.cpp
    rm -rf "$d"
    grep -qx '/.llamacpp/' .git/info/exclude 2>/dev/null || echo '/.llamacpp/' >> .git/info/exclude
    ls -la .llamacpp
    exit 0
fi
OUT=${OUT:-/tmp/cuda_out}
mkdir -p "$OUT"
FA=${FA:-ON}
BUILD_S=${BUILD_S:-420}
command -v nvcc >/dev/null || for d in /usr/local/cuda/bin /usr/local/cuda-*/bin; do [ -x "$d/nvcc" ] && export PATH="$d:$PATH"; done
command -v nvcc >/dev/null || { echo "no nvcc on this machine: llama.cpp not built" | tee "$OUT/llama.txt"; exit 3; }
nvcc --version | tail -2 | tee "$OUT/llama.txt"
W=/tmp/llama && mkdir -p $W
LB=$W/llama.cpp/build/bin/llama-bench
t0=$(date +%s)
if [ -f .llamacpp/llama-bench.xz ]; then
    mkdir -p "$(dirname $LB)"
    python3 -c "import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], 'wb'))" .llamacpp/llama-bench.xz $LB
    chmod +x $LB
    echo "llama-bench: the one built earlier (.llamacpp/llama-bench.xz)" | tee -a "$OUT/llama.txt"
    true &
else
    python3 -c "import tarfile,sys; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" .llamacpp/llama.tar.xz $W
    (
        cd $W/llama.cpp
        cmake -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=OFF -DGGML_CUDA_FA=$FA \
            -DBUILD_SHARED_LIBS=OFF -DGGML_CUDA_NCCL=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
            -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DCMAKE_BUILD_TYPE=Release > "$OUT/llama_cmake.log" 2>&1 &&
            timeout $BUILD_S cmake --build build --target llama-bench -j${BUILD_JOBS:-16} > "$OUT/llama_build.log" 2>&1
    ) &
fi
BPID=$!
if [ "${BUILD_ONLY:-0}" = 1 ]; then
    wait $BPID || { echo "llama.cpp build failed or timed out after $(( $(date +%s) - t0 )) s"; tail -20 "$OUT/llama_build.log" "$OUT/llama_cmake.log"; exit 4; }
    echo "llama-bench (GGML_CUDA_FA=$FA, static) built in $(( $(date +%s) - t0 )) s" | tee -a "$OUT/llama.txt"
    strip $LB && xz -T0 -6 -c $LB > "$OUT/llama-bench.xz" && ls -la "$OUT/llama-bench.xz"
    exit 0
fi
M=/tmp/m.gguf
# The slipstream binary: .devbin's when carried, else .llamacpp/slipstream.xz.
if [ -x .devbin/slipstream ]; then cp .devbin/slipstream $W/slipstream; else
python3 -c "import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], 'wb'))" .llamacpp/slipstream.xz $W/slipstream && chmod +x $W/slipstream
fi
[ -f $M ] || $W/slipstream synth --preset qwen3.6-35b-a3b --format gguf --output $M > "$OUT/synth_gguf.log" 2>&1 \
    || { echo "gguf synth failed"; tail -5 "$OUT/synth_gguf.log"; }
ls -la $M | tee -a "$OUT/llama.txt"
wait $BPID || { echo "llama.cpp build failed or timed out after $(( $(date +%s) - t0 )) s"; tail -20 "$OUT/llama_build.log" "$OUT/llama_cmake.log"; exit 4; }
echo "llama-bench ready in $(( $(date +%s) - t0 )) s" | tee -a "$OUT/llama.txt"
fa=0; [ "$FA" = ON ] && fa=1
for nc in ${NCMOE:-0 35}; do
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 > "$OUT/llama_mem_$nc.csv" &
    SMI=$!
    $LB -m $M -ngl 99 --n-cpu-moe $nc -p ${PP:-512} -n 64 -r 2 -t 16 -fa $fa 2>&1 | tee -a "$OUT/llama.txt" | grep -v "^$"
    kill $SMI
    echo "n-cpu-moe $nc: peak VRAM used $(sort -n "$OUT/llama_mem_$nc.csv" | tail -1) MiB (whole GPU, nvidia-smi)" | tee -a "$OUT/llama.txt"
done
