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
grep -E 'test result|FAIL|PASS|panicked|seeded draw' $OUT/devtest.log | head -30
grep -E "demo|GGUF|tokens identical" $OUT/model.log | cut -c1-200
wait
nvidia-smi --query-gpu=name,clocks.sm --format=csv,noheader
echo "elapsed $SECONDS s"
for round in 1; do
  for v in old cur; do
    b=.devbin/slipstream; [ $v = old ] && b=.devbin/old
    for s in "greedy:" "t07p95:--temperature 0.7 --top-p 0.95 --seed 3" "t07k20p95:--temperature 0.7 --top-k 20 --top-p 0.95 --seed 3" "t10:--temperature 1.0 --seed 3"; do
      r=$($b run --model $M --prompt-tokens 1,2,3,4 --max-new 256 --print-ids --backend cuda --resident ${s#*:} 2>&1 | grep -o 'decode [0-9.]* tok/s')
      echo "$(date +%T) $round $v ${s%%:*} $r"
    done
  done
done
echo "elapsed $SECONDS s"
