"""Declarations for attention-metadata families (paged, TensorRT-LLM-style, DSA, DeepSeek-V4).

Arrives with issue 5. Nothing is exported yet."""
__all__: list[str] = []
