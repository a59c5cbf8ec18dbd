"""A model that computes its own loss, as many users' models do, for ``tests/test_in_model_loss.py``.

Module-level so that spawned gloo ranks can unpickle it; it imports nothing from fxpar (it stands for user code).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class MaskedBlock(nn.Module):
    """Pre-norm attention with a 2-D boolean mask the model builds (``[q, k]``, no batch dim), then an MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm = nn.RMSNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.ReLU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2)
                   for t in self.qkv(self.norm(x)).split(d, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.out(y.transpose(1, 2).reshape(b, s, d))
        return x + self.mlp(x)


class SelfLossLM(nn.Module):
    """``model(tokens, labels) -> loss``: token cross-entropy over the targets not ignored (-100), plus an
    activation penalty (a mean over every element) and an L2 penalty on ``temperature``, a parameter no token
    reaches: its gradient is the same on every rank, not a per-rank partial sum."""

    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(MaskedBlock(dim, heads) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)
        self.temperature = nn.Parameter(torch.ones(dim))

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        s = tokens.shape[1]
        mask = torch.ones(s, s, dtype=torch.bool, device=tokens.device).tril()
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, mask)
        logits = self.head(x)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        return loss + 1e-3 * x.pow(2).mean() + 1e-2 * (self.temperature - 1.5).pow(2).sum()


def self_loss_lm() -> SelfLossLM:
    return SelfLossLM()


def self_loss_batch(batch: int = 6, seq: int = 8, vocab: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and labels with ignored targets spread unevenly over the batch (rank pieces count differently)."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (batch, seq), generator=g)
    labels = torch.randint(0, vocab, (batch, seq), generator=g)
    labels[0, :6] = -100
    labels[1, 3:] = -100
    return tokens, labels


class RegressionLoss(nn.Module):
    """``model(x, y) -> loss``: an MLP's prediction against ``y`` under one of torch's fused mean losses, whose
    backward kernels divide by the count of the elements they are given."""

    def __init__(self, loss: str = "mse") -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 32), nn.Linear(32, 4)
        self.loss = loss

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        pred = self.down(F.gelu(self.up(x)))
        losses = {"mse": F.mse_loss, "smooth_l1": F.smooth_l1_loss, "huber": F.huber_loss,
                  "soft_margin": F.soft_margin_loss}
        return losses[self.loss](pred, y)


def regression_loss(loss: str = "mse") -> RegressionLoss:
    return RegressionLoss(loss)


def contrastive_loss(out: torch.Tensor, targets: Any = None) -> torch.Tensor:
    """CLIP's loss over one output holding both embeddings side by side: each row's ``a`` against every row's ``b``
    (``a @ b.T``), the matching row its class. It compares rows with each other: not a mean over rows."""
    a, b = out.chunk(2, dim=1)
    logits = a @ b.T
    return torch.nn.functional.cross_entropy(logits, torch.arange(len(out)))


def summed_square(out: torch.Tensor, targets: Any = None) -> torch.Tensor:
    """A loss summed over the batch (``reduction="sum"``): not a mean over rows."""
    return out.square().sum()


def mean_square(out: torch.Tensor, targets: Any = None) -> torch.Tensor:
    return out.square().mean()


class ContrastiveEncoder(nn.Module):
    """Two towers and CLIP's loss inside ``forward``: ``model(x) -> loss`` (each row's image embedding against every
    row's text embedding). The text tower ends without a bias: the loss's gradient for it is zero (each row of
    the softmax's gradient sums to zero), and Adam turns a zero gradient's rounding into whole steps."""

    def __init__(self, width: int = 10, embed: int = 8) -> None:
        super().__init__()
        self.image = nn.Sequential(nn.Linear(width, 16), nn.Tanh(), nn.Linear(16, embed))
        self.text = nn.Sequential(nn.Linear(width, 16), nn.Tanh(), nn.Linear(16, embed, bias=False))

    def forward(self, images: torch.Tensor, texts: torch.Tensor) -> torch.Tensor:
        logits = self.image(images) @ self.text(texts).T
        return F.cross_entropy(logits, torch.arange(len(images)))


def contrastive_encoder() -> ContrastiveEncoder:
    return ContrastiveEncoder()


def hf_clip() -> nn.Module:
    """HF ``CLIPModel`` (2 text and 2 vision layers, width 32, sdpa), its contrastive loss computed inside the model
    (``return_loss=True``): every attention's key projection has a bias, whose exact gradient is zero."""
    from transformers import CLIPConfig, CLIPModel

    torch.manual_seed(0)
    config = CLIPConfig(
        text_config={"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                     "num_attention_heads": 4, "max_position_embeddings": 16, "projection_dim": 16,
                     "eos_token_id": 2, "pad_token_id": 0, "bos_token_id": 1},
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                       "image_size": 16, "patch_size": 4, "projection_dim": 16},
        projection_dim=16)
    config._attn_implementation = "sdpa"
    return CLIPModel(config)


def clip_batch(seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(3, 128, (4, 8), generator=g),
            "pixel_values": torch.randn(4, 3, 16, 16, generator=g), "return_loss": True}


def model_loss(out: Any, targets: Any = None) -> torch.Tensor:
    """The loss a model computed itself (``out["loss"]``)."""
    return out["loss"]


class ValueHeadLM(nn.Module):
    """A language model with a second head the loss may leave out (a value head, as in RLHF): returns
    ``{"logits": [b, s, vocab], "value": [b, s]}``."""

    def __init__(self, vocab: int = 64, dim: int = 32, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim), nn.GELU())
                                    for _ in range(layers))
        self.head = nn.Linear(dim, vocab)
        self.value = nn.Linear(dim, 1)

    def forward(self, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        x = self.embed(tokens)
        for layer in self.layers:
            x = x + layer(x)
        return {"logits": self.head(x), "value": self.value(x).squeeze(-1)}


def value_head_lm() -> ValueHeadLM:
    return ValueHeadLM()


def logits_only_loss(out: dict[str, torch.Tensor], targets: torch.Tensor | None = None) -> torch.Tensor:
    """Next-token cross entropy on ``out["logits"]`` (or, without targets, their mean square): the value head's
    parameters get no gradient."""
    logits = out["logits"]
    if targets is None:
        return logits.square().mean()
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class SwitchingLoss:
    """``logits_only_loss``, plus the value head's mean once ``with_value`` is set (a loss that changes the outputs
    it reads between steps)."""

    with_value = False

    def __call__(self, out: dict[str, torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
        loss = logits_only_loss(out, targets)
        return loss + out["value"].mean() if self.with_value else loss


def switch_the_outputs_the_loss_reads() -> str:
    """Rank body: ``ValueHeadLM`` on dp=2 trained one step with the logits-only loss, then one reading the value
    head too; the error the second step raises (``"ran"`` if none)."""
    import torch.distributed as dist

    import fxpar

    torch.manual_seed(0)
    tokens = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(0))
    loss = SwitchingLoss()
    pm = fxpar.parallelize(value_head_lm(), fxpar.Mesh({"dp": 2}), (tokens,), loss_fn=loss, example_targets=tokens)
    local = tokens.chunk(2)[dist.get_rank()]
    pm.step(local, local)
    loss.with_value = True
    try:
        pm.step(local, local)
    except RuntimeError as e:
        return str(e)
    return "ran"
