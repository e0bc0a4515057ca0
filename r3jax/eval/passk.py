"""Pass@k, the unbiased estimator of Chen et al. (2021) that DeepScaleR and R³ report.

With n samples of a question of which c are correct, the chance that k samples drawn without replacement
contain a correct one is 1 - C(n - c, k) / C(n, k). Written as a product, 1 - prod_{i = n-c+1}^{n} (1 - k / i),
it needs no huge binomials and is exact at the edges: c = 0 gives 0, c = n gives 1, and for k = n it is 1 as
soon as one sample is correct.
"""

from __future__ import annotations

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one question with n samples, c correct (requires 1 <= k <= n, 0 <= c <= n)."""
    if not 1 <= k <= n:
        raise ValueError(f"pass@{k} needs 1 <= k <= n = {n} samples per question")
    if not 0 <= c <= n:
        raise ValueError(f"{c} correct samples out of n = {n}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def mean_pass_at_k(correct_counts, n: int, k: int) -> float:
    """Pass@k averaged over questions (each with n samples)."""
    counts = list(correct_counts)
    if not counts:
        raise ValueError("no questions to average pass@k over")
    return float(np.mean([pass_at_k(n, int(c), k) for c in counts]))
