"""A capture target module that raises while being imported (the CLI must exit 2 with a message)."""
raise ImportError.__base__("module-level code failed: missing config file")  # an Exception, not ImportError


def make(**_):  # pragma: no cover - never reached
    return None
