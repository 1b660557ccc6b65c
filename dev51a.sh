#!/usr/bin/env bash
# session 50 call 1: issue 51 on the GPU: build, CUDA tests of regions/pieces/compiled, region host cost, compiled piecewise prefill
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
t0=$(date +%s); el(){ echo "[t=$(( $(date +%s) - t0 ))s] $*"; }; left(){ echo $(( 550 - ($(date +%s) - t0) )); }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; git log --oneline -1
timeout 300 bash scripts/device-check --quick -q -rs -m cuda tests/unit/test_pieces.py tests/regressions/test_regions.py tests/regressions/test_replay_faults.py tests/unit/test_compiled.py tests/cuda/test_compiled_cuda.py tests/unit/test_hf_paged.py -k "not seeded and not tp" > $OUT/01_tests.txt 2>&1; el "build+tests rc=$?"
grep -E "^(FAILED|ERROR)|passed|failed|build:" $OUT/01_tests.txt | tail -14; grep -E "^E " $OUT/tests.log | head -24
timeout 45 python bench/pieces.py --json $OUT/pieces.json > $OUT/02_pieces.txt 2>&1; el "pieces rc=$?"; tail -2 $OUT/02_pieces.txt
timeout $(( $(left) - 5 )) python bench/prefill_pieces.py --repeats 5 --calls 3 --json $OUT/prefill_pieces.json > $OUT/03_prefill.txt 2>&1; el "prefill_pieces rc=$?"; tail -4 $OUT/03_prefill.txt | cut -c1-1500
el done
