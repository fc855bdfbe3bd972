#!/usr/bin/env bash
# llama.cpp's llama-bench on the GPU machine, for comparison with
# `scripts/cuda_bench.sh` (same synthetic 35B model, written as GGUF).
#
#   here:   pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36
#           tar the sdist's vendor/llama.cpp (models/docs/tests and other
#           backends removed) into .llamacpp/llama.tar.xz (git-ignored)
#           with the slipstream binary as .llamacpp/slipstream.xz (xz of
#           .devbin/slipstream; the carried tree has a size limit), or
#           carry .devbin instead of that file
#   device: run(command="bash scripts/cuda_llama_bench.sh", carry=[".llamacpp"])
#
# Builds llama-bench only (CUDA, sm_90, no FlashAttention kernels to cut the
# build time), generates /tmp/m.gguf with `slipstream synth --format gguf`,
# then runs prefill and decode (-p 512 -n 64) fully offloaded and with the routed experts
# of all but a few layers on the CPU (--n-cpu-moe), sampling VRAM use.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/cuda_out}
mkdir -p "$OUT"
BUILD_S=${BUILD_S:-420}
command -v nvcc >/dev/null || for d in /usr/local/cuda/bin /usr/local/cuda-*/bin; do [ -x "$d/nvcc" ] && export PATH="$d:$PATH"; done
command -v nvcc >/dev/null || { echo "no nvcc on this machine: llama.cpp not built" | tee "$OUT/llama.txt"; exit 3; }
nvcc --version | tail -2 | tee "$OUT/llama.txt"
W=/tmp/llama && mkdir -p $W && python3 -c "import tarfile,sys; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" .llamacpp/llama.tar.xz $W
t0=$(date +%s)
(
    cd $W/llama.cpp
    cmake -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=OFF -DGGML_CUDA_FA=OFF \
        -DGGML_CUDA_NCCL=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_SERVER=OFF -DCMAKE_BUILD_TYPE=Release > "$OUT/llama_cmake.log" 2>&1 &&
        timeout $BUILD_S cmake --build build --target llama-bench -j16 > "$OUT/llama_build.log" 2>&1
) &
BPID=$!
M=/tmp/m.gguf
# The slipstream binary: .devbin's when carried, else .llamacpp/slipstream.xz.
if [ -x .devbin/slipstream ]; then cp .devbin/slipstream $W/slipstream; else
python3 -c "import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], 'wb'))" .llamacpp/slipstream.xz $W/slipstream && chmod +x $W/slipstream
fi
[ -f $M ] || $W/slipstream synth --preset qwen3.6-35b-a3b --format gguf --output $M > "$OUT/synth_gguf.log" 2>&1 \
    || { echo "gguf synth failed"; tail -5 "$OUT/synth_gguf.log"; }
ls -la $M | tee -a "$OUT/llama.txt"
wait $BPID || { echo "llama.cpp build failed or timed out after $(( $(date +%s) - t0 )) s"; tail -20 "$OUT/llama_build.log" "$OUT/llama_cmake.log"; exit 4; }
echo "llama-bench built in $(( $(date +%s) - t0 )) s" | tee -a "$OUT/llama.txt"
LB=$W/llama.cpp/build/bin/llama-bench
for nc in ${NCMOE:-0 35}; do
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 > "$OUT/llama_mem_$nc.csv" &
    SMI=$!
    $LB -m $M -ngl 99 --n-cpu-moe $nc -p ${PP:-512} -n 64 -r 2 -t 16 2>&1 | tee -a "$OUT/llama.txt" | grep -v "^$"
    kill $SMI
    echo "n-cpu-moe $nc: peak VRAM used $(sort -n "$OUT/llama_mem_$nc.csv" | tail -1) MiB (whole GPU, nvidia-smi)" | tee -a "$OUT/llama.txt"
done
