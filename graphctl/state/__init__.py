"""The state layer: declarations, their compiled plan, and transactional switches.

Pure Python over torch and graphctl ops; it knows nothing of graphs."""
from graphctl.state.bound import ROLES, BoundState, bind
from graphctl.state.plan import PHASES, PhasePlan, Plan, compile_spec
from graphctl.state.registry import Registry, default_registry, register
from graphctl.state.spec import (
           AXES,
           BufferDecl,
           CopyInPlace,
           ObjectDecl,
           OpCall,
           Pad,
           Persistent,
           Recompute,
           Stable,
           StateSpec,
           Swap,
)

__all__ = ["AXES", "PHASES", "ROLES", "BoundState", "BufferDecl", "CopyInPlace", "ObjectDecl", "Pad", "PhasePlan",
           "Plan", "Recompute", "OpCall", "Persistent", "Registry", "Stable", "StateSpec", "Swap", "bind",
           "compile_spec", "default_registry", "register"]
