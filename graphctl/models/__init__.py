"""Reference models: the one-model MTP engine that graphctl is proven on (and the CLI's
built-in default). Imports ``families`` and ``state``; ``graphs`` wraps its step."""
from graphctl.models.loops import (
                                   MODES,
                                   DynamicDraft,
                                   PerStepLoop,
                                   draft_confidences,
                                   dynamic_of,
                                   expected_dynamic,
                                   graphed_step,
)
from graphctl.models.mtp import EngineConfig, MTPEngine, StepOutput
from graphctl.models.sampled import RequestSettings, Sampling

__all__ = [
    "EngineConfig",
    "MTPEngine",
    "StepOutput",
    "Sampling",
    "RequestSettings",
    "MODES",
    "graphed_step",
    "dynamic_of",
    "DynamicDraft",
    "PerStepLoop",
    "draft_confidences",
    "expected_dynamic",
]
