"""Running a model under a memory budget: the engine, generation, scheduling, the expert cache, prefetch, policies."""
