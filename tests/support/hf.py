"""Helpers of the Hugging Face integration tests (tests/unit/test_hf_paged.py, tests/cuda)."""
from __future__ import annotations

import torch

from graphctl.integrations.hf import HFEngine
from graphctl.integrations.hf.configs import hf_config


def prompts(n: int, gen: torch.Generator, vocab: int = 128) -> list[torch.Tensor]:
    """``n`` random prompts of ragged lengths 2..13."""
    lens = torch.randint(2, 14, (n,), generator=gen)
    return [torch.randint(0, vocab, (int(L),), generator=gen) for L in lens]


def engine(name: str, k: int, seed: int, *, device: str = "cpu", dtype: torch.dtype = torch.float32,
           **kw) -> HFEngine:
    return HFEngine.build(hf_config(name), draft_len=k, max_seqs=8, max_context=64, block_size=8, seed=seed,
                          device=device, dtype=dtype, **kw)


def reference_model(eng: HFEngine, name: str):
    """A copy of the target with transformers' stock attention: what a user runs today."""
    import transformers

    ref = transformers.AutoModelForCausalLM.from_config(hf_config(name), attn_implementation="eager",
                                                        dtype=eng.target_layers.dtype)
    ref.load_state_dict(eng.target_layers.state_dict())
    # random prompts may contain the config's EOS id and the pad id: generate must neither stop at EOS (the
    # engine runs to max_new_tokens unless told) nor mask prompt tokens equal to the pad id
    ref.generation_config.eos_token_id = None
    return ref.to(eng.device).eval()


def reference(eng: HFEngine, name: str, ps, new: int) -> list[list[int]]:
    """transformers' eager greedy ``generate``, one request at a time (no padding)."""
    ref = reference_model(eng, name)
    out = []
    for p in ps:
        with torch.no_grad():
            ids = p[None].to(eng.device)
            g = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                             pad_token_id=0)
        out.append(g[0, len(p):].tolist())
    return out


def seed_of(gen: torch.Generator) -> int:
    return int(torch.randint(0, 2**31 - 1, (1,), generator=gen))


def assert_oracle(name: str, k: int, mode: str, gen: torch.Generator, *, backend: str, device: str = "cpu") -> None:
    """The acceptance oracle: the target's own first layers as the draft accept k+1 tokens every step after the
    first, at batch sizes 1, 3 and 8 (one set of graphs, buckets 1/4/8, serves all three)."""
    from graphctl.models import graphed_step

    eng = engine(name, k, seed_of(gen), device=device)
    step = graphed_step(eng, mode, buckets=(1, 4, 8), backend=backend)
    for bs in (1, 3, 8):
        got = eng.generate(prompts(bs, gen), 2 * (k + 1) + 1, forward=step)
        for i, a in enumerate(got.accepted[1:], 1):
            assert torch.equal(a, torch.full_like(a, k + 1)), (bs, i, a.tolist())


def prefill_and_caches(eng: HFEngine, ps, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, list]:
    """One eager prefill of ``ps`` into freshly randomised caches (each run must write every slot
    read back): the first tokens, the first pass's logits at the requests' rows, and each cache's
    K/V (all layers, stacked) at the slots its model wrote: the target's, then the draft's, which
    writes its own pages (the slots its switch lays out)."""
    mgrs = (eng.meta.kv_cache_manager, eng.meta.draft_kv_cache_manager)
    for m in mgrs:
        for t in (*m.k, *m.v):
            t.normal_(generator=gen if t.device.type == "cpu" else None)
    logits: list[torch.Tensor] = []

    def step(tokens, meta):
        logits.append(eng.prefill_step(tokens, meta).clone())
        return logits[-1]

    first = eng.prefill(ps, forward=step)
    n = sum(len(p) for p in ps)
    live = [eng.meta.slot_mapping[:n].long().clone()]
    with eng.state.switch("draft"):
        live.append(eng.meta.slot_mapping[:n].long().clone())
    kv = [torch.stack([t.view(-1, t.shape[-1])[s] for t in (*m.k, *m.v)]) for m, s in zip(mgrs, live)]
    return first.clone(), logits[0][:len(ps)], kv
