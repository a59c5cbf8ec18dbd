"""``fxpar.search``: choose a mesh and a plan for a model on a cluster.

1. **Profile** (``fxpar.profile``): two small one-rank compiles of the model (its blocks cut to one and
   two) give per-sample seconds, bytes and parameters of a block and of the rest, and the block's
   tensor-parallel groups (``fxpar.tp_styles``: found from the graph, not from module names).
2. **Enumerate and prune** with the closed forms (``fxpar.closed_form``): every factorization of the
   cluster's devices into ``pp x dp x tp`` (tp inside a node first), the microbatches, ZeRO level,
   recompute, sequence parallelism and pipeline schedule, minus what ``fixed`` pins. A family is pruned
   with its reason: more stages than blocks, a batch dp does not divide, tensor parallelism across
   nodes, memory over HBM.
3. **Tensor-parallel groups**: a group is sharded when the compute it divides saves more per sample
   than its activations cost to reduce over the tp link's bandwidth (the batch-independent regime plans
   are trained in: latency terms vanish as the batch grows); otherwise the block is replicated over tp,
   and ``explain()`` gives both numbers.
4. **Confirm**: the best two (more while none fits), and the fastest of those with sequence parallelism flipped
   (its collectives' latency is what the closed forms leave out), are compiled at full scale on a fake
   mesh and costed by ``pm.estimate`` (the rank programs themselves); those come first, ordered by their
   estimates.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
import warnings
from typing import Any

import torch

from fxpar.candidates import Candidate, SearchReport, plan_line
from fxpar.capture_memo import one_call
from fxpar.closed_form import Choice, ClosedForm, evaluate
from fxpar.cluster import Cluster
from fxpar.compiled import compile_model
from fxpar.errors import FxparWarning, PlanError, close_matches
from fxpar.estimate import estimate
from fxpar.mesh import Mesh
from fxpar.plan import Plan
from fxpar.profile import ModelProfile, profile_model

MESH_AXES = ("pp", "dp", "cp", "ep", "tp")
PLAN_FIELDS = tuple(f.name for f in dataclasses.fields(Plan) if f.name != "notes")


def search(model: torch.nn.Module, example_inputs: Any, cluster: Cluster, *, loss_fn: Any = None,
           example_targets: Any = None, fixed: dict[str, Any] | None = None, top: int = 5,
           confirm: int = 2, budget_s: float = 40.0) -> list[Candidate]:
    """Candidates for ``model`` on ``cluster``, best first (module docstring).

    Requires: ``example_inputs`` with the global batch (dim 0) of one step; ``loss_fn`` for plans with
    pipeline stages. ``fixed`` pins mesh axis sizes (``pp dp cp ep tp``) or Plan fields. On GPU presets
    plans use bf16 mixed precision (fp32 reduction) and ``compile=True`` unless ``fixed`` sets them.
    Ensures: each candidate's plan compiles for its mesh (the first ``confirm`` were compiled and costed
    from their rank programs, more while none of those fits in memory; no further compile starts once
    ``budget_s`` seconds have passed, but at least one is always confirmed). Raises PlanError for unknown or
    contradictory ``fixed`` entries and when no plan fits the cluster's memory (naming the smallest per-rank
    memory found and what dominates it).
    """
    if not isinstance(top, int) or isinstance(top, bool) or top < 1:
        raise ValueError(f"top must be a positive int (how many candidates to return), got {top!r}")
    started = time.perf_counter()
    fixed = dict(fixed or {})
    base = _base_fields(fixed, cluster)
    if isinstance(fixed.get("tp"), (dict, str)):  # a tp plan, not the tp axis size
        del fixed["tp"]
    fixed = _check_fixed(fixed, cluster)
    profile = profile_model(model, example_inputs, cluster, loss_fn=loss_fn, param_dtype=base.get("param_dtype"))
    report = SearchReport(cluster, profile)
    report.seconds["profile"] = time.perf_counter() - started
    ranked = _rank(profile, cluster, fixed, report)
    report.seconds["closed forms"] = time.perf_counter() - started - report.seconds["profile"]
    budget = max(budget_s - (time.perf_counter() - started), 0.0)
    with one_call(model):  # the candidates capture the model once per distinct capture key (fxpar.capture_memo)
        candidates = _confirm(model, example_inputs, loss_fn, cluster, ranked, base, profile, fixed, report,
                              confirm, top, budget)
    report.seconds["confirm"] = time.perf_counter() - started - sum(report.seconds.values())
    report.candidates = candidates
    return candidates


def _check_fixed(fixed: dict[str, Any], cluster: Cluster) -> dict[str, Any]:
    """Unknown names and mesh sizes the cluster cannot hold are PlanErrors naming the field."""
    for key in fixed:
        if key not in MESH_AXES and key not in PLAN_FIELDS:
            hint = close_matches(key, list(MESH_AXES + PLAN_FIELDS))
            raise PlanError(f"fixed[{key!r}]: not a mesh axis ({', '.join(MESH_AXES)}) or a Plan field"
                            + (f"; did you mean {hint[0]!r}?" if hint else ""))
    product = 1
    for axis in MESH_AXES:
        if axis in fixed:
            size = fixed[axis]
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise PlanError(f"fixed[{axis!r}] must be a positive int, got {size!r}")
            product *= size
            if cluster.gpus % size:
                raise PlanError(f"fixed[{axis!r}]={size} does not divide the cluster's {cluster.gpus} GPUs "
                                f"(Cluster.gpus={cluster.gpus})")
    if cluster.gpus % product:
        pinned = ", ".join(f"{a}={fixed[a]}" for a in MESH_AXES if a in fixed)
        raise PlanError(f"fixed mesh axes ({pinned}) need multiples of {product} GPUs, but the cluster has "
                        f"{cluster.gpus} (Cluster.gpus)")
    if all(a in fixed for a in ("pp", "dp", "tp")) and product != cluster.gpus:
        raise PlanError(f"fixed pp x dp x cp x ep x tp = {product} but the cluster has {cluster.gpus} GPUs "
                        "(Cluster.gpus): fix fewer axes or size the cluster to match")
    return fixed


def _base_fields(fixed: dict[str, Any], cluster: Cluster) -> dict[str, Any]:
    """Plan fields the search does not vary: fixed ones, and on GPU clusters bf16 mixed precision and
    Inductor-compiled rank programs."""
    base = {k: v for k, v in fixed.items() if k in PLAN_FIELDS and not (k == "tp" and isinstance(v, int))}
    if cluster.device == "cuda" and "param_dtype" not in base:
        base["param_dtype"] = torch.bfloat16
        base.setdefault("reduce_dtype", torch.float32)
    if cluster.device == "cuda":
        base.setdefault("compile", True)  # Inductor-fused rank programs, as torchtitan runs by default
    return base


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _meshes(cluster: Cluster, fixed: dict[str, Any], profile: ModelProfile,
            report: SearchReport) -> list[tuple[int, int, int]]:
    """(pp, dp, tp) factorizations of the devices left after fixed cp/ep, minus pruned families."""
    other = fixed.get("cp", 1) * fixed.get("ep", 1)
    devices = cluster.gpus // other
    out = []
    for tp in _divisors(devices):
        if "tp" in fixed and tp != fixed["tp"]:
            continue
        if tp > cluster.gpus_per_node and "tp" not in fixed:
            report.pruned.setdefault(f"tp>{cluster.gpus_per_node}", "tensor parallelism across nodes: its "
                                     "activation reductions would cross the inter-node link every block")
            continue
        for pp in _divisors(devices // tp):
            dp = devices // tp // pp
            if ("pp" in fixed and pp != fixed["pp"]) or ("dp" in fixed and dp != fixed["dp"]):
                continue
            if pp > profile.n_blocks:
                report.pruned.setdefault(f"pp>{profile.n_blocks}", f"more pipeline stages than the model's "
                                         f"{profile.n_blocks} blocks")
                continue
            if profile.batch % dp:
                report.pruned.setdefault(f"dp={dp}", f"does not divide the global batch of {profile.batch}")
                continue
            out.append((pp, dp, tp))
    return out


def _tp_groups(profile: ModelProfile, tp: int, cluster: Cluster, report: SearchReport) -> int:
    """How many groups to shard at ``tp`` (all or none): what sharding divides vs what its reductions cost, per
    sample (module docstring). A reduction moves its bytes over the tp link and through device memory (it reads
    its input and writes its output)."""
    if tp == 1:
        return 0
    if not profile.groups:
        report.tp_decisions[tp] = ("replicate: no tensor-parallel group found (a matmul whose output reaches one "
                                   "that writes the block's output)")
        return 0
    saved = 3 * profile.block_shardable * (1 - 1 / tp)
    _, bandwidth = cluster.link(tuple(range(tp)))
    reductions = 2 * profile.reduced_bytes  # forward and backward
    moved = reductions * (2 * (tp - 1) / tp / bandwidth + 2 / cluster.memory_bandwidth)
    worth = saved > moved
    report.tp_decisions[tp] = (f"{'shard' if worth else 'replicate'}: sharding the groups saves {_time(saved)} of "
                               f"compute per sample and block; their reductions cost {_time(moved)} (at "
                               f"{bandwidth / 1e9:.1f} GB/s over tp)")
    return len(profile.groups) if worth else 0


def _time(seconds: float) -> str:
    return f"{seconds * 1e6:.3f} us" if seconds >= 1e-6 else f"{seconds * 1e9:.3f} ns"


def _rank(profile: ModelProfile, cluster: Cluster, fixed: dict[str, Any],
          report: SearchReport) -> list[tuple[ClosedForm, Choice]]:
    """Every choice that fits, by closed-form step time; raises PlanError when none fits."""
    fits: list[tuple[ClosedForm, Choice]] = []
    smallest: tuple[float, ClosedForm, Choice] | None = None
    for pp, dp, tp in _meshes(cluster, fixed, profile, report):
        groups = _tp_groups(profile, tp, cluster, report)
        for ch in _choices(profile, pp, dp, tp, groups, fixed):
            cf = evaluate(profile, ch, cluster)
            report.evaluated += 1
            if smallest is None or cf.memory < smallest[0]:
                smallest = (cf.memory, cf, ch)
            if cf.memory <= cluster.hbm_bytes:
                fits.append((cf, ch))
            else:
                report.pruned.setdefault(f"pp={pp} dp={dp} tp={tp} (some plans)", "memory over HBM")
    if not fits:
        pinned = {k: v for k, v in fixed.items() if k in VARIED}
        if smallest is None and pinned:
            raise PlanError(_pinned_out(pinned))
        raise PlanError(_fits_nowhere(profile, cluster, smallest, report.pruned))
    fits.sort(key=lambda x: x[0].step_time)
    return _prefer_simple(fits, lambda x: x[0].step_time, lambda x: x[1])


SIMPLER_WITHIN = 0.05  # a plan with fewer non-default fields wins when it is at most 5% slower


def _complexity(ch: Choice) -> int:
    """Non-default plan fields: each is something a user has to understand and the cost model can get wrong."""
    return (ch.sequence_parallel + (ch.zero > 0) + (ch.recompute is not None) + (ch.schedule != "1f1b")
            + (ch.microbatches > 1 and ch.pp == 1))


def _prefer_simple(items: list[Any], seconds: Any, choice: Any) -> list[Any]:
    """``items`` (sorted by ``seconds``) with the simplest one within ``SIMPLER_WITHIN`` of the best moved first."""
    if not items:
        return items
    limit = seconds(items[0]) * (1 + SIMPLER_WITHIN)
    near = [x for x in items if seconds(x) <= limit]
    simplest = min(near, key=lambda x: (_complexity(choice(x)), seconds(x)))
    return [simplest] + [x for x in items if x is not simplest]


def _fits_nowhere(profile: ModelProfile, cluster: Cluster, smallest: tuple[float, ClosedForm, Choice] | None,
                  pruned: dict[str, str]) -> str:
    if smallest is None:
        why = "; ".join(f"{family}: {reason}" for family, reason in pruned.items())
        hint = (" (the planner counts the entries of one list of alike blocks; Plan(stages=n) or "
                "Plan(stages=[module paths]) splits other models)" if any(f.startswith("pp>") for f in pruned)
                else "")
        return (f"no mesh of {cluster.gpus} GPUs suits this model and batch ({profile.batch} samples, "
                f"{profile.n_blocks} blocks): {why or 'see the fixed axes and the batch size'}{hint}")
    mem, cf, ch = smallest
    activation_part = mem - _states_bytes(cf, ch, profile)
    dominant = "parameters, gradients and optimizer state" if activation_part < mem / 2 else "activations"
    return (f"the model fits nowhere in {cluster.name} memory ({cluster.hbm_bytes / 2**30:.1f} GiB per device): the "
            f"smallest per-rank memory found is {mem / 2**30:.1f} GiB (pp={ch.pp} dp={ch.dp} tp={ch.tp}, "
            f"zero={ch.zero}, recompute={ch.recompute!r}), dominated by {dominant} "
            f"({(mem - activation_part) / 2**30:.1f} GiB of states for {cf.params_per_rank:,.0f} parameters per "
            f"rank, {activation_part / 2**30:.1f} GiB of activations); use more GPUs or a smaller batch")


VARIED = {"zero": "0-3 (1-3 with dp > 1)", "sequence_parallel": "True / False (True only where tp shards groups)",
          "recompute": "None / 'full'", "schedule": "'1f1b' / 'interleaved-1f1b' (with pp > 1)",
          "microbatches": "divisors of the local batch (at least pp with pp > 1)", "stages": "pp x 1, 2 or 4"}


def _pinned_out(pinned: dict[str, Any]) -> str:
    """Plan fields ``fixed`` pins to values no enumerated candidate has (the search varies each over ``VARIED``)."""
    said = ", ".join(f"{k}={v!r}" for k, v in pinned.items())
    ranges = "; ".join(f"{k}: {VARIED[k]}" for k in pinned)
    return (f"no candidate has fixed {said}: the search varies {ranges}. Pin a value it varies, or compile the plan "
            "yourself with fxpar.parallelize(..., plan=fxpar.Plan(...)) and cost it with pm.estimate(cluster)")


def _states_bytes(cf: ClosedForm, ch: Choice, profile: ModelProfile) -> float:
    n = ch.dp
    per = {0: 16.0, 1: 8 + 16 / n, 2: 4 + 16 / n, 3: 16 / n}[ch.zero if n > 1 else 0]
    return cf.params_per_rank * per * profile.param_bytes / 4


def _choices(profile: ModelProfile, pp: int, dp: int, tp: int, groups: int, fixed: dict[str, Any]):  # noqa: ANN202
    """Every plan variant for one mesh (what ``fixed`` pins is held)."""
    local = profile.batch // dp
    if pp == 1:  # microbatches only trade time for activation memory
        micro = [m for m in (1, 2, 4) if local % m == 0]
    else:  # microbatches of 1, 2, 4, ... samples: enough of them to fill the pipeline
        micro = sorted({local // s for s in (1, 2, 4, 8, 16) if local % s == 0})
        micro = [m for m in micro if m >= pp] or micro[-1:]
    zeros = (0, 1, 2, 3) if dp > 1 else (0,)
    sps = (True, False) if groups else (False,)
    schedules: list[tuple[str, int]] = [("1f1b", pp)]
    if pp > 1:
        schedules += [("interleaved-1f1b", pp * v) for v in (2, 4) if pp * v <= profile.n_blocks]
    for m, zero, sp, rc, (sched, stages) in itertools.product(micro, zeros, sps, (None, "full"), schedules):
        ch = Choice(pp, dp, tp, m, groups, sp, zero, rc, sched, stages)
        if sched == "interleaved-1f1b" and m % pp:
            continue
        if _contradicts(ch, fixed):
            continue
        yield ch


def _contradicts(ch: Choice, fixed: dict[str, Any]) -> bool:
    pinned = {"microbatches": ch.microbatches, "sequence_parallel": ch.sequence_parallel, "zero": ch.zero,
              "recompute": ch.recompute, "schedule": ch.schedule, "stages": ch.stages}
    return any(k in fixed and fixed[k] != v for k, v in pinned.items())


def plan_of(ch: Choice, profile: ModelProfile, base: dict[str, Any]) -> Plan:
    """The ``fxpar.Plan`` of a choice."""
    tp_styles: dict[str, str] = {}
    if ch.sharded_groups:
        for g in profile.groups[: ch.sharded_groups]:
            tp_styles.update(g.styles(profile.block_parent))
    fields: dict[str, Any] = {"tp": tp_styles, "sequence_parallel": ch.sequence_parallel and bool(tp_styles),
                              "zero": ch.zero, "recompute": ch.recompute, "schedule": ch.schedule,
                              "microbatches": ch.microbatches, "stages": ch.stages if ch.pp > 1 else None}
    fields.update(base)
    return Plan(**fields)


def mesh_of(ch: Choice, fixed: dict[str, Any]) -> dict[str, int]:
    """Axis sizes in mesh order (tp innermost, inside a node): pp, dp and tp always, cp and ep when they are used."""
    axes = {"pp": ch.pp, "dp": ch.dp, "cp": fixed.get("cp", 1), "ep": fixed.get("ep", 1), "tp": ch.tp}
    return {k: v for k, v in axes.items() if v > 1 or k in ("pp", "dp", "tp")}


def _confirm(model: torch.nn.Module, inputs: Any, loss_fn: Any, cluster: Cluster,
             ranked: list[tuple[ClosedForm, Choice]], base: dict[str, Any], profile: ModelProfile,
             fixed: dict[str, Any], report: SearchReport, confirm: int, top: int, budget_s: float) -> list[Candidate]:
    """Compile and cost the best ``confirm`` distinct candidates (at least one; no new one once ``budget_s`` seconds
    of confirming have passed), and the contrast ``_contrasts`` names; return ``top``, confirmed ones first."""
    confirmed: list[Candidate] = []
    closed: list[Candidate] = []
    seen: set[str] = set()
    deadline = time.perf_counter() + budget_s

    def key_of(ch: Choice) -> str:
        return f"{mesh_of(ch, fixed)} {plan_of(ch, profile, base)}"

    def confirm_one(cf: ClosedForm, ch: Choice) -> None:
        plan, mesh = plan_of(ch, profile, base), mesh_of(ch, fixed)
        try:
            with warnings.catch_warnings():  # a candidate's warnings are not the chosen plan's (it warns itself)
                warnings.simplefilter("ignore", FxparWarning)
                compiled = compile_model(model, Mesh(mesh, fake=True), inputs, plan, loss_fn)
            if plan.sequence_parallel and not any(p.notes.get("sequence_parallel") for p in compiled.stages):
                plan = dataclasses.replace(plan, sequence_parallel=False)  # no stream to shard: this program
                if f"{mesh} {plan}" in seen:
                    return
                seen.add(f"{mesh} {plan}")
            est = estimate(compiled, cluster)
        except Exception as e:  # noqa: BLE001  (a candidate the compiler refuses is reported, not fatal)
            report.failed.append(f"{mesh} {plan_line(plan)}: {type(e).__name__}: {str(e).splitlines()[0]}")
            return
        confirmed.append(Candidate(mesh, plan, est, cf, ch, True, report))

    for cf, ch in ranked:
        wanted = len(confirmed) < confirm or not any(c.estimate.fits for c in confirmed)  # type: ignore[union-attr]
        confirming = wanted and len(report.failed) < 4 and (not confirmed or time.perf_counter() < deadline)
        if not confirming and len(confirmed) + len(closed) >= top:
            break
        key = key_of(ch)
        if key in seen:
            continue
        seen.add(key)
        if confirming:
            confirm_one(cf, ch)
        else:
            closed.append(Candidate(mesh_of(ch, fixed), plan_of(ch, profile, base), cf, cf, ch, False, report))
    for cf, ch in _contrasts(confirmed, ranked):
        key = key_of(ch)
        if key not in {f"{c.mesh} {c.plan}" for c in confirmed} and time.perf_counter() < deadline:
            seen.add(key)
            closed = [c for c in closed if f"{c.mesh} {c.plan}" != key]
            confirm_one(cf, ch)
    _calibrate(confirmed, closed)
    confirmed.sort(key=lambda c: (not c.estimate.fits, c.step_time))  # type: ignore[union-attr]
    fitting = [c for c in confirmed if c.estimate.fits]  # type: ignore[union-attr]
    confirmed = _prefer_simple(fitting, lambda c: c.step_time, lambda c: c.choice) + \
        [c for c in confirmed if c not in fitting]
    if not confirmed:  # the closed forms alone would hand back plans nobody compiled
        raise PlanError("no candidate plan compiled: " + "; ".join(report.failed))
    return (confirmed + closed)[:top]


def _contrasts(confirmed: list[Candidate], ranked: list[tuple[ClosedForm, Choice]]) -> list[tuple[ClosedForm, Choice]]:
    """The fastest confirmed candidate with sequence parallelism flipped, everything else alike. The closed forms
    price SP in the batch-independent regime (bandwidth only); the compiled estimates count each of its collectives'
    latency, which dominates a small model's step (a 64-wide encoder on dp=2 x tp=4: 664 ms with SP against 225 ms
    without), so the other side is costed too, not assumed slower.

    Which tp groups to shard is not contrasted the same way: in that regime, where models are trained, the closed
    form's decision holds, and a tp axis the user put in the mesh (``plan="auto"``) asks for tensor parallelism.
    (A 48-wide model at 16 x 16 tokens on dp=2 x tp=4 is estimated 740 us a step sharded, 21 us replicated: latency.)"""
    if not confirmed:
        return []
    best = min(confirmed, key=lambda c: (not c.estimate.fits, c.step_time)).choice  # type: ignore[union-attr]
    flipped = dataclasses.replace(best, sequence_parallel=not best.sequence_parallel)
    return next(([(cf, ch)] for cf, ch in ranked if ch == flipped), [])


def _calibrate(confirmed: list[Candidate], closed: list[Candidate]) -> None:
    """Scale unconfirmed closed forms by the median ratio compiled / closed form of the confirmed ones, so the
    runners-up they are listed beside compare like for like."""
    ratios = sorted(c.step_time / c.closed_form.step_time for c in confirmed if c.closed_form.step_time)
    if not ratios:
        return
    ratio = ratios[len(ratios) // 2]
    for c in closed:
        c.estimate = dataclasses.replace(c.closed_form, step_time=c.closed_form.step_time * ratio)
