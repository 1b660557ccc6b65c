"""Capture and replay (buckets, static inputs, ``@graphed``, draft loops, inspection).

Built on ``graphctl.state``; arrives with issue 4. Nothing is exported yet."""
__all__: list[str] = []
