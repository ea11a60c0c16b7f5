"""The worker side of a step: the model runner and one process's worker."""
