set -u
export PYTHONPATH=$PWD
bash scripts/device-check --quick -m cuda tests/unit/test_repoint.py tests/regressions/test_field_bugs.py tests/cuda/test_graphs_cuda.py 2>&1 | tail -25
python3 bench/repoint.py --json $OUT/repoint.json 2>&1 | tail -5
