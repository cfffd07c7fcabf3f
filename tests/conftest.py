"""Suite-wide settings."""

from __future__ import annotations

import importlib.util

# The models under test are tiny: per-op overhead dominates, and on a 2-core machine several torch
# threads per test only oversubscribe the cores. One thread is faster and steadier.
if importlib.util.find_spec("torch") is not None:
    import torch

    torch.set_num_threads(1)
