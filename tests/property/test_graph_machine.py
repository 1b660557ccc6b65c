"""The state machine with capture and replay rules, on the emulated backend (CPU)."""
from hypothesis import settings

from graphctl.testing import GraphMachine

TestGraphMachine = GraphMachine.TestCase
# Captures cost more than switches: a quarter of the profile's examples (50 in CI).
TestGraphMachine.settings = settings(settings(), max_examples=max(5, settings().max_examples // 4))
