"""Watching a run without changing what it computes: TensorBoard scalars and the compilation log
(monitor.py), trackers (trackers.py), profiles (profile.py) and the report (report.py)."""
