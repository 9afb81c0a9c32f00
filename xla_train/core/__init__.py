"""The core: devices, strategies, launchers, the Engine, batching, inference and checkpoint IO.
It imports nothing of the job (tasks, run folders, options) or the commands."""
