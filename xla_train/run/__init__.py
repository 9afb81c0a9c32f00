"""A run's life in its output folder: where the run stands and its checkpoints (state.py,
checkpoint.py), the folder's one run and its record (folder.py), and what a finished run leaves
(outputs.py)."""
