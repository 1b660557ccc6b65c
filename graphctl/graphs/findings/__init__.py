"""What a capture learns of a forward: the op stream and its watchers, one record type per finding kind."""
