"""Evaluation on held-out problem sets: the same code serves `train.py`'s `eval_every` and `eval.py`."""
