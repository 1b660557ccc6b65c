"""A bare @graphed Hugging Face StaticCache decode on real CUDA graphs, bf16 (issue 15)."""
from __future__ import annotations

import inspect
import warnings

import pytest
import torch

import graphctl

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM, StaticCache  # noqa: E402


def test_bare_graphed_static_cache_decode_equals_eager_on_cuda_bf16():
    # Issue 15: on CUDA too, the graphed decode diverged from eager from the first step (warmups and the capture
    # advanced the StaticCache).
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=2, vocab_size=512, max_position_embeddings=128)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    kw = "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"

    def call(tok, cache):
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            return model(tok, **{kw: cache}, use_cache=True).logits

    def prefilled():
        c = StaticCache(config=cfg, max_cache_len=64)
        call(torch.randint(0, 512, (8, 6), generator=torch.Generator().manual_seed(1)).cuda(), c)
        return c

    cache, ref = prefilled(), prefilled()
    step = graphctl.graphed(lambda tok: call(tok, cache), buckets=[8], inputs=["tok"], progress=False)
    gen = torch.Generator().manual_seed(2)
    step.capture_all(torch.randint(0, 512, (8, 1), generator=gen).cuda())
    assert step.backend_name == "auto" and step.report().backend == "cuda"
    for a, b in zip(cache.layers, ref.layers):
        assert torch.equal(a.cumulative_length, b.cumulative_length) and torch.equal(a.keys, b.keys)
    for _ in range(5):
        tok = torch.randint(0, 512, (8, 1), generator=gen).cuda()
        want = call(tok, ref).clone()
        got = step(tok).clone()
        assert torch.equal(got, want)
    for a, b in zip(cache.layers, ref.layers):
        assert torch.equal(a.cumulative_length, b.cumulative_length)
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
