set -u
mkdir -p .devbin
for p in cur:slipstream old:old kt:kernels_test cb:cuda_bench; do
  python3 -c 'import lzma,sys,shutil; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2],"wb"))' .devcall/${p%%:*}.xz .devbin/${p##*:}
done
chmod +x .devbin/*
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do [ -d "$d" ] && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"; done
M=/tmp/m.slip
(.devbin/slipstream synth --preset qwen3.6-35b-a3b --output $M > $OUT/synth.log 2>&1; echo synth-done) &
echo "== device test $(date +%T)"
bash scripts/cuda_device_test.sh run > $OUT/devtest.log 2>&1; echo "device test rc=$?"
grep -E 'test result|FAIL|PASS|panicked|delta rule' $OUT/devtest.log | head -30
wait
nvidia-smi --query-gpu=name,clocks.sm --format=csv,noheader
P512=$(python3 -c "print(','.join(str(1 + (i * 7919) % 240000) for i in range(512)))")
for round in 1 2; do
  for v in old cur cur-rows; do
    b=.devbin/slipstream; [ $v = old ] && b=.devbin/old; env=""; [ $v = cur-rows ] && env="SLIPSTREAM_CUDA_GDN=rows"
    r=$(env $env $b run --model $M --prompt-tokens 1,2,3,4 --max-new 256 --print-ids --backend cuda --resident 2>&1 | grep -o 'decode [0-9.]* tok/s')
    echo "$(date +%T) $round $v greedy $r"
    r=$(env $env $b run --model $M --prompt-tokens "$P512" --max-new 16 --print-ids --backend cuda --resident 2>&1 | grep -o 'prefill [0-9.]* tok/s')
    echo "$(date +%T) $round $v p512 $r"
  done
  for v in old cur; do
    b=.devbin/slipstream; [ $v = old ] && b=.devbin/old
    r=$($b run --model $M --prompt-tokens 1,2,3,4 --max-new 256 --print-ids --backend cuda --resident --temperature 0.7 --top-p 0.95 2>&1 | grep -o 'decode [0-9.]* tok/s')
    echo "$(date +%T) $round $v t0.7/p0.95 $r"
  done
done
echo "elapsed $SECONDS s"
if [ $SECONDS -lt 400 ]; then OUT=$OUT STEPS=4 timeout $((560 - SECONDS)) bash scripts/cuda_decode_profile.sh 2>&1 | tail -40; fi
