"""Tensor-parallel capture on two GPUs over NCCL, CUDA graphs with the collectives recorded
inside them: the same scenarios as tests/distributed (gloo). Runs where two GPUs are lent
(nvidia-h200-x2 / nvidia-h100-x2); skipped elsewhere."""
from __future__ import annotations

import os

import pytest
import torch

from support.distributed import run_all

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")]


@pytest.fixture(scope="module")
def ranks():
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off, as the device notes require
    return run_all(world=2, dist_backend="nccl", graph_backend="cuda")


@pytest.mark.parametrize("name", ["bucket_agreement", "fallback_agreement", "refresh_fails_on_one_rank", "tp_engine"])
def test_scenario_on_two_gpus(ranks, name):
    for r, res in enumerate(ranks):
        assert "error" not in res[name], (r, res[name])
    res = [x[name] for x in ranks]
    if name == "bucket_agreement":
        assert all(x["equal"] and x["replays"][8] == 1 for x in res), res
    elif name == "fallback_agreement":
        assert all(x["equal"] and x["replays"] == 0 for x in res), res
    elif name == "refresh_fails_on_one_rank":
        assert all(x["restored"] and x["replayed_while_failing"] == 0 and x["recovered"] for x in res), res
    else:
        assert all(x["same_as_solo"] and not x["audit_errors"] and x["per_step"] for x in res), res
