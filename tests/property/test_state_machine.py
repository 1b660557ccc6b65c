"""The shipped swap/restore state machine over random specs (profile: GRAPHCTL_HYPOTHESIS_PROFILE)."""
from graphctl.testing import SwitchMachine

TestRandomSpecs = SwitchMachine.TestCase
