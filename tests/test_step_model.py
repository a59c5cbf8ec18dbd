"""One model of a rank's step (``fxpar.rank_step``): the executor runs it, ``verify`` and the ledger read it.

Compile-only checks run on fake meshes; the gloo cases run ``pm.step`` against the single-device model
(fp32: rtol 1e-5, see ``fxpar.testing.tolerance``) while ``assert_equivalent`` counts every collective and
transfer the step issues and holds it to ``pm.ledger(rank)``.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import pytest
import torch

import fxpar
from fxpar.models.llama import llama, llama_plan
from fxpar.rank_step import StepEvent
from fxpar.testing import assert_equivalent
from fxpar.testing.error_models import next_token_loss

PP2_DP2 = {"pp": 2, "dp": 2}  # rank = 2 * pp + dp: rank 0's pipeline peer is rank 2


def _tokens(batch: int = 8, seq: int = 16) -> torch.Tensor:
    return torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(0))


def _fake_pm(plan: fxpar.Plan, mesh: dict[str, int] = PP2_DP2) -> fxpar.ParallelModule:
    torch.manual_seed(0)
    tokens = _tokens()
    return fxpar.parallelize(llama(n_layers=2), fxpar.Mesh(mesh, fake=True), (tokens,), plan=plan,
                             loss_fn=next_token_loss, example_targets=tokens)


def _first(events: list[StepEvent], kind: str) -> int:
    return next(i for i, e in enumerate(events) if e.kind == kind)


def _with_comm(event: StepEvent, **changes: object) -> StepEvent:
    return replace(event, comms=(replace(event.comms[0], **changes), *event.comms[1:]))


@pytest.fixture(scope="module")
def pm_1f1b() -> fxpar.ParallelModule:
    return _fake_pm(fxpar.Plan(schedule="1f1b", microbatches=2))


def test_the_step_lists_every_event_of_a_pp_dp_rank(pm_1f1b: fxpar.ParallelModule) -> None:
    kinds = [e.kind for e in pm_1f1b.step_events(0)]
    assert kinds == ["F", "SEND_F", "F", "SEND_F", "RECV_B", "B", "RECV_B", "B", "wait_sends", "reduce", "loss"]
    sends = [c for e in pm_1f1b.step_events(0) if e.kind == "SEND_F" for c in e.comms]
    assert {c.ranks for c in sends} == {(0, 2)} and len({c.tag for c in sends}) == len(sends)


def test_verify_catches_a_changed_tag(pm_1f1b: fxpar.ParallelModule) -> None:
    events = list(pm_1f1b.step_events(0))
    i = _first(events, "SEND_F")
    events[i] = _with_comm(events[i], tag=events[i].comms[0].tag + 1)
    with pytest.raises(fxpar.VerifyError, match=rf"rank 0 -> rank 2 \(step {i}: SEND_F0\.0>1\)") as err:
        fxpar.verify(pm_1f1b, events={0: events})
    assert "deadlock" in str(err.value) and "rank 2 waits on recv" in str(err.value)


def test_verify_catches_a_changed_peer(pm_1f1b: fxpar.ParallelModule) -> None:
    events = list(pm_1f1b.step_events(0))
    i = _first(events, "SEND_F")
    events[i] = _with_comm(events[i], ranks=(0, 3))
    with pytest.raises(fxpar.VerifyError, match=rf"rank 0 -> rank 3 \(step {i}: ") as err:
        fxpar.verify(pm_1f1b, events={0: events})
    assert "rank 2 waits on recv" in str(err.value)


def test_verify_catches_a_send_moved_after_the_step(pm_1f1b: fxpar.ParallelModule) -> None:
    events = list(pm_1f1b.step_events(0))
    moved = events.pop(_first(events, "SEND_F"))
    events.append(moved)  # after the dp reduction and the loss: rank 2 waits for it forever
    waits = r"deadlock: .*rank 2 waits on recv tag 0 .*rank 0 -> rank 2 \(step 0: RECV_F0\.0<0\)"
    with pytest.raises(fxpar.VerifyError, match=waits):
        fxpar.verify(pm_1f1b, events={0: events})


def test_verify_catches_a_receive_of_the_wrong_shape(pm_1f1b: fxpar.ParallelModule) -> None:
    events = list(pm_1f1b.step_events(2))
    i = _first(events, "RECV_F")
    events[i] = _with_comm(events[i], shape=(1, 1))
    with pytest.raises(fxpar.VerifyError, match=rf"transfer rank 0 -> rank 2 mismatch: rank 2 receives .*step {i}"):
        fxpar.verify(pm_1f1b, events={2: events})


def test_the_ledger_is_read_from_the_events(pm_1f1b: fxpar.ParallelModule) -> None:
    rows = pm_1f1b.ledger(0)
    from_events = [c.row for e in pm_1f1b.step_events(0) for c in e.comms if c.row is not None]
    assert [(r.op, r.shape, r.peer) for r in rows] == [(r.op, r.shape, r.peer) for r in from_events]
    assert [r.mb for r in rows if r.op == "send"] == [0, 1]


def test_zero2_reduces_after_each_microbatch_and_zb_h1_runs_w() -> None:
    zero2 = _fake_pm(fxpar.Plan(schedule="1f1b", microbatches=2, zero=2))
    first = [e.kind for e in zero2.step_events(0)]  # stage 0: no input gradient to send, one whole backward
    assert "W" not in first and first.count("reduce") == 2 and first[first.index("B") + 1] == "reduce"
    kinds = [e.kind for e in zero2.step_events(2)]  # stage 1: B sends its input gradient before W runs
    b = kinds.index("B")
    assert kinds.count("reduce") == 2 and kinds[b:b + 4] == ["B", "SEND_B", "W", "reduce"]
    assert [e.graph for e in zero2.step_events(2)][b:b + 3:2] == ["backward_b", "backward_w"]
    zb = _fake_pm(fxpar.Plan(schedule="zb-h1", microbatches=2))
    graphs = [e.graph for e in zb.step_events(2) if e.kind in ("B", "W")]
    assert graphs == ["backward_b", "backward_w"] * 2 or sorted(set(graphs)) == ["backward_b", "backward_w"]


def _events_drive_the_step(pm: fxpar.ParallelModule, rank: int) -> None:
    """Rank hook: verify the executor's own event list, then shift every transfer tag on every rank by the same
    amount in that list: the step still matches the single device, so the executor sends and receives with the
    tags the list names (and verify accepts the shifted list)."""
    executor = pm.step_executor()
    assert executor.events is pm.step_events()
    fxpar.verify(pm, events={rank: executor.events})
    pipeline = [r for r in range(pm.mesh.size) if r % 2 == rank % 2]  # this rank and its pp peer (same dp coord)
    shifted = {r: [replace(e, comms=tuple(replace(c, tag=c.tag + 7) if c.tag is not None else c for c in e.comms))
                   for e in pm.step_events(r)] for r in pipeline}
    with pytest.raises(fxpar.VerifyError, match="deadlock"):  # shifted on one side only: caught
        fxpar.verify(pm, events={rank: shifted[rank]})
    fxpar.verify(pm, events=shifted)
    executor.events[:] = shifted[rank]


def test_the_event_list_drives_a_real_pp2_dp2_step() -> None:
    tokens = _tokens()
    reports = assert_equivalent(partial(llama, n_layers=2), PP2_DP2, fxpar.Plan(schedule="1f1b", microbatches=2),
                                (tokens,), loss_fn=next_token_loss, targets=tokens, rank_hook=_events_drive_the_step)
    assert all(len(r.losses) == 3 for r in reports)


def test_ledger_is_what_runs_with_overlap_and_microbatches() -> None:
    """The pp x dp x tp case whose ledger lost the second microbatch's tp all-reduces (overlap buckets): the
    equivalence check counts every call the step issues and compares it with ``pm.ledger(rank)``."""
    tokens = _tokens()
    assert_equivalent(partial(llama, n_layers=2), {"dp": 2, "tp": 2}, fxpar.Plan(tp=llama_plan(), microbatches=2),
                      (tokens,), loss_fn=next_token_loss, targets=tokens)
