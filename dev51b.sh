#!/usr/bin/env bash
# session 50 call 2 (warm): the whole CUDA suite but the 2-GPU test, for what issue 51 touched everywhere
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
t0=$(date +%s); el(){ echo "[t=$(( $(date +%s) - t0 ))s] $*"; }
timeout 470 bash scripts/device-check --quick -q -rs -m cuda tests --ignore=tests/cuda/test_tp_nccl.py --ignore=tests/engine > $OUT/01_tests.txt 2>&1; el "tests rc=$?"
grep -E "^(FAILED|ERROR)|passed|failed|build:" $OUT/01_tests.txt | tail -20; grep -E "^E " $OUT/tests.log | head -30; grep -c "CUDA Graph is empty" $OUT/tests.log
