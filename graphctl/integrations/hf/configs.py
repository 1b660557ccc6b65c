"""Named transformers configs for random-weight runs (``graphctl capture --hf-config NAME``, the
tests and ``bench/hf_speculative.py``): nothing can be downloaded, so a config is all a model is.

``tiny-*``: CPU-test sizes (a few layers of width 64) with ``initializer_range`` 0.2, so greedy
choices have margins far above fp32 rounding; ``llama-1b``: the benchmark's ~1B Llama (hidden
2048, 16 layers, 32 heads, 8 KV heads). A path to a JSON file is read as a config dict with its
``model_type`` (``AutoConfig.for_model``).
"""
from __future__ import annotations

import json
import os
from typing import Any

__all__ = ["NAMES", "hf_config"]

_TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2, tie_word_embeddings=False)

_NAMED: dict[str, tuple[str, dict[str, Any]]] = {
    "tiny-llama": ("llama", _TINY),
    "tiny-qwen2": ("qwen2", {**_TINY, "use_sliding_window": False}),
    "tiny-qwen3": ("qwen3", {**_TINY, "head_dim": 16, "use_sliding_window": False}),
    "llama-1b": ("llama", dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                               num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096,
                               tie_word_embeddings=False)),
}
NAMES = tuple(_NAMED)


def hf_config(name: str) -> Any:
    """The config called ``name`` (see :data:`NAMES`), or read from a JSON file path."""
    from transformers import AutoConfig

    if name in _NAMED:
        kind, kw = _NAMED[name]
        return AutoConfig.for_model(kind, **kw)
    if os.path.isfile(name):
        with open(name) as f:
            d = json.load(f)
        if "model_type" not in d:
            raise ValueError(f"{name}: a config JSON needs its model_type (e.g. \"llama\")")
        return AutoConfig.for_model(d.pop("model_type"), **d)
    raise ValueError(f"unknown --hf-config {name!r}: one of {', '.join(NAMES)}, or a path to a config JSON")
