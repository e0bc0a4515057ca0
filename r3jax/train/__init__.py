"""The training program's library: settings, the loop, checkpoints, logging, plots (`train.py` wires them)."""
