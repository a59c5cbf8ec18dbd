"""Models and rank functions for ``tests/test_errors.py``: bad inputs fxpar must refuse or survive.

Everything here is module-level so that spawned gloo ranks (``run_ranks``) can unpickle it, and the
models import nothing from fxpar except inside the rank functions: they stand for user code.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

MLP_PLAN = {"up": "colwise", "down": "rowwise"}


class DataDependentBranch(nn.Module):
    """Python ``if`` on a tensor value: cannot be traced into one graph."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if h.sum() > 0:  # BRANCH: the data-dependent line the CaptureError must name
            return h.relu()
        return -h


def data_dependent_branch(**kwargs: int) -> DataDependentBranch:
    return DataDependentBranch(**kwargs)


class ValueRead(nn.Module):
    """Reads a tensor's value as a Python number (``.item()``) or takes a data-dependent shape (``nonzero``)."""

    def __init__(self, op: str = "item", dim: int = 8) -> None:
        super().__init__()
        self.op, self.lin = op, nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if self.op == "item":
            return h / h.abs().max().item()  # ITEM
        return h[torch.nonzero(h > 0, as_tuple=True)]  # NONZERO


class BatchNormConv(nn.Module):
    """A conv net with BatchNorm in training mode: its forward writes the running statistics (buffers) in place."""

    def __init__(self, track_running_stats: bool = True) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = nn.BatchNorm2d(8, track_running_stats=track_running_stats)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.norm(self.conv(x)))  # WRITES: the line the CaptureError must name
        return self.head(h.mean((2, 3)))


def batch_norm_conv(**kwargs: bool) -> BatchNormConv:
    return BatchNormConv(**kwargs)


class WritesItsInput(nn.Module):
    """A forward that scales its input tensor in place: the caller's tensor changes."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2.0)  # WRITES INPUT: the line the CaptureError must name
        return self.lin(x)


class NoRuleMLP(nn.Module):
    """``down(hardswish(h) * bucket(h))`` with ``h = up(x)`` sharded over tp: two elementwise ops DTensor
    cannot shard, so fxpar runs them replicated (gathering their inputs) and must stay exact.

    * ``aten.searchsorted.Tensor`` (forward): no strategy, no rule and no decomposition in DTensor.
    * ``aten.hardswish_backward.default`` (backward only: ``hardswish`` itself has a strategy): DTensor has a
      decomposition, but propagating through it fails (it builds ``scalar_tensor`` factories).
    """

    def __init__(self, dim: int = 32, hidden: int = 64, out: int = 16) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, out)
        self.register_buffer("boundaries", torch.tensor([-0.5, 0.0, 0.5]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        bucket = torch.searchsorted(self.boundaries, h.detach().contiguous()).to(h.dtype)  # 0..3 per element
        return self.down(F.hardswish(h) * (1 + bucket))


def no_rule_mlp(**kwargs: int) -> NoRuleMLP:
    return NoRuleMLP(**kwargs)


def mesh_size_mismatch(axes: dict[str, int]) -> str:
    """Rank body: parallelize on a mesh whose size differs from the world size; return the error text."""
    import fxpar
    from fxpar.models.mlp import mlp

    try:
        fxpar.parallelize(mlp(), fxpar.Mesh(axes), (torch.randn(8, 32),), plan=MLP_PLAN)
    except ValueError as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


class RankDependent(nn.Module):
    """Centers its output over the batch on rank 1 only (code that branches on the process): rank 1's program
    all-reduces over dp in the forward, rank 0's does not."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return h - h.mean(0, keepdim=True) if dist.get_rank() == 1 else h


class OwnCollective(nn.Module):
    """Sums its hidden state over the ranks itself (``dist.all_reduce``), as code written for DDP-style scripts may."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if dist.is_initialized():
            dist.all_reduce(h)
        return h


def compile_error_on_dp(build: type[nn.Module]) -> str:
    """Rank body: parallelize ``build()`` (taking ``[8, 16]`` inputs) on dp over every rank; the error text."""
    import fxpar

    try:
        fxpar.parallelize(build(), fxpar.Mesh({"dp": dist.get_world_size()}), (torch.randn(8, 16),))
    except Exception as e:  # noqa: BLE001 - the test reads the type and message
        return f"{type(e).__name__}: {e}"
    return "no error"


def die_before_first_forward(dying_rank: int) -> str:
    """Rank body: compile the MLP on tp=2; ``dying_rank`` exits hard just before the first forward while
    the others run a training step, whose collectives then have no peer."""
    import fxpar
    from fxpar.models.mlp import mlp

    torch.manual_seed(0)
    pm = fxpar.parallelize(mlp(), fxpar.Mesh({"tp": dist.get_world_size()}), (torch.randn(8, 32),), plan=MLP_PLAN)
    if dist.get_rank() == dying_rank:
        os._exit(1)
    loss = pm(torch.randn(8, 32)).pow(2).mean()
    loss.backward()
    return "step completed"


def per_token_losses(out: object, tokens: torch.Tensor) -> torch.Tensor:
    """A common mistake: ``next_token_loss`` with ``reduction="none"`` (a loss per position, not a scalar)."""
    logits = getattr(out, "logits", out)
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1), reduction="none")


def step_with_a_non_scalar_loss() -> str:
    """Rank body: a pp=2 pipeline of the bundled Llama whose ``loss_fn`` returns a loss per token: ``pm.step``
    must refuse it by name (the backward of a non-scalar needs a gradient nobody gave)."""
    import fxpar
    from fxpar.models.llama import llama

    torch.manual_seed(0)
    tokens = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))
    pm = fxpar.parallelize(llama(n_layers=2), fxpar.Mesh({"pp": 2}), (tokens,),
                           plan=fxpar.Plan(stages=2, microbatches=2), loss_fn=per_token_losses, example_targets=tokens)
    pm.step(tokens, tokens)
    return "step completed"


def call_with_the_global_batch(how: str) -> str:
    """Rank body: the bundled Llama compiled on dp=2 for a global batch of 4, then called (``how``: ``"step"`` or
    ``"call"``) with the whole batch instead of this rank's two rows, or (``"float"``) with its own rows as floats:
    refused by name before any graph runs."""
    import fxpar
    from fxpar.models.llama import llama

    torch.manual_seed(0)
    tokens = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))
    pm = fxpar.parallelize(llama(n_layers=2), fxpar.Mesh({"dp": 2}), (tokens,), loss_fn=next_token_loss,
                           example_targets=tokens)
    if how == "step":
        pm.step(tokens, tokens)
    elif how == "float":
        pm(tokens.chunk(2)[dist.get_rank()].float())
    else:
        pm(tokens)
    return "ran"


def misused_calls() -> dict[str, str]:
    """Rank body: a Sequential compiled on dp=2, then called wrongly; the message each mistake gets (``"ran"`` where
    none was raised): an extra argument after the inputs (``pm``) or after the targets (``pm.step``), an input
    that requires grad (it would get no gradient), one of another floating dtype and one on another device."""
    import fxpar

    torch.manual_seed(0)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    pm = fxpar.parallelize(sequential(), fxpar.Mesh({"dp": 2}), (x,), loss_fn=mean_square)
    local = x.chunk(2)[dist.get_rank()]
    calls = {"extra_call": lambda: pm(local, local), "extra_step": lambda: pm.step(local, None, local),
             "grad_input": lambda: pm(local.clone().requires_grad_()), "double": lambda: pm(local.double()),
             "meta": lambda: pm(local.to("meta"))}
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = "ran"
        except (TypeError, ValueError) as e:
            out[name] = f"{type(e).__name__}: {e}"
    return out


def die_mid_schedule(dying_rank: int) -> str:
    """Rank body: a pp=2 pipeline (1F1B, 4 microbatches) where ``dying_rank`` exits hard after its first
    forward, while the other rank waits for its activations or gradients."""
    import fxpar
    from fxpar.models.llama import llama

    torch.manual_seed(0)
    tokens = torch.randint(0, 256, (8, 16))
    plan = fxpar.Plan(stages=2, schedule="1f1b", microbatches=4)
    pm = fxpar.parallelize(llama(n_layers=2), fxpar.Mesh({"pp": 2}), (tokens,), plan=plan, loss_fn=mean_square)
    if dist.get_rank() == dying_rank:  # die inside the schedule: right after this rank's first action
        executor = pm.step_executor()
        dispatch = executor.dispatch

        def dispatch_then_die(*args: object) -> None:
            dispatch(*args)
            os._exit(1)

        executor.dispatch = dispatch_then_die  # type: ignore[method-assign]
    pm.step(tokens)
    return "step completed"


def mean_square(out: torch.Tensor) -> torch.Tensor:
    """A batch-mean loss of a model's output (module-level, so ranks can unpickle it)."""
    return out.float().pow(2).mean()


def gpt2(layers: int = 2, vocab: int = 128, hidden: int = 64, heads: int = 4) -> nn.Module:
    """HF ``GPT2LMHeadModel`` with tied input/output embeddings, dropout off (test-only; needs transformers)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=vocab, n_positions=32, n_embd=hidden, n_layer=layers, n_head=heads,
                     tie_word_embeddings=True, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                     bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")
    return GPT2LMHeadModel(cfg).eval()


def qwen2(layers: int = 4, vocab: int = 128, hidden: int = 64) -> nn.Module:
    """HF ``Qwen2ForCausalLM`` (q/k/v biases, GQA), default ``use_cache=True`` (test-only; needs transformers)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False, attn_implementation="sdpa")
    return Qwen2ForCausalLM(cfg).eval()


def sequential(width: int = 32) -> nn.Module:
    """A plain ``nn.Sequential`` (parameters named ``0.weight``, ...): blocks are its children."""
    return nn.Sequential(nn.Linear(16, width), nn.GELU(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width),
                         nn.GELU(), nn.Linear(width, 8))


def next_token_loss(out: object, tokens: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of each position's logits against the next token (HF outputs or a logits tensor)."""
    logits = getattr(out, "logits", out)
    if isinstance(logits, (tuple, list)):
        logits = logits[0]
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def pipeline_step_with_trace(path: str) -> dict[str, object]:
    """Rank body: one traced ``pm.step`` of a pp=2 x dp=2 pipeline (1F1B, 2 microbatches); returns its loss."""
    import fxpar
    from fxpar.models.llama import llama

    torch.manual_seed(0)
    tokens = torch.randint(0, 256, (8, 16))
    mesh = fxpar.Mesh({"pp": 2, "dp": 2})
    pm = fxpar.parallelize(llama(n_layers=2), mesh, (tokens,), plan=fxpar.Plan(microbatches=2),
                           loss_fn=next_token_loss, example_targets=tokens)
    local = tokens.chunk(2)[mesh.coord(dist.get_rank())[1]]
    loss = pm.step(local, local, trace=path)
    return {"loss": loss.item(), "params": sorted(n for n, _ in pm.named_parameters())}
