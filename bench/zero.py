"""fxpar data parallelism vs PyTorch's on real gloo ranks: zero=0 vs DDP, zero=1/2/3 vs FSDP2 (ZeRO-2/3 modes).

One command, one launch of 2 gloo ranks (``dp=2``), about a minute on 2 cores::

    .venv/bin/python bench/zero.py
    .venv/bin/python bench/zero.py --dp3     # 3 ranks, batch 6: dp divides no width (uneven ZeRO shards)

With ``--dp3`` every parameter's sharded dim is one 3 does not divide (hidden 256, intermediate 512, vocab 512):
fxpar and FSDP2 both split it as ``torch.chunk`` does (256 rows: 86, 86 and 84 on both) and pad
each piece to the largest inside the collectives, so both move a little more than Psi. Results go to the
``zero_dp3`` section.

Same model (the bundled Llama, seed 0), same global batch, fp32 AdamW. Per system and rank, after warm-up:

* **bytes per step** of the dp collectives against the analytic optimum (Psi = parameter bytes):
  zero 0 all-reduce Psi; zero 1 and 2 all-gather Psi + reduce-scatter Psi (one microbatch); zero 3 all-gather
  2 Psi (forward and backward) + reduce-scatter Psi. fxpar's from
  its ledger (exact, known at compile time); DDP's counted in a comm hook (every bucket it all-reduces);
  FSDP2's by wrapping ``torch.distributed.all_gather_single`` / ``reduce_scatter_single``, which its default
  collectives call. FSDP2 runs one ``fully_shard`` per block plus the root, with ``reshard_after_forward=False``
  (parameters stay gathered between forward and backward: ZeRO-2's schedule) against fxpar zero 1 and 2, and
  ``True`` (re-gathered in backward: ZeRO-3) against fxpar zero 3.
* **memory per rank** after a step: local storage of parameters, gradients and Adam state (``exp_avg``,
  ``exp_avg_sq``), against ``pm.memory(rank)`` and the formula (4 + 4 + 8 Psi for DDP; Adam state 8 Psi / N
  for ZeRO). fxpar's gathered working copies are released after ``pm.step``, so they are not in the
  measured column (``pm.memory`` counts them).
* **step time**: ``zero_grad`` + forward + backward + ``opt.step``, max over ranks, median over ``STEPS``
  steps per system in interleaved rounds. Each system's first-step loss is printed next to the others'.

Results go to ``bench/results/zero.json`` and the ``zero`` section of ``bench/README.md``.
"""

from __future__ import annotations

import copy
import time
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import bench_args, interleaved_step_times, markdown_table, publish_gloo_run, ratio, step_time_table
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

import fxpar
from fxpar.models.llama import Llama, LlamaConfig

CONFIG = {"n_layers": 4, "hidden": 256, "intermediate": 512, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 512,
          "max_seq": 64}
BATCH, SEQ, DP = 8, 64, 2
WARMUP, STEPS, ROUNDS = 2, 12, 4
COMMAND = ".venv/bin/python bench/zero.py"
SYSTEMS = ["fxpar zero=0", "DDP", "fxpar zero=1", "fxpar zero=2", "FSDP2 (ZeRO-2 mode)", "fxpar zero=3",
           "FSDP2 (ZeRO-3 mode)"]


def next_token_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _storage(tensors: list[torch.Tensor]) -> int:
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def counted_warm_up(step: Any, opt: Any, counter: Counter, warmup: int) -> float:
    """``warmup`` training steps, then one more with ``counter`` on (the dp bytes of one steady step); the first
    step's loss."""
    first = None
    for i in range(warmup + 1):
        counter.on, counter.bytes = i == warmup, {}
        opt.zero_grad()
        loss = step()
        opt.step()
        first = loss.item() if first is None else first
    counter.on = False
    return first


class Counter:
    """dp collective bytes by op while active: DDP via its comm hook, FSDP2 via the dist functions it calls."""

    def __init__(self) -> None:
        self.bytes: dict[str, int] = {}
        self.on = False

    def add(self, op: str, t: torch.Tensor) -> None:
        if self.on:
            self.bytes[op] = self.bytes.get(op, 0) + t.numel() * t.element_size()

    def ddp_hook(self):  # noqa: ANN201 - DDP rejects a hook whose annotations are not its own types
        def hook(state, bucket):  # noqa: ANN001, ANN202
            self.add("all_reduce", bucket.buffer())
            work = dist.all_reduce(bucket.buffer(), async_op=True)
            return work.get_future().then(lambda f: f.value()[0].div_(dist.get_world_size()))
        return hook

    def patch_fsdp(self) -> None:
        gather, scatter = dist.all_gather_single, dist.reduce_scatter_single

        def all_gather_single(output_tensor: torch.Tensor, input_tensor: torch.Tensor, *a: Any, **k: Any) -> Any:
            self.add("all_gather", output_tensor)
            return gather(output_tensor, input_tensor, *a, **k)

        def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, *a: Any, **k: Any) -> Any:  # noqa: A002
            self.add("reduce_scatter", input)
            return scatter(output, input, *a, **k)

        dist.all_gather_single, dist.reduce_scatter_single = all_gather_single, reduce_scatter_single


def build(name: str, model: Llama, tokens: torch.Tensor, counter: Counter) -> tuple[Any, Any, Any]:
    """(step function, optimizer, the module holding the parameters) for one system on this rank."""
    rank, dp = dist.get_rank(), dist.get_world_size()
    local = tokens.chunk(dp)[rank]
    m = copy.deepcopy(model)
    if name.startswith("fxpar"):
        zero = int(name[-1])
        pm = fxpar.parallelize(m, fxpar.Mesh({"dp": dp}), (tokens,), plan=fxpar.Plan(zero=zero),
                               loss_fn=next_token_loss, example_targets=tokens)
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
        return (lambda: pm.step(local, local)), opt, pm
    if name == "DDP":
        ddp = DistributedDataParallel(m)
        ddp.register_comm_hook(None, counter.ddp_hook())
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        return partial(_eager_step, ddp, local), opt, ddp
    reshard = name == "FSDP2 (ZeRO-3 mode)"
    for layer in m.layers:
        fully_shard(layer, reshard_after_forward=reshard)
    fully_shard(m, reshard_after_forward=reshard)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    return partial(_eager_step, m, local), opt, m


def _eager_step(module: torch.nn.Module, local: torch.Tensor) -> torch.Tensor:
    """Forward, loss and backward of PyTorch's own data parallelism (DDP or FSDP2); the global mean loss."""
    loss = next_token_loss(module(local), local)
    loss.backward()
    return _global_mean(loss)


def _global_mean(loss: torch.Tensor) -> torch.Tensor:
    value = loss.detach().clone()
    dist.all_reduce(value)
    return value / dist.get_world_size()


def rank_main(batch: int = BATCH) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Llama(LlamaConfig(**CONFIG))
    tokens = torch.randint(0, CONFIG["vocab_size"], (batch, SEQ))
    counter = Counter()
    counter.patch_fsdp()
    runs = {name: build(name, model, tokens, counter) for name in SYSTEMS}
    out: dict[str, Any] = {}
    for name, (step, opt, holder) in runs.items():
        first = counted_warm_up(step, opt, counter, WARMUP)
        params = [_local(p) for p in holder.parameters()]
        state = [_local(v) for s in opt.state.values() for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")]
        opt.zero_grad(set_to_none=False)
        row: dict[str, Any] = {"first_loss": first, "params": _storage(params),
                               "grads": _storage([_local(p.grad) for p in holder.parameters()]),
                               "optimizer": _storage(state), "times": []}
        if name.startswith("fxpar"):
            rows = [r for r in holder.ledger(dist.get_rank()) if r.axis == "dp"]
            row["bytes"] = {op: sum(r.bytes for r in rows if r.op == op) for op in {r.op for r in rows}}
            mem = holder.memory(dist.get_rank())
            row["predicted"] = {"params": mem.params, "grads": mem.grads, "optimizer": mem.optimizer}
        else:
            row["bytes"] = dict(counter.bytes)
        out[name] = row
    for name, times in interleaved_step_times({n: runs[n][:2] for n in SYSTEMS}, STEPS, ROUNDS).items():
        out[name]["times"] = times
    return out


def report(res: dict[str, Any], psi: int) -> list[str]:
    optimum = {"fxpar zero=0": {"all_reduce": psi}, "DDP": {"all_reduce": psi}}
    optimum.update({k: {"all_gather": psi, "reduce_scatter": psi} for k in SYSTEMS[2:5]})
    optimum.update({k: {"all_gather": 2 * psi, "reduce_scatter": psi} for k in SYSTEMS[5:]})
    base = {"fxpar zero=0": "DDP", "fxpar zero=1": "FSDP2 (ZeRO-2 mode)", "fxpar zero=2": "FSDP2 (ZeRO-2 mode)",
            "fxpar zero=3": "FSDP2 (ZeRO-3 mode)"}
    rows, mem_rows = [], []
    for name in SYSTEMS:
        r = res[name]
        sent = sum(r["bytes"].values())
        best = sum(optimum[name].values())
        ops = ", ".join(f"{op} {b:,}" for op, b in sorted(r["bytes"].items()))
        rows.append([name, ops, f"{sent:,}", f"{best:,}", ratio(sent, best)])
        pred = r.get("predicted", {})
        mem_rows.append([name, f"{r['params']:,}", f"{r['grads']:,}", f"{r['optimizer']:,}",
                         ", ".join(f"{k} {v:,}" for k, v in pred.items()) or "-"])
    return [*markdown_table(["system", "dp bytes per step by op", "total", "optimum", "total / optimum"], rows), "",
            *markdown_table(["system", "params B (measured)", "grads B", "Adam state B", "pm.memory predicts"],
                            mem_rows), "",
            *step_time_table({name: res[name] for name in SYSTEMS}, base),
            ""]


def main() -> None:
    from fxpar.testing.launch import run_ranks

    args = bench_args(__doc__, flags=(("--dp3", "3 ranks, batch 6: widths dp does not divide"),))
    dp, batch, name = (3, 6, "zero_dp3") if args.dp3 else (DP, BATCH, "zero")
    t0 = time.perf_counter()
    results = run_ranks(rank_main, dp, batch, timeout=900, collective_timeout=120)
    psi = sum(p.numel() * 4 for p in Llama(LlamaConfig(**CONFIG)).parameters())
    command = COMMAND + (" --dp3" if args.dp3 else "")
    lines = [f"`{command}` (dp={dp}, {dp} gloo ranks; Llama {CONFIG['n_layers']} layers, hidden {CONFIG['hidden']}, "
             f"vocab {CONFIG['vocab_size']}; batch {batch} x seq {SEQ}; Psi = {psi:,} B; rank 0's numbers; step "
             f"time max over ranks, median of {STEPS} steps in {ROUNDS} interleaved rounds)", "",
             *report(results[0], psi)]
    publish_gloo_run(name, name, command, lines, results, t0, not args.no_readme, CONFIG, batch, SEQ, psi=psi)


if __name__ == "__main__":
    main()
