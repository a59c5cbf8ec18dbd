"""Trace a repeated block once, lower once per role (issue 19).

* Models whose layers differ compile with the distinct captures they need (Gemma2's sliding and global
  layers, Qwen3-MoE's dense and sparse layers, a Llama with a wider MLP in every other layer), print the
  same programs and ledgers with sharing off (``FXPAR_SHARING=0``), and match the single device on gloo.
* Ranks that differ only in their groups share one lowering, each bound to its own groups (equal to it
  lowered alone); uneven shapes make each coordinate its own role.
* Pipeline stages that hold identical layers are lowered once and copied with paths moved, print as lowered
  alone, and train like the single device.
* ``verify`` says what it checked.
The golden replay (``tests/test_golden.py``) shows sharing on == off for every feature's golden case.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch

import fxpar
from fxpar.models import mixed
from fxpar.models.llama import llama, llama_plan
from fxpar.testing import assert_equivalent

pytest.importorskip("transformers")
from fxpar.models import hf_families  # noqa: E402


@pytest.fixture(autouse=True)
def _share_two_layer_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cases have 2-4 layers: share blocks repeated twice (the default only shares 4 or more)."""
    monkeypatch.setenv("FXPAR_SHARE_MIN", "2")

SMALL = dict(vocab_size=64, hidden=32, intermediate=64, n_heads=4, n_kv_heads=2, max_seq=16)


@contextmanager
def sharing(on: bool, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    with monkeypatch.context() as m:
        m.setenv("FXPAR_SHARING", "1" if on else "0")
        yield


def _compile(build: Callable[[], torch.nn.Module], axes: dict[str, int], inputs: tuple, plan: object = None,
             **kw: object) -> fxpar.ParallelModule:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fxpar.FxparWarning)
        return fxpar.parallelize(build(), fxpar.Mesh(axes, fake=True), inputs, plan=plan, **kw)


TOKENS = (torch.randint(3, 64, (4, 16), generator=torch.Generator().manual_seed(0)),)
MIXED = [
    ("gemma2_alternating", mixed.gemma2_alternating, {"dp": 2}, None, 4, 2),
    ("qwen3_moe_mixed", mixed.qwen3_moe_mixed, {"dp": 2}, None, 4, 2),
    ("mixtral", hf_families.mixtral, {"dp": 2}, None, 2, 1),
    ("mixtral_ep", hf_families.mixtral, {"dp": 2, "ep": 2}, None, 2, 1),  # each layer was its own capture
    ("llama_wide_layers", functools.partial(mixed.llama_wide_layers, **SMALL), {"dp": 2, "tp": 2}, llama_plan(), 4, 2),
]


@pytest.mark.parametrize(("name", "build", "axes", "plan", "blocks", "distinct"), MIXED, ids=[m[0] for m in MIXED])
def test_differing_layers_capture_what_they_need(name: str, build: Callable[[], torch.nn.Module], axes: dict,
                                                 plan: object, blocks: int, distinct: int,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Each distinct layer structure is traced once; the programs and ledgers equal the whole-model capture's."""
    inputs = hf_families.inputs("llama") if name != "llama_wide_layers" else TOKENS
    with sharing(True, monkeypatch):
        on = _compile(build, axes, inputs, plan)
    captures = on.captures
    assert (captures.whole, captures.blocks, captures.distinct) == (False, blocks, distinct), captures
    with sharing(False, monkeypatch):
        off = _compile(build, axes, inputs, plan)
    assert off.captures.whole
    for rank in (0, on._compiled.mesh.size - 1):
        assert on.program(rank) == off.program(rank)
        assert on.ledger_table(rank) == off.ledger_table(rank)


@pytest.mark.parametrize(("build", "axes", "plan"), [
    (mixed.gemma2_alternating, {"dp": 2}, None),
    (mixed.qwen3_moe_mixed, {"tp": 2}, fxpar.Plan(tp="hf")),
    (functools.partial(mixed.llama_wide_layers, **SMALL), {"dp": 2, "tp": 2}, llama_plan()),
    (mixed.llama4_interleaved, {"dp": 2}, None),
], ids=["gemma2_dp2", "qwen3_moe_mixed_tp2", "llama_wide_layers_dp2_tp2", "llama4_interleaved_dp2"])
def test_differing_layers_match_single_device(build: Callable[[], torch.nn.Module], axes: dict,
                                              plan: object) -> None:
    """Stitched programs of models with differing layers train like the single device (fp32, rtol 1e-5). Llama 4's
    masks index by the batch positions alone: ``fxpar.simplify`` made that index op unrunnable (no index tensor
    left, and a shape without the index's size-1 dims), so lowering failed on every mesh."""
    inputs = TOKENS if "wide" in str(build) else hf_families.inputs("llama")
    assert_equivalent(build, axes, plan, inputs, steps=2)


def test_layers_differing_in_plain_attributes_are_captured_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """A later layer that overrides a class attribute the first read, has one the first read through ``getattr``'s
    default, or holds a value equal to the first's but not the same to its code (``(True,)`` and ``(1,)``, ``-0.0``
    and ``0.0``) got the first layer's capture: each printed ``mul(..., 1.0)`` and trained wrong."""
    from fxpar.testing.block_models import per_layer_attributes

    x = (torch.randn(8, 16, generator=torch.Generator().manual_seed(0)),)
    programs = {}
    for on in (True, False):
        with sharing(on, monkeypatch):
            pm = _compile(per_layer_attributes, {"dp": 2}, x)
            programs[on] = pm.program(0)
    assert pm.captures.whole
    captures = _compile(per_layer_attributes, {"dp": 2}, x).captures
    assert (captures.blocks, captures.distinct) == (6, 5)  # layers 0 and 1 share
    assert programs[True] == programs[False]
    for value in ("0.5", "3.0", "2.0", "-1.0"):
        assert f", {value})" in programs[True]


@pytest.mark.parametrize("source", ["global_dict", "global_float", "helper", "module_arg", "dict_read", "class_attr",
                                    "nested_global", "nested_dict", "deep_attribute", "held_module",
                                    "nested_argument"])
def test_a_block_reading_state_the_model_changes_between_layers_is_not_shared_wrongly(
        source: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The model sets a global (a dict entry, a rebound float), a field of a helper every layer holds or of a module
    it passes, before each layer, or one layer has an attribute read through ``self.__dict__``: each layer got the
    first layer's (or the last's) value baked in with sharing on (a wrong answer on gloo). So it did for a value
    read deeper: a class attribute, a field two levels below a global, a block attribute or an argument, a global
    dict's nested entry, a module the block holds without registering it. The programs must be sharing off's."""
    from fxpar.testing.block_models import OutsideState

    x = (torch.randn(8, 16, generator=torch.Generator().manual_seed(0)),)
    programs = {}
    for on in (True, False):
        with sharing(on, monkeypatch):
            programs[on] = _compile(functools.partial(OutsideState, source), {"dp": 2}, x).program(0)
    assert programs[True] == programs[False]
    wanted = ("1.0", "1.0", "3.0", "1.0") if source == "dict_read" else ("1.0", "2.0", "3.0", "4.0")
    assert [line.split(", ")[-1].split(")")[0] for line in programs[True].splitlines()
            if "aten.mul.Tensor(tanh" in line] == list(wanted)


def test_layers_holding_equal_helper_dicts_share_and_a_differing_one_does_not(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each layer holds its own unregistered ``{name: parameterless module}`` dict (transformers 5.25 gives every
    attention layer one, ``_kernel_funcs``): keyed by identity, every HF model fell back to the whole-model capture
    (torch.export rebuilds the dict after the trace: "reads '_kernel_funcs', which changed after its call"), and
    per-layer helpers would have told equal layers apart. Equal helpers share; the last layer's, scaling by 2.0,
    does not."""
    from fxpar.testing.helper_dicts import per_layer_helper_dicts

    x = (torch.randn(8, 16, generator=torch.Generator().manual_seed(0)),)
    programs = {}
    for on in (True, False):
        with sharing(on, monkeypatch):
            pm = _compile(per_layer_helper_dicts, {"dp": 2}, x)
            programs[on], captures = pm.program(0), pm.captures
            assert captures.whole is not on, captures
    on_captures = _compile(per_layer_helper_dicts, {"dp": 2}, x).captures
    assert (on_captures.blocks, on_captures.distinct) == (4, 2)
    assert programs[True] == programs[False]
    assert [line.split(", ")[-1].split(")")[0] for line in programs[True].splitlines()
            if "aten.mul.Tensor(tanh" in line] == ["1.0", "1.0", "1.0", "2.0"]


def test_layers_holding_helper_dicts_train_like_the_single_device() -> None:
    """The shared program of those layers trains like the single device on gloo (fp32, rtol 1e-5)."""
    from fxpar.testing.helper_dicts import per_layer_helper_dicts

    x = (torch.randn(8, 16, generator=torch.Generator().manual_seed(0)),)
    assert_equivalent(per_layer_helper_dicts, {"dp": 2}, None, x, steps=2)


def test_a_rebuilt_container_keys_as_its_original_and_a_subclass_with_hidden_state_does_not() -> None:
    """A plain dict, list or tuple (and a helper module with no state of its own) keys by type and contents: the
    copy torch.export puts back keys as the original did. A ``defaultdict`` holds its factory outside its items, so
    two with equal items stay apart (by identity)."""
    import collections
    import copy

    from fxpar.block_reads import value_key
    from fxpar.testing.helper_dicts import _Activation

    for original in ({"act": _Activation(1.0), "n": [1, 2.0]}, [1, (2, "a")], (1.0, {"k": True})):
        assert value_key(original) == value_key(copy.copy(original))
    assert value_key({"act": _Activation(1.0)}) != value_key({"act": _Activation(2.0)})
    assert value_key(collections.defaultdict(int, a=1)) != value_key(collections.defaultdict(list, a=1))


@pytest.mark.parametrize("per_layer", [False, True], ids=["once", "per layer"])
def test_a_field_the_model_sets_on_a_shared_child_reaches_every_layer(per_layer: bool,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The model sets a field of a child every layer holds (once before the loop, or before each layer): with
    sharing on every layer had the value from before the forward (torch.export puts it back before the blocks are
    traced), 1.0 where the model computes with 2.0. Such a model is now traced whole."""
    from fxpar.testing.block_models import SetsSharedChild

    x = (torch.randn(8, 16, generator=torch.Generator().manual_seed(0)),)
    programs, captures = {}, {}
    for on in (True, False):
        with sharing(on, monkeypatch):
            pm = _compile(functools.partial(SetsSharedChild, per_layer), {"dp": 2}, x)
            programs[on], captures[on] = pm.program(0), pm.captures
    assert "the model's forward sets gain.gain" in captures[True].reason
    assert programs[True] == programs[False]
    wanted = ["1.0", "2.0", "3.0", "4.0"] if per_layer else ["2.0"] * 4
    assert [line.split(", ")[-1].split(")")[0] for line in programs[True].splitlines()
            if "aten.mul.Tensor(tanh" in line] == wanted


def _two_stage_programs(build: Callable[[], torch.nn.Module], monkeypatch: pytest.MonkeyPatch) -> dict[bool, list]:
    """Both ranks' programs of ``build`` on pp=2 (2 stages, 2 microbatches), sharing on and off."""
    x = (torch.randn(4, 8, generator=torch.Generator().manual_seed(0)),)
    programs = {}
    for on in (True, False):
        with sharing(on, monkeypatch):
            pm = _compile(build, {"pp": 2}, x, fxpar.Plan(stages=2, microbatches=2), example_targets=x[0],
                          loss_fn=lambda out, y: (out - y).pow(2).mean())
            programs[on] = [pm.program(r) for r in (0, 1)]
    return programs


def test_a_shared_blocks_cost_splits_stages_as_the_whole_model_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stage split's cost counted each shared block's outputs twice (the call and the ``getitem`` reading it), so
    sharing on split after layer 1 where the whole-model trace splits after layer 2."""
    from fxpar.testing.block_models import WideHead

    programs = _two_stage_programs(WideHead, monkeypatch)
    holds = {on: [line for p in progs for line in p.splitlines() if line.startswith("# holds")]
             for on, progs in programs.items()}
    assert holds[True] == holds[False] == ["# holds   inp, layers.0-2", "# holds   layers.3, head, out"]


def test_a_block_called_several_times_is_traced_whole_on_a_pipeline_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """Refused on dp already; a pipeline stage's export (its state left on the blocks) shared the block and summed
    its gradients in another order than the whole-model trace (same values, another program)."""
    from fxpar.testing.block_models import CalledTwice

    programs = _two_stage_programs(CalledTwice, monkeypatch)
    assert programs[True] == programs[False]


def test_a_block_returning_a_tensor_it_wrote_in_place_is_traced_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """``x = x.clone(); x.add_(h); return x``: the whole-model trace reads the written output through
    functionalization (one more ``view`` name, the head's ``t``/``view`` in another order); sharing printed another
    program. Such a block is now captured whole, as sharing off does."""
    from fxpar.testing.block_models import WritesItsOutput

    programs, reasons = {}, {}
    for on in (True, False):
        with sharing(on, monkeypatch):
            pm = _compile(WritesItsOutput, {"dp": 2}, TOKENS, fxpar.Plan(zero=1))
            programs[on], reasons[on] = pm.program(0), pm_reason(pm)
    assert programs[True] == programs[False]
    assert "wrote in place" in reasons[True]


# variant -> (blocks, distinct captures); None: whole-model capture. A hooked or frozen layer (whole or one weight)
# is traced with the model; a layer in eval mode is a block of its own; "all" leaves one block, the eval layer
APART = {"forward_hook": (3, 1), "pre_hook": (3, 1), "eval": (4, 2), "frozen": (3, 1), "frozen_weight": (3, 1),
         "tied": (2, 1), "same_instance": None, "all": (1, 1)}


@pytest.mark.parametrize("variant", list(APART))
def test_a_layer_the_user_set_apart_is_not_shared_with_the_others(variant: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A hook on one layer, one layer in eval mode or frozen, a weight tied across layers, one block object listed
    four times: the layer set apart gets its own capture (or none), and every rank prints what sharing off prints
    (on ZeRO-3 and a 2-stage pipeline too, where gradients and boundaries differ)."""
    from fxpar.testing.block_models import one_layer_apart
    from fxpar.testing.error_models import mean_square

    x = (torch.randn(8, 8, generator=torch.Generator().manual_seed(0)),)
    build = functools.partial(one_layer_apart, variant)
    for axes, plan, kw in (({"dp": 2}, fxpar.Plan(zero=3), {}),
                           ({"pp": 2}, fxpar.Plan(stages=2, microbatches=2), {"loss_fn": mean_square})):
        pms = {}
        for on in (True, False):
            with sharing(on, monkeypatch):
                pms[on] = _compile(build, axes, x, plan, **kw)
        captures = pms[True].captures
        if APART[variant] is None:
            assert captures.whole, captures
        else:
            assert (captures.whole, captures.blocks, captures.distinct) == (False, *APART[variant]), captures
        for rank in range(2):
            assert pms[True].program(rank) == pms[False].program(rank), (variant, axes, rank)
            assert pms[True].ledger_table(rank) == pms[False].ledger_table(rank), (variant, axes, rank)


def test_layers_set_apart_train_like_the_single_device() -> None:
    """Hooks on two layers, one frozen, one in eval mode (a block traced on its own; the others draw dropout):
    dp=2 ZeRO-3 on gloo matches the single device (fp32, rtol 1e-5: only the dp mean's reduction order differs)."""
    from fxpar.testing.block_models import one_layer_apart

    x = (torch.randn(8, 8, generator=torch.Generator().manual_seed(0)),)
    assert_equivalent(functools.partial(one_layer_apart, "all"), {"dp": 2}, fxpar.Plan(zero=3), x, steps=2)


def test_a_model_with_its_kv_cache_on_shares_its_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """HF's default ``use_cache=True``: compiling turns the cache off for every trace, the blocks' own included, so a
    block traced once reads the config its calls read (it fell back to the whole-model capture: "reads 'config',
    which changed after its call"). The programs equal the whole capture's; the config is on again after."""
    from fxpar.testing.error_models import qwen2

    built: list[torch.nn.Module] = []

    def build() -> torch.nn.Module:
        built.append(qwen2(layers=3))
        return built[-1]

    tokens = (torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(0)),)
    with sharing(True, monkeypatch):
        on = _compile(build, {"dp": 2, "tp": 2}, tokens, fxpar.Plan(tp="hf"))
    captures = on.captures
    assert (captures.whole, captures.blocks, captures.distinct) == (False, 3, 1), captures
    assert built[0].config.use_cache
    with sharing(False, monkeypatch):
        off = _compile(build, {"dp": 2, "tp": 2}, tokens, fxpar.Plan(tp="hf"))
    for rank in (0, 3):
        assert on.program(rank) == off.program(rank)
        assert on.ledger_table(rank) == off.ledger_table(rank)


def test_sharing_escape_hatch_traces_every_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """``FXPAR_SHARING=0`` captures the whole model and lowers every rank on its own."""
    with sharing(False, monkeypatch):
        pm = _compile(functools.partial(llama, n_layers=3, **SMALL), {"dp": 2, "tp": 2}, TOKENS, llama_plan())
        for r in range(4):
            pm.program(r)
    assert pm.captures.whole
    assert pm._compiled.roles.count() == 0


def test_roles_bind_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks that differ only in their groups share one lowering; each prints its own groups, as if lowered alone."""
    build = functools.partial(llama, n_layers=2, **SMALL)
    with sharing(True, monkeypatch):
        on = _compile(build, {"dp": 2, "tp": 2}, TOKENS, llama_plan())
        texts = {r: on.program(r) + on.ledger_table(r) for r in range(4)}
    assert on._compiled.roles.count() == 1
    assert "tp[2,3]" in texts[3] and "tp[0,1]" not in texts[3]
    # a role keeps its split graphs, not lowering's joint intermediate (a whole extra copy of the layers' nodes)
    assert all(on._compiled.rank_program(r).joint is None for r in range(4))
    with sharing(False, monkeypatch):
        off = _compile(build, {"dp": 2, "tp": 2}, TOKENS, llama_plan())
        assert all(off.program(r) + off.ledger_table(r) == texts[r] for r in range(4))


def test_uneven_shapes_are_their_own_roles() -> None:
    """A tp width that does not divide gives each tp coordinate its own role, and verify simulates all of them."""
    pm = _compile(functools.partial(llama, n_layers=2, **{**SMALL, "intermediate": 66}), {"tp": 4}, TOKENS,
                  llama_plan())
    assert pm._compiled.roles.count() == 4
    assert len(pm.proof.ranks) == 4 and pm.proof.roles == 4


def test_folded_print_names_identical_layers_and_prints_a_differing_one_whole() -> None:
    """``pm.program(rank, verbosity=0)`` folds a run of layers equal to the run's first up to renaming (issue 19's
    option); layer 3, with a wider MLP, is printed whole, and the default print folds nothing."""
    from fxpar.models.llama import MLP, Llama, LlamaConfig

    model = Llama(LlamaConfig(n_layers=6, **SMALL))
    model.layers[3].mlp = MLP(LlamaConfig(n_layers=6, **{**SMALL, "intermediate": 96}))
    pm = fxpar.parallelize(model, fxpar.Mesh({"dp": 2, "tp": 2}, fake=True), TOKENS, plan=fxpar.Plan(tp=llama_plan()))
    full, folded = pm.program(1), pm.program(1, verbosity=0)
    assert "folded" not in full
    forward = folded.split("\ndef backward")[0]
    assert "    # layers.1-2: as layers.0 above, values and parameters renamed (2 blocks folded)" in forward
    assert "    # layers.5: as layers.4 above, values and parameters renamed (1 block folded)" in forward
    assert any("48]" in line and "layers.3.mlp" in line for line in forward.splitlines())  # its 96 / tp shard
    assert "layers.3:" not in folded and "layers.3-" not in folded
    assert len(folded.splitlines()) < len(full.splitlines())


def test_identical_pipeline_stages_are_lowered_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Middle stages that hold identical layers (10 layers on 6 stages: stages 2-4 are stage 1 two, four and six
    layers on) are lowered once, then copied with names and module paths moved (``fxpar.stage_twins``); every
    rank prints and ledgers exactly as with each stage lowered on its own. ``tests/test_pipeline.py``'s
    interleaved case runs such a copy on gloo (its stage 2 is stage 1's, one layer on)."""
    from fxpar import compiled
    from fxpar.testing.error_models import next_token_loss

    lowered: list[int] = []
    real_lower = compiled.lower

    def counting_lower(prog: object, rank: int) -> object:
        lowered.append(prog.notes["stage"].index)
        return real_lower(prog, rank)

    monkeypatch.setattr(compiled, "lower", counting_lower)
    build = functools.partial(llama, n_layers=10, **SMALL)
    tokens = (torch.randint(3, 64, (16, 16), generator=torch.Generator().manual_seed(0)),)
    plan = fxpar.Plan(tp=llama_plan(), sequence_parallel=True, zero=3, stages=6, schedule="interleaved-1f1b",
                      microbatches=4)
    axes = {"pp": 2, "dp": 2, "tp": 2}
    with sharing(True, monkeypatch):
        on = _compile(build, axes, tokens, plan, loss_fn=next_token_loss)
        texts = {r: on.program(r) + on.ledger_table(r) + repr(on.memory(r)) for r in range(8)}
    twins = on._compiled._lowered["twins"]
    assert {t: (s, shift.by) for t, (s, shift) in twins.items()} == {2: (1, 2), 3: (1, 4), 4: (1, 6)}
    assert sorted(set(lowered)) == [0, 1, 5]
    assert "# holds   layers.5-6" in texts[5] and "def forward_stage3(layers_5_attn_norm_weight" in texts[5]
    with sharing(False, monkeypatch):
        off = _compile(build, axes, tokens, plan, loss_fn=next_token_loss)
        assert all(off.program(r) + off.ledger_table(r) + repr(off.memory(r)) == texts[r] for r in range(8))


def test_copied_pipeline_stages_train_like_the_single_device() -> None:
    """10 layers on 6 stages over pp=2 x dp=2 with ZeRO-1: stages 2-4 run stage 1's lowering, renamed (their ZeRO
    shards, once-per-step gathers and gradient reductions included), and match the single device (fp32, rtol
    1e-5). ``test_identical_pipeline_stages_are_lowered_once`` covers ZeRO-3's in-graph gathers."""
    from fxpar.testing.error_models import next_token_loss

    tokens = torch.randint(3, 64, (16, 16), generator=torch.Generator().manual_seed(0))
    plan = fxpar.Plan(zero=1, stages=6, schedule="interleaved-1f1b", microbatches=4)
    assert_equivalent(functools.partial(llama, n_layers=10, **SMALL), {"pp": 2, "dp": 2}, plan, tokens, steps=2,
                      loss_fn=next_token_loss, targets=tokens)


# node meta that records tracing history (object ids, export-wide counters), which nothing downstream reads
TRACING_HISTORY = {"from_node", "torch_fn", "seq_nr"}
COPIED_CAPTURES = [
    ("llama_sp_zero3", functools.partial(llama, n_layers=10, **SMALL), {"pp": 2, "dp": 2, "tp": 2}, TOKENS * 1,
     dict(tp=llama_plan(), sequence_parallel=True, zero=3, stages=6), {2: (1, 2), 3: (1, 4), 4: (1, 6)}),
    ("qwen2_bf16_sp_selective", "qwen2", {"pp": 2, "tp": 2}, None,
     dict(tp="hf", sequence_parallel=True, param_dtype=torch.bfloat16, recompute="selective", stages=4), {2: (1, 2)}),
    ("llama_wide_every_other_layer", functools.partial(mixed.llama_wide_layers, layers=8, **SMALL), {"pp": 2},
     TOKENS * 1, dict(stages=8), {3: (1, 2), 4: (2, 2), 5: (1, 4), 6: (2, 4)}),
]


@pytest.mark.parametrize(("name", "build", "axes", "inputs", "plan", "twins"), COPIED_CAPTURES,
                         ids=[c[0] for c in COPIED_CAPTURES])
def test_copied_stage_captures_equal_a_fresh_capture(name: str, build: object, axes: dict, inputs: object,
                                                     plan: dict, twins: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pipeline stage that is an earlier one over other blocks is not captured: its joint is the earlier stage's
    with paths moved (``fxpar.capture_twins``). Each copy equals a fresh capture of its stage from the same export:
    code, node names, arguments and meta (but tracing history), signature and provenance. A model whose odd layers
    are wider copies stages only by an even number of layers."""
    from fxpar import compiled
    from fxpar.testing.error_models import next_token_loss

    if isinstance(build, str):
        monkeypatch.setattr(hf_families, "LAYERS", 8)
        build, inputs = getattr(hf_families, build), hf_families.inputs(build)
    made: dict[int, tuple[object, ...]] = {}
    checked: dict[int, tuple[int, int]] = {}
    real_capture, real_find, real_copy = compiled.capture_joint, compiled.CaptureTwins.find, compiled.moved_capture

    def capture(gm: object, exported: object, model: object, mesh: object, args: tuple) -> object:
        made["with"] = (exported, model, mesh)
        return real_capture(gm, exported, model, mesh, args)

    def find(self: object, sg: object, args: tuple) -> object:
        made["stage"] = (sg, args)
        return real_find(self, sg, args)

    def copy(prog: object, shift: object, notes: dict) -> object:
        out = real_copy(prog, shift, notes)
        (sg, args), (exported, model, mesh) = made["stage"], made["with"]
        _assert_same_capture(out, real_capture(sg.gm, exported, model, mesh, args).replace(notes=notes))
        checked[sg.index] = (prog.notes["stage"].index, shift.by)
        return out

    monkeypatch.setattr(compiled, "capture_joint", capture)
    monkeypatch.setattr(compiled.CaptureTwins, "find", find)
    monkeypatch.setattr(compiled, "moved_capture", copy)
    pm = _compile(build, axes, inputs, fxpar.Plan(**plan, schedule="interleaved-1f1b", microbatches=2),
                  loss_fn=next_token_loss)
    assert checked == twins
    assert pm.captures.stages_copied == len(twins)


def _assert_same_capture(copy: object, fresh: object) -> None:
    assert copy.gm.code == fresh.gm.code
    assert (copy.signature, copy.provenance, copy.notes) == (fresh.signature, fresh.provenance, fresh.notes)
    for x, y in zip(copy.graph.nodes, fresh.graph.nodes, strict=True):
        assert (x.name, x.op, x.target, str(x.args), str(x.kwargs)) == (y.name, y.op, y.target, str(y.args),
                                                                          str(y.kwargs))
        assert set(x.meta) - TRACING_HISTORY == set(y.meta) - TRACING_HISTORY, x.name
        for key in set(x.meta) - TRACING_HISTORY:
            assert _same_meta(x.meta[key], y.meta[key]), (x.name, key, x.meta[key], y.meta[key])


def _same_meta(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and (a.shape, a.stride(), a.dtype) == (b.shape, b.stride(), b.dtype)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same_meta(x, y) for x, y in zip(a, b, strict=True))
    return a == b or (type(a) is type(b) and str(a) == str(b))  # e.g. two objects for one OpOverload


@pytest.mark.parametrize("family", ["olmo", "qwen2_moe", "bloom"])
def test_names_a_trace_dropped_are_taken_where_it_made_them(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A whole-model trace numbers nodes it then drops as dead code: HF's mask code builds an ``expand`` and an
    ``arange`` nothing reads before the first layer, OLMo's weightless final norm names its backward's unused
    outputs before the last layer's backward. Stitching takes each dropped name where the trace made it (before
    the block's copy, not after it), so every node after it is numbered as in the whole-model capture. A block
    call's unused outputs (BLOOM's layers return one the model drops) are not taken: the whole-model trace has
    no such node."""
    from fxpar.models import hf_families_wide

    build = hf_families_wide.BUILDERS.get(family) or hf_families.builder(family)
    texts = {}
    for on in (True, False):
        with sharing(on, monkeypatch):
            pm = _compile(build, {"dp": 2}, hf_families.inputs("llama"))
            assert pm.captures.whole is not on
            texts[on] = pm.program(1)
    assert texts[True] == texts[False]


def test_a_block_sums_outside_gradients_in_the_whole_model_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """BART's decoder layers read the encoder's output twice (cross-attention keys and values) and its gradient
    already holds the next layer's: the whole-model trace adds each contribution onto that running sum, where
    the block traced alone sums its own two first. Stitching starts the block's sum from the running one
    (``fxpar.grad_accumulation``), so the program, and the rounding of every gradient, is the whole-model one."""
    texts = {}
    for on in (True, False):
        with sharing(on, monkeypatch):
            pm = _compile(hf_families.bart, {"dp": 2}, hf_families.inputs("bart"))
            assert pm.captures.whole is not on
            texts[on] = pm.program(1)
    assert texts[True] == texts[False]


def test_a_blocks_one_contribution_is_added_where_the_whole_model_adds_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """An encoder-decoder whose decoder layers each read the encoder's output once: each layer's contribution to
    its gradient is added onto the running sum right after the op backward that computes it, mid-layer, as the
    whole-model trace adds it (it was added after the layer's whole backward: the same numbers, another program
    and ledger order), on dp=2 with ZeRO-3 and on a 2-stage pipeline."""
    from fxpar.testing.block_models import encoder_decoder
    from fxpar.testing.loss_models import mean_square

    g = torch.Generator().manual_seed(0)
    inputs = (torch.randn(4, 6, 16, generator=g), torch.randn(4, 5, 16, generator=g))
    for axes, plan in (({"dp": 2}, fxpar.Plan(zero=3)), ({"pp": 2}, fxpar.Plan(stages=2, microbatches=2))):
        texts = {}
        for on in (True, False):
            with sharing(on, monkeypatch):
                pm = _compile(encoder_decoder, axes, inputs, plan, loss_fn=mean_square)
                assert pm.captures.whole is not on
                texts[on] = [(pm.program(r, verbosity=2), pm.ledger(r)) for r in range(2)]
        assert texts[True] == texts[False]


def test_a_gradient_in_another_layout_than_the_block_traced_is_captured_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """The blocks' outputs keep a transposed layout, so the block is traced with such a gradient; the last block's
    comes back contiguous from the pooled head. Its graph would copy where the whole-model one views: the model is
    captured whole (the program is the whole-model one), and says why."""
    from fxpar.testing.user_models import patch_encoder

    image = (torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(0)),)
    texts = {}
    for on in (True, False):
        with sharing(on, monkeypatch):
            pm = _compile(patch_encoder, {"dp": 2}, image)
            texts[on] = pm.program(0)
    assert texts[True] == texts[False]
    assert "memory layout" in pm_reason(_compile(patch_encoder, {"dp": 2}, image))


def test_mixed_precision_blocks_reading_a_childs_weight_are_shared_as_traced_whole(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``nn.MultiheadAttention`` blocks under bf16: the weight it reads off its ``out_proj`` is cast on read, also
    while the block's state is taken off it for the model's export; the shared program is the whole-model one."""
    from fxpar.testing.user_models import AttentionEncoder

    tokens = (torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(0)),)
    plan = fxpar.Plan(zero=3, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    texts = {}
    for on in (True, False):
        with sharing(on, monkeypatch):
            pm = _compile(functools.partial(AttentionEncoder, layers=3), {"dp": 2}, tokens, plan)
            assert pm.captures.whole is not on, pm_reason(pm)
            texts[on] = pm.program(1)
    assert texts[True] == texts[False]


def pm_reason(pm: fxpar.ParallelModule) -> str:
    return pm.captures.reason


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA mesh is traced on CUDA's kernels: needs a GPU")
@pytest.mark.parametrize(("family", "plan"), [("llama", None), ("qwen2", fxpar.Plan(tp="hf", sequence_parallel=True)),
                                              ("qwen2", fxpar.Plan(param_dtype=torch.bfloat16))])
def test_blocks_are_shared_on_a_cuda_mesh(family: str, plan: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CUDA mesh a block is traced on CUDA tensors like the rest of the model (its inputs were once made on the
    CPU, so every CUDA mesh fell back to the whole-model capture), and the programs equal the whole capture's."""
    axes = {"dp": 2, "tp": 2} if plan is not None and plan.tp else {"dp": 2}

    def compiled() -> fxpar.ParallelModule:
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", fxpar.FxparWarning)
            return fxpar.parallelize(hf_families.builder(family)(), fxpar.Mesh(axes, device="cuda", fake=True),
                                     hf_families.inputs(family), plan=plan)

    with sharing(True, monkeypatch):
        on = compiled()
    assert not on.captures.whole, on.captures
    with sharing(False, monkeypatch):
        off = compiled()
    for rank in (0, on._compiled.mesh.size - 1):
        assert on.program(rank) == off.program(rank)
        assert on.ledger_table(rank) == off.ledger_table(rank)


class _GatedBlock(torch.nn.Module):
    """A block with a frozen parameter and a buffer of its own."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(width, width)
        self.gain = torch.nn.Parameter(torch.linspace(0.5, 1.5, width), requires_grad=False)
        self.register_buffer("offset", torch.linspace(-1.0, 1.0, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.proj(x) * self.gain + self.offset)


class _GatedStack(torch.nn.Module):
    """``embed=False``: the first block reads the input, which needs no gradient (only the blocks' own parameters
    make autograd differentiate the calls)."""

    def __init__(self, width: int = 6, layers: int = 4, embed: bool = True) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(6, width) if embed else torch.nn.Identity()
        self.layers = torch.nn.ModuleList(_GatedBlock(width) for _ in range(layers))
        self.head = torch.nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class _GatedStackFirstTwice(_GatedStack):
    """Calls its first block again after the others: that block's parameters get two gradient contributions."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.layers[0](x))


class _GatedStackReadsABias(_GatedStack):
    """Reads its last block's bias outside the blocks, with a default (as code probing optional state does)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = getattr(self.layers[-1].proj, "bias", None)
        return super().forward(x) + (bias.sum() if bias is not None else 0.0)


class _GatedStackWithSpareState(_GatedStack):
    """Holds a parameter and a buffer its forward never reads (as Qwen2's rotary table holds ``original_inv_freq``):
    a pipeline stage holds them (``fxpar.stage_state``)."""

    def __init__(self) -> None:
        super().__init__()
        self.spare = torch.nn.Parameter(torch.ones(5))
        self.register_buffer("unread", torch.zeros(3), persistent=False)


def _square_loss(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return (out - x[:, :3]).pow(2).mean()


@pytest.mark.parametrize(("axes", "embed"), [({"dp": 2}, True), ({"dp": 2}, False), ({"pp": 2}, True)],
                         ids=["dp2", "dp2_input_needs_no_grad", "pp2"])
def test_block_state_is_traced_outside_the_model_and_put_back(axes: dict, embed: bool,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The model's own joint trace leaves out what only one block call reads (its parameters, frozen or not, and
    its buffers, but for one parameter that needs a gradient: the call's backward must still be traced) and puts
    them back where a trace with them gives them: placeholders, gradients, names and every program are the
    whole-model capture's."""
    import fxpar.capture as capture

    stripped = []
    strip = capture._stripped
    monkeypatch.setattr(capture, "_stripped", lambda *a: stripped.append(strip(*a)) or stripped[-1])
    inputs = (torch.randn(4, 6, generator=torch.Generator().manual_seed(0)),)
    texts = {}
    for on in (True, False):
        with sharing(on, monkeypatch):
            pm = _compile(functools.partial(_GatedStack, embed=embed), axes, inputs, loss_fn=_square_loss)
            assert pm.captures.whole is not on
            texts[on] = [pm.program(r) + pm.ledger_table(r) + str(pm.memory(r)) for r in range(2)]
    stripped = [s for s in stripped if s is not None]  # (sharing off: no blocks, nothing to strip)
    assert sum(len(s.hidden) for s in stripped) == 4 * 3  # proj.bias, gain, offset of each layer
    # what AOTAutograd traced holds only each layer's token (on one mesh the export never saw the rest, on the
    # pipeline the stage's split graph drops it)
    assert sorted(n for s in stripped for n, _ in (*s.module.named_parameters(), *s.module.named_buffers())
                  if n.startswith("layers.")) == [f"layers.{i}.proj.weight" for i in range(4)]
    assert "layers_3_offset: f32[6]" in "".join(texts[True]) and texts[True] == texts[False]


@pytest.mark.parametrize("build", [_GatedStackFirstTwice, _GatedStackReadsABias], ids=["called_twice", "read_outside"])
def test_block_state_used_outside_one_call_stays_in_the_trace(build: type, monkeypatch: pytest.MonkeyPatch) -> None:
    """A block called twice sums its parameters' gradients over the calls, and code outside the blocks may read a
    block's parameter (here with a default, which would read nothing while the state is off the block): only a
    trace that holds the state gets either right, so the model is captured whole, and the program is the
    whole-model capture's (neither was while the export left the state out)."""
    inputs = (torch.randn(4, 6, generator=torch.Generator().manual_seed(0)),)
    texts = {}
    for on in (True, False):
        with sharing(on, monkeypatch):
            texts[on] = _compile(build, {"dp": 2}, inputs, loss_fn=_square_loss).program(0)
    assert texts[True] == texts[False]


def test_state_a_stage_holds_but_never_reads_stays_on_it_with_blocks_shared(monkeypatch: pytest.MonkeyPatch) -> None:
    """Taking the blocks' state off a stage's graph copied only the attributes its graph reads: the stage's unread
    parameter and buffer were dropped, so its program lacked their inputs and ``pm.state_dict()`` the parameter
    (found on Qwen2 at its defaults, whose rotary table holds an unread ``original_inv_freq``)."""
    inputs = (torch.randn(4, 6, generator=torch.Generator().manual_seed(0)),)
    texts, states = {}, {}
    for on in (True, False):
        with sharing(on, monkeypatch):
            pm = _compile(_GatedStackWithSpareState, {"pp": 2}, inputs, fxpar.Plan(stages=2, microbatches=2),
                          loss_fn=_square_loss, example_targets=inputs[0])
            assert pm.captures.whole is not on
            texts[on] = [pm.program(r) + pm.ledger_table(r) + str(pm.memory(r)) for r in range(2)]
            states[on] = {fqn for p in pm._compiled.stages for fqn, _ in (*p.signature.params, *p.signature.buffers)}
    assert {"spare", "unread"} <= states[True] == states[False]
    assert texts[True] == texts[False]
