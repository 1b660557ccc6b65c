"""Testing helpers users run on their own backends: hypothesis strategies for random specs,
a ``RuleBasedStateMachine`` over swap/restore invariants, and a CPU allocation tracker."""
from graphctl.testing.alloc import AllocationTracker
from graphctl.testing.machine import InjectedFault, InjectedInterrupt, SwitchMachine
from graphctl.testing.strategies import DTYPES, Case, cases, combine, random_tensor

__all__ = ["AllocationTracker", "Case", "DTYPES", "InjectedFault", "InjectedInterrupt", "SwitchMachine", "cases",
           "combine", "random_tensor"]
