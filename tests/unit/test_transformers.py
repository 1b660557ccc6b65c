"""Hugging Face transformers as the first real client (issue 15): a bare ``@graphed`` on a
``LlamaForCausalLM`` single-token decode with a ``StaticCache``, no declaration, tiny random
config (nothing is downloaded)."""
from __future__ import annotations

import inspect
import warnings

import pytest
import torch

import graphctl

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM, StaticCache  # noqa: E402

B, VOCAB, PREFILL = 8, 128, 5


def _model():
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64)
    return cfg, LlamaForCausalLM(cfg).eval()


def _cache_kw() -> str:
    # transformers 5.24 renamed past_key_values to cache (the old name warns until 5.40): use what is taken
    params = inspect.signature(LlamaForCausalLM.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _prefilled(cfg, model):
    cache = StaticCache(config=cfg, max_cache_len=32)
    ids = torch.randint(0, VOCAB, (B, PREFILL), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model(ids, **{_cache_kw(): cache}, use_cache=True)
    return cache


def _same(a, b) -> bool:
    return all(torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values)
               and torch.equal(x.cumulative_length, y.cumulative_length) for x, y in zip(a.layers, b.layers))


def test_bare_graphed_static_cache_decode_equals_eager_step_after_step():
    # Issue 15: the graphed decode diverged from eager from the first step (capture_all's warmups and capture
    # advanced the StaticCache's cumulative_length and wrote K/V into it).
    cfg, model = _model()
    cache, ref = _prefilled(cfg, model), _prefilled(cfg, model)
    kw = _cache_kw()

    @graphctl.graphed(buckets=[8], inputs=["tok"], backend="emulated", progress=False)
    def step(tok):
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            return model(tok, **{kw: cache}, use_cache=True).logits

    gen = torch.Generator().manual_seed(2)
    step.capture_all(torch.randint(0, VOCAB, (B, 1), generator=gen))
    assert _same(cache, ref), "capture_all moved the caller's cache"
    paths = {e.path for e in step.side_effects}
    assert "cache.layers[0].cumulative_length" in paths and "cache.layers[1].keys" in paths, paths
    rep = step.report()  # issue 21, no false alarms: nothing but the side effects is reported for this step
    assert rep.host_changes == () and rep.padding_hazards == () and rep.unreached == () and not rep.bypassed, rep
    # every write of the replay (the cache's K/V and lengths) equals eager's, from the same restored cache; a
    # whole-batch cache cannot run eagerly on fewer rows, so n = the bucket only
    checked = step.verify(writes="error", inside=False)
    assert checked and all(r.ok and r.n == r.bucket for r in checked), [str(r) for r in checked]
    assert _same(cache, ref), "verify moved the caller's cache"
    for _ in range(4):
        tok = torch.randint(0, VOCAB, (B, 1), generator=gen)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            want = model(tok, **{kw: ref}, use_cache=True).logits
        got = step(tok).clone()
        assert torch.equal(got, want)
        assert _same(cache, ref)


def test_side_effects_error_names_the_cache_tensors_and_the_transformers_line():
    # Issue 15: nothing said which tensors of the model's state the forward wrote, or where.
    cfg, model = _model()
    cache = _prefilled(cfg, model)
    kw = _cache_kw()

    def step(tok):
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            return model(tok, **{kw: cache}, use_cache=True).logits

    f = graphctl.graphed(step, buckets=[8], inputs=["tok"], backend="emulated", progress=False,
                         side_effects="error")
    with pytest.raises(graphctl.CaptureError) as ei:
        f.capture_all(torch.randint(0, VOCAB, (B, 1)))
    msg = str(ei.value)
    assert "cache.layers[0].cumulative_length" in msg and "cache_utils.py:" in msg, msg


def test_a_compiled_model_decode_under_graphed_equals_eager():
    # Issue 15: a decode step of a torch.compile'd model under @graphed (on the CPU through aot_eager). Since issue 28
    # the compiled artifact itself runs (recorded as one call), so K/V match eager to rounding, not bitwise.
    cfg, model = _model()
    cache, ref = _prefilled(cfg, model), _prefilled(cfg, model)
    kw = _cache_kw()
    compiled = torch.compile(model, backend="aot_eager", dynamic=False)

    def step(tok):
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            return compiled(tok, **{kw: cache}, use_cache=True).logits

    f = graphctl.graphed(step, buckets=[8], inputs=["tok"], backend="emulated", progress=False)
    gen = torch.Generator().manual_seed(3)
    f.capture_all(torch.randint(0, VOCAB, (B, 1), generator=gen))
    assert _same(cache, ref)
    for _ in range(3):
        tok = torch.randint(0, VOCAB, (B, 1), generator=gen)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            want = model(tok, **{kw: ref}, use_cache=True).logits
        torch.testing.assert_close(f(tok).clone(), want, rtol=1e-5, atol=1e-5)
    for x, y in zip(cache.layers, ref.layers):
        assert torch.equal(x.cumulative_length, y.cumulative_length)
        torch.testing.assert_close(x.keys, y.keys, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(x.values, y.values, rtol=1e-5, atol=1e-6)
    assert f.report().compiled == ("compiled",) and f.report().uncompiled == 0


def _views(cfg, big, sizes):
    out = {}
    for n in sizes:
        c = StaticCache(config=cfg, max_cache_len=32)
        for mine, theirs in zip(c.layers, big.layers):
            mine.lazy_initialization(theirs.keys[:n], theirs.values[:n])
            mine.keys, mine.values = theirs.keys[:n], theirs.values[:n]
            mine.cumulative_length = theirs.cumulative_length
        out[n] = c
    return out


def test_one_max_batch_cache_sliced_to_buckets_equals_eager_on_the_live_rows():
    # Issue 15: a batch sliced to buckets from one max-batch cache (views per bucket) must leave the cache as
    # eager leaves it on the live rows, whichever bucket served the call.
    cfg, model = _model()
    big, ref = _prefilled(cfg, model), _prefilled(cfg, model)
    kw = _cache_kw()
    caches = _views(cfg, big, (2, 4, 8))

    @graphctl.graphed(buckets=[2, 4, 8], inputs=["tok"], backend="emulated", progress=False)
    def step(tok):
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            return model(tok, **{kw: caches[tok.shape[0]]}, use_cache=True).logits

    gen = torch.Generator().manual_seed(4)
    step.capture_all(torch.randint(0, VOCAB, (B, 1), generator=gen))
    assert _same(big, ref), "capture_all moved the caller's max-batch cache"
    for n in (3, 8, 1):  # inside bucket 4 (row 3 is padding), a full bucket, inside bucket 2
        tok = torch.randint(0, VOCAB, (n, 1), generator=gen)
        full = torch.cat([tok, torch.randint(0, VOCAB, (B - n, 1), generator=gen)])
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            want = model(full, **{kw: ref}, use_cache=True).logits[:n]
        got = step(tok).clone()
        assert got.shape[0] == n
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for mine, theirs in zip(big.layers, ref.layers):
            assert torch.equal(mine.cumulative_length, theirs.cumulative_length)
            torch.testing.assert_close(mine.keys[:n], theirs.keys[:n], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(mine.values[:n], theirs.values[:n], rtol=1e-5, atol=1e-5)
        for mine, theirs in zip(big.layers, ref.layers):  # rows past n: the reference's, so both go on alike
            theirs.keys[n:].copy_(mine.keys[n:])
            theirs.values[n:].copy_(mine.values[n:])


def test_a_cache_per_bucket_is_found_and_restored_for_every_bucket():
    # Issue 15: only the first bucket's warmup was tracked, so a cache that only another bucket reaches was
    # advanced by that bucket's warmups and capture, silently.
    cfg, model = _model()
    kw = _cache_kw()
    caches = {n: StaticCache(config=cfg, max_cache_len=32) for n in (4, 8)}
    for n, c in caches.items():
        ids = torch.randint(0, VOCAB, (n, PREFILL), generator=torch.Generator().manual_seed(n))
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            model(ids, **{kw: c}, use_cache=True)
    before = {n: [(layer.keys.clone(), layer.values.clone(), layer.cumulative_length.clone()) for layer in c.layers]
              for n, c in caches.items()}

    @graphctl.graphed(buckets=[4, 8], inputs=["tok"], backend="emulated", progress=False)
    def step(tok):
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            return model(tok, **{kw: caches[tok.shape[0]]}, use_cache=True).logits

    step.capture_all(torch.randint(0, VOCAB, (B, 1)))
    for n, c in caches.items():
        for layer, (k, v, L) in zip(c.layers, before[n]):
            assert torch.equal(layer.keys, k) and torch.equal(layer.values, v)
            assert torch.equal(layer.cumulative_length, L), f"bucket {n}'s cache was advanced"
    paths = {e.path for e in step.side_effects}
    assert "caches[4].layers[0].keys" in paths and "caches[8].layers[0].keys" in paths, paths
