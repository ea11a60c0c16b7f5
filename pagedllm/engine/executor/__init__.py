"""Executors: how the engine reaches its model's workers, in process (UniProcExecutor) or as
tensor-parallel ranks in spawned processes (MultiprocExecutor); `factory.create_executor` picks one."""
