"""What a call checks and does around a replay: paths, held outputs, re-pointing, ranks, timings."""
