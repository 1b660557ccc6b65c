"""Testing helpers users run on their own backends: hypothesis strategies for random specs,
a ``RuleBasedStateMachine`` over swap/restore invariants (and one with capture and replay
rules), and a CPU allocation tracker."""
from graphctl.testing.alloc import AllocationTracker
from graphctl.testing.graph_machine import GraphMachine
from graphctl.testing.machine import InjectedFault, InjectedInterrupt, SwitchMachine
from graphctl.testing.strategies import DTYPES, Case, cases, combine, random_tensor

__all__ = ["AllocationTracker", "Case", "DTYPES", "GraphMachine", "InjectedFault", "InjectedInterrupt", "SwitchMachine", "cases",
           "combine", "random_tensor"]
