"""Small seeded example batches the rank-probe tests share: images with class labels, and token ids."""

from __future__ import annotations

import torch

RTOL = 1e-5  # fp32 relative gaps the probes' checks allow (the equivalence harness's step-0 tolerance)
IMAGES = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(0))  # TinyResNet's input
LABELS = torch.randint(0, 10, (4,), generator=torch.Generator().manual_seed(1))
TOKENS = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(2))  # vocab 64 models' input
