#!/usr/bin/env bash
# cpc rule: fc (gate/up + down clustered) targeted GPU tests, A/B main -> fc, main -> gc, sanitizers on fc's cluster shapes.
set -u
cd "$(dirname "$0")/../.."
ROOT=$PWD
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,power.draw,power.limit --format=csv > $OUT/gpu.txt 2>&1
for t in $ROOT $ROOT/scratch/fc $ROOT/scratch/dcd; do
  if ! (cd /tmp && PYTHONPATH=$t python3 -c "import prime_kernels; m=prime_kernels.load('flash_moe'); print('$t', 'loads')") >> $OUT/env.txt 2>&1; then
    echo "building $t" >> $OUT/env.txt
    (cd $t && PRIME_KERNELS_REQUIRE=1 MAX_JOBS=16 python3 setup.py build_ext --inplace > $OUT/build-$(basename $t).log 2>&1)
  fi
done
cd $ROOT/scratch/fc
timeout 120 env PYTHONPATH=$PWD python3 -m pytest -m gpu -q -p no:cacheprovider --durations=8 tests/test_fused_moe_bf16.py tests/test_moe_training.py tests/test_fused_moe_mxfp8.py tests/test_bad_arguments.py -k "large_tile or graph_capture or against_reference or num_sms or print_config or bitwise or garbage or cpc" > $OUT/test-fc.log 2>&1; echo "test-fc rc=$?" >> $OUT/env.txt
cd $ROOT
timeout 75 python3 benchmarks/ab.py --a $ROOT --b $ROOT/scratch/fc --configs qwen3,mixtral --tokens 32768 --splits true --json $OUT/ab-fc.json > $OUT/ab-fc.log 2>&1; echo "ab-fc rc=$?" >> $OUT/env.txt
cd $ROOT/scratch/dcd
timeout 60 env PYTHONPATH=$PWD python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_fused_moe_bf16.py -k "combine_in_down or small_shapes or garbage or print_config or dropped" > $OUT/test-dcd.log 2>&1; echo "test-dcd rc=$?" >> $OUT/env.txt
cd $ROOT
timeout 60 python3 benchmarks/ab.py --a $ROOT --b $ROOT/scratch/dcd --configs orig,qwen3 --tokens 64 --splits true --json $OUT/ab-dcd.json > $OUT/ab-dcd.log 2>&1; echo "ab-dcd rc=$?" >> $OUT/env.txt
cd $ROOT/scratch/fc
for tool in memcheck; do
  timeout 60 env PYTHONPATH=$PWD compute-sanitizer --tool $tool --error-exitcode 1 --target-processes all python3 -m pytest -m "gpu and sanitize" -q -p no:cacheprovider tests/test_fused_moe_bf16.py -k "large_tile and clusters" > $OUT/san-$tool.log 2>&1; echo "san-$tool rc=$?" >> $OUT/env.txt
done
tail -8 $OUT/ab-fc.log
tail -8 $OUT/ab-gc.log
tail -6 $OUT/ab-dcd.log
tail -12 $OUT/test-fc.log
tail -4 $OUT/test-dcd.log
cat $OUT/env.txt $OUT/gpu.txt
