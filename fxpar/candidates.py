"""What ``fxpar.search`` returns: ranked ``Candidate``s and the ``SearchReport`` that explains them."""

from __future__ import annotations

from dataclasses import dataclass, field

from fxpar.closed_form import Choice, ClosedForm
from fxpar.cluster import Cluster
from fxpar.estimate import Estimate
from fxpar.plan import Plan
from fxpar.profile import ModelProfile


@dataclass
class Candidate:
    """One searched plan: ``.mesh`` (axis sizes), ``.plan``, ``.estimate`` (compiled when ``.confirmed``)."""

    mesh: dict[str, int]
    plan: Plan
    estimate: Estimate | ClosedForm
    closed_form: ClosedForm
    choice: Choice
    confirmed: bool
    report: SearchReport = field(repr=False)

    @property
    def step_time(self) -> float:
        return self.estimate.step_time

    def explain(self) -> str:
        """Why this candidate wins: its breakdown next to the runners-up, and what ruled out each pruned family."""
        return self.report.explain(self)


@dataclass
class SearchReport:
    """What one search did: the candidates kept, the pruned families and why, the tp decisions, timings."""

    cluster: Cluster
    profile: ModelProfile
    candidates: list[Candidate] = field(default_factory=list)
    pruned: dict[str, str] = field(default_factory=dict)
    tp_decisions: dict[int, str] = field(default_factory=dict)
    failed: list[str] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    evaluated: int = 0

    def explain(self, chosen: Candidate) -> str:
        lines = [f"chosen: mesh {chosen.mesh}, {plan_line(chosen.plan)}",
                 f"  on {self.cluster}",
                 f"  {'compiled estimate' if chosen.confirmed else 'closed form'}: step "
                 f"{chosen.step_time * 1e3:.2f} ms, MFU {_mfu(chosen):.1%}, peak memory "
                 f"{_peak(chosen) / 2**30:.2f} GiB per rank"]
        if isinstance(chosen.estimate, Estimate):
            lines += ["  " + ln for ln in str(chosen.estimate).splitlines()[1:] if not ln.startswith("  formulas")
                      and "t = " not in ln and "(F FLOPs" not in ln]
        fastest = min((c for c in self.candidates if c.confirmed), key=lambda c: c.step_time, default=chosen)
        if fastest is not chosen and fastest.step_time < chosen.step_time:
            lines.append(f"  preferred to a plan {1 - fastest.step_time / chosen.step_time:.1%} faster: within 5%, "
                         "the plan with fewer non-default fields wins (fewer things to get wrong, in the model too)")
        lines.append("runners-up (step time, MFU, peak memory per rank):")
        for c in self.candidates:
            if c is chosen:
                continue
            how = "compiled" if c.confirmed else "closed form"
            slower = c.step_time / chosen.step_time if chosen.step_time else float("inf")
            lines.append(f"  {c.mesh} {plan_line(c.plan)}: {c.step_time * 1e3:.2f} ms ({slower:.2f}x, {how}), "
                         f"MFU {_mfu(c):.1%}, {_peak(c) / 2**30:.2f} GiB")
        if self.tp_decisions:
            lines.append("tensor-parallel groups (found in the graph):")
            lines += [f"  {g}" for g in self.profile.groups] or ["  none: no matmul feeds another inside a block"]
            lines += [f"  tp={tp}: {why}" for tp, why in sorted(self.tp_decisions.items())]
        if self.pruned:
            lines.append("pruned families:")
            lines += [f"  {family}: {why}" for family, why in self.pruned.items()]
        if self.failed:
            lines.append("candidates that failed to compile:")
            lines += [f"  {f}" for f in self.failed]
        lines.append(f"searched {self.evaluated} closed-form candidates in "
                     + ", ".join(f"{k} {v:.1f} s" for k, v in self.seconds.items()))
        return "\n".join(lines)


def plan_line(plan: Plan) -> str:
    return str(plan).splitlines()[0]


def _mfu(c: Candidate) -> float:
    return c.estimate.mfu


def _peak(c: Candidate) -> float:
    return c.estimate.peak_memory
