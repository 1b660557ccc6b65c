"""Testing helpers users run on their own backends: hypothesis strategies for random specs,
a ``RuleBasedStateMachine`` over swap/restore invariants (and one with capture and replay
rules), a CPU allocation tracker, and ``hooks``: the bound state's fault and user-callable seams
for a with-block (``graphctl/state/seams.py``)."""
from graphctl.state.seams import hooks
from graphctl.testing.alloc import AllocationTracker
from graphctl.testing.graph_machine import GraphMachine
from graphctl.testing.machine import InjectedFault, InjectedInterrupt, SwitchMachine
from graphctl.testing.profiles import PROFILES
from graphctl.testing.profiles import load as load_profile
from graphctl.testing.profiles import register as register_profiles
from graphctl.testing.strategies import DTYPES, Case, cases, combine, random_tensor

__all__ = ["AllocationTracker", "Case", "DTYPES", "GraphMachine", "InjectedFault", "InjectedInterrupt", "PROFILES",
           "SwitchMachine", "cases", "combine", "hooks", "load_profile", "random_tensor", "register_profiles"]

register_profiles()  # graphctl-ci / -thorough / -dev, for runs outside pytest too
