"""graphctl: declared graph-static buffers and transactional draft switches for CUDA-graph
capture and replay of speculative-decoding draft forwards.

The public surface is exactly ``__all__``; everything else is internal."""
from graphctl import knobs, ops
from graphctl.errors import (
                             BindError,
                             CaptureError,
                             ConcurrentUseError,
                             CorruptedStateError,
                             DeclarationError,
                             GraphctlError,
                             NestedSwitchError,
                             OutputsHeldWarning,
                             ReplayError,
                             RepointError,
                             SamplingError,
                             StaleBufferError,
                             SwitchError,
)
from graphctl.graphs import CaptureTarget, GraphRunner, Key, Report, StaticInput, VariantRunner, eager, graphed
from graphctl.state import (
                             BoundState,
                             CopyInPlace,
                             OpCall,
                             Pad,
                             Persistent,
                             Recompute,
                             Registry,
                             Stable,
                             StateSpec,
                             Swap,
                             bind,
                             register,
)

__version__ = "0.1.0"

__all__ = [
    "StateSpec", "register", "bind", "BoundState", "Registry",
    "Swap", "CopyInPlace", "Recompute", "OpCall", "Stable", "Persistent", "Pad",
    "GraphctlError", "DeclarationError", "BindError", "SwitchError", "NestedSwitchError", "ConcurrentUseError",
    "CorruptedStateError", "StaleBufferError", "CaptureError", "ReplayError",
    "RepointError", "SamplingError", "OutputsHeldWarning",
    "graphed", "GraphRunner", "VariantRunner", "StaticInput", "Report", "Key",
    "CaptureTarget", "eager",
    "knobs", "ops", "__version__",
]
