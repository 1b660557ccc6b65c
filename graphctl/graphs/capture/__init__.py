"""How a capture is made: the record, the passes, the buckets, static inputs, eager regions, compiled code."""
