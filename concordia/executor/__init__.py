"""The persistent executor: a resident kernel (or a CPU thread) fed by a lock-free task ring."""
