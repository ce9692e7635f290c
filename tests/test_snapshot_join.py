"""A snapshot of another layout joined back into full tensors (ldt.storage.snapshot_parts,
ldt.training.snapshot_join): which step and which parts are chosen, by hand; the stage's full
tensors from TP shards and distributed-optimizer spans cut by hand from known tensors; and a
2-rank gloo world whose hosts hold different parts, one sent across to the rank that joins.
The whole path through ldt-train (a killed run continuing in another layout) is
tests/test_checkpoint.py::test_a_killed_run_continues_from_its_snapshot_in_another_layout.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from ldt.launch.local import run_local_world
from ldt.storage import snapshot_files
from ldt.storage.checkpoint_files import CheckpointError
from ldt.storage.snapshot_parts import META_FILE, Held, StageJoin, choose, held_here, unjoinable
from ldt.training.flat_state import FlatState
from ldt.storage.snapshot_parts import STATE_FILE
from ldt.training.snapshot_join import join_stage

PROJ = "decoder.layers.0.self_attention.linear_proj.weight"  # split along dim 1
NORM = "decoder.layers.0.input_layernorm.weight"  # not split
FC1 = "decoder.layers.0.mlp.linear_fc1.weight"  # gated: [gate; up], each half split


def held(holder, rank, stage, tp_rank=0, tp=1, dp_rank=0, dp=1, step=5, layout=7, sharded=0,
         ep=1, world=4, stages=2):
    return Held(holder, layout, step, rank, world, stages, stage, tp, tp_rank, dp, dp_rank,
                ep, sharded)


# ---- choose: pure data ---------------------------------------------------------------------
def test_the_newest_step_whose_every_stage_can_be_joined():
    old = [held(0, 0, 0), held(0, 1, 1, 0, 2), held(1, 2, 1, 1, 2)]
    newer = [held(0, 0, 0, step=6), held(0, 1, 1, 0, 2, step=6)]  # rank 2's step 6 is lost
    choice = choose(old + newer, after=-1, steps=100)
    assert (choice.step, choice.layout) == (5, 7)
    # stage 1: one part on each holder, joined on the lower one, the other part sent to it
    assert choice.joins == (StageJoin(0, 0, ((0, 0),)), StageJoin(1, 0, ((1, 0), (2, 1))))
    assert choose(old + newer, after=5, steps=100) is None  # not newer than the checkpoint
    assert choose(old, after=-1, steps=6) is None  # step 5 is the last of 6: none left
    assert choose(old[:2], after=-1, steps=100) is None  # a TP rank missing
    # what a run that starts older says it leaves behind: the newest one, and why
    assert unjoinable(old[:2], after=-1, steps=100) == (
        "the snapshot of step 5 in host memory (layout 000000000007) cannot be joined: no host "
        "holds any part of its stage 1's TP rank 1 (its host is gone, no copy)")
    assert unjoinable(old[:2], after=5, steps=100) is None  # none newer than the checkpoint
    assert unjoinable(old + newer, after=-1, steps=100).startswith("the snapshot of step 6")
    assert "stage 0 (its host" in unjoinable(old[1:], after=-1, steps=100)


def test_a_replica_stands_in_unless_the_optimizer_is_sharded():
    # stage 1: DP 2 x TP 1 on ranks 1 and 2; rank 1's part is lost
    replicated = [held(0, 0, 0), held(1, 2, 1, dp_rank=1, dp=2)]
    assert choose(replicated, -1, 100).joins[1] == StageJoin(1, 1, ((2, 1),))
    sharded = [held(0, 0, 0, sharded=1), held(1, 2, 1, dp_rank=1, dp=2, sharded=1)]
    assert choose(sharded, -1, 100) is None  # each DP rank holds a span of its own
    assert unjoinable(sharded, -1, 100).endswith(
        "no host holds every DP rank part of its stage 1's TP rank 0 (the distributed "
        "optimizer shards it over 2) (its host is gone, no copy)")
    both = sharded + [held(0, 1, 1, dp_rank=0, dp=2, sharded=1)]
    assert choose(both, -1, 100).joins[1] == StageJoin(1, 0, ((1, 0), (2, 1)))


def test_parts_held_where_the_stage_is_joined_are_not_sent():
    # every part of stage 1 on both holders (one host's copies and the other's own)
    parts = [held(h, r, 1, r - 1, 2, stages=2) for h in (0, 1) for r in (1, 2)]
    parts += [held(1, 0, 0)]
    choice = choose(parts, -1, 100)
    assert choice.joins == (StageJoin(0, 1, ((0, 1),)), StageJoin(1, 0, ((1, 0), (2, 0))))


def test_expert_parallel_stages_are_joined_like_any_other():
    # stage 1: TP 2 with ep 2, one block of experts on each TP rank: both parts needed
    parts = [held(0, 0, 0), held(0, 1, 1, 0, 2, ep=2), held(1, 2, 1, 1, 2, ep=2)]
    assert choose(parts, -1, 100).joins[1] == StageJoin(1, 0, ((1, 0), (2, 1)))
    assert choose(parts[:2], -1, 100) is None  # the other block's part is gone
    assert unjoinable(parts[:2], -1, 100).endswith(
        "no host holds any part of its stage 1's TP rank 1 (its host is gone, no copy)")


# ---- join_stage: shards and spans cut by hand ----------------------------------------------
def _parts(full: dict, moments: dict, tp: int, dp: int, gated: bool = False):
    """The parts a TP ``tp`` x DP ``dp`` stage with the distributed optimizer would hold,
    cut by hand: TP shards by torch.chunk along each tensor's split dimension, then each
    shard's flat elements in ``dp`` consecutive spans."""
    def cut(name, tensor, t):
        if name == NORM:
            return tensor
        if name == FC1:  # each half on its own
            return torch.cat([h.chunk(tp, 0)[t] for h in tensor.chunk(2, 0)])
        return tensor.chunk(tp, 1)[t]

    out = []
    for t in range(tp):
        for d in range(dp):
            meta = {"tp": tp, "tp_rank": t, "dp_rank": d, "gated": int(gated), "sharded": 1,
                    "spans": {}, "aliases": {"output_layer.weight": NORM}}
            state = {}
            for name, tensor in full.items():
                shard = cut(name, tensor, t)
                state[f"model.{name}"] = shard
                n = shard.numel()
                start, end = n * d // dp, n * (d + 1) // dp
                if end > start:
                    meta["spans"][name] = [start, end]
                    moment = cut(name, moments[name], t).reshape(-1)
                    state[f"optim.{name}.exp_avg"] = moment[start:end]
                    state[f"optim.{name}.step"] = torch.tensor(3.0)
            out.append((meta, state))
    return out


@pytest.mark.parametrize("tp,dp", [(1, 1), (2, 1), (2, 3), (4, 2)])
def test_a_stage_is_joined_into_the_tensors_it_was_cut_from(tp, dp):
    gen = torch.Generator().manual_seed(tp * 10 + dp)
    full = {PROJ: torch.randn(8, 12, generator=gen), NORM: torch.randn(5, generator=gen),
            FC1: torch.randn(16, 8, generator=gen)}
    moments = {k: torch.randn(v.shape, generator=gen) for k, v in full.items()}
    model, optim = join_stage(_parts(full, moments, tp, dp, gated=True))
    assert set(model) == {*full, "output_layer.weight"}
    for name in full:
        assert torch.equal(model[name], full[name]), name
        assert torch.equal(optim[name]["exp_avg"], moments[name]), name
        assert float(optim[name]["step"]) == 3.0
    assert model["output_layer.weight"] is model[NORM]  # the tied head under its own name


EXPERT = "decoder.layers.0.mlp.experts.local_experts.{}.linear_fc{}.weight"


def _expert_parts(full: dict, moments: dict, tp: int, ep: int, dp: int, experts: int):
    """The parts of a TP ``tp`` x DP ``dp`` stage with expert parallelism ``ep``, cut by hand
    as megatron lays experts out: TP rank t is expert-parallel rank t // (tp / ep), which
    holds experts k * experts / ep on, each split over the tp / ep ranks of its block
    (fc1 along rows, gated halves alone; fc2 along columns), under its global number; the
    rest split over all tp ranks. Each tensor's flat elements then in ``dp`` spans."""
    etp = tp // ep

    def pieces(name, tensor, t):
        if ".local_experts." not in name:
            return tensor.chunk(tp, 1)[t]  # PROJ
        j = t % etp
        if name.endswith("fc1.weight"):
            return torch.cat([h.chunk(etp, 0)[j] for h in tensor.chunk(2, 0)])
        return tensor.chunk(etp, 1)[j]

    out = []
    for t in range(tp):
        block = range(t // etp * experts // ep, (t // etp + 1) * experts // ep)
        mine = [PROJ] + [EXPERT.format(e, i) for e in block for i in (1, 2)]
        for d in range(dp):
            meta = {"tp": tp, "tp_rank": t, "dp_rank": d, "gated": 1, "sharded": 1,
                    "spans": {}}
            state = {}
            for name in mine:
                shard = pieces(name, full[name], t)
                state[f"model.{name}"] = shard
                n = shard.numel()
                start, end = n * d // dp, n * (d + 1) // dp
                meta["spans"][name] = [start, end]
                state[f"optim.{name}.exp_avg"] = pieces(name, moments[name], t).reshape(-1)[
                    start:end]
                state[f"optim.{name}.step"] = torch.tensor(3.0)
            out.append((meta, state))
    return out


@pytest.mark.parametrize("tp,ep,dp", [(2, 2, 1), (4, 2, 2), (4, 4, 1)])
def test_an_expert_parallel_stage_is_joined_into_the_tensors_it_was_cut_from(tp, ep, dp):
    experts = 4
    gen = torch.Generator().manual_seed(tp * 100 + ep * 10 + dp)
    full = {PROJ: torch.randn(8, 12, generator=gen)}
    for e in range(experts):
        full[EXPERT.format(e, 1)] = torch.randn(16, 8, generator=gen)
        full[EXPERT.format(e, 2)] = torch.randn(8, 8, generator=gen)
    moments = {k: torch.randn(v.shape, generator=gen) for k, v in full.items()}
    model, optim = join_stage(_expert_parts(full, moments, tp, ep, dp, experts))
    assert set(model) == set(full) == set(optim)
    for name in full:
        assert torch.equal(model[name], full[name]), name
        assert torch.equal(optim[name]["exp_avg"], moments[name]), name


# ---- a world whose hosts hold different parts ----------------------------------------------
def _write_part(snapshot_dir, run_dir, layout_text, step, meta, tensors, copy=False):
    root = snapshot_files.snapshot_root(snapshot_dir, run_dir, layout_text)
    if copy:  # kept for a rank of another host
        root = snapshot_files.copies_root(root)

    flat = FlatState(tensors)
    flat.fill(tensors)
    snapshot_files.write(root, step, snapshot_files.part_name(meta["rank"]),
                         {STATE_FILE: flat.bytes(),
                          META_FILE: json.dumps({**meta, "index": flat.index}).encode()})


def test_a_damaged_own_part_is_passed_over_for_its_whole_copy(tmp_path):
    """A host may keep a rank's own part and a copy of it (a shared snapshot_dir): the part
    the join reads is one that verifies, as held_here counted, not a damaged own one."""
    from ldt.storage.snapshot_parts import part_folder

    run_dir, shm = str(tmp_path / "run"), str(tmp_path / "shm")
    os.makedirs(run_dir)
    for copy in (False, True):
        _write_part(shm, run_dir, "layout", 5, ONE_RANK, {f"model.{NORM}": torch.ones(4)},
                    copy=copy)
    (held,) = {(h.layout, h.step) for h in held_here(shm, run_dir, 0)}
    own = part_folder(shm, run_dir, *held, rank=0)
    assert "copies" not in own
    with open(os.path.join(own, STATE_FILE), "r+b") as f:  # one byte changed
        first = f.read(1)
        f.seek(0)
        f.write(bytes([first[0] ^ 0xFF]))
    assert len(held_here(shm, run_dir, 0)) == 1  # the copy alone verifies
    assert part_folder(shm, run_dir, *held, rank=0) != own


def _join_world(rank, world_size, run_dir, dirs):
    import torch.distributed as dist

    from ldt.training.snapshot_join import join_newest

    found = join_newest(dirs[rank], run_dir, after=-1, steps=100, model=None,
                        info={"steps": 100}, keep_last=0, origin=None)
    return found, len(held_here(dirs[rank], run_dir, dist.get_rank()))


@pytest.mark.timeout(120)
def test_a_part_on_another_host_is_sent_to_the_rank_that_joins(tmp_path):
    """Old layout: stage 0 (TP 1, old rank 0), stage 1 (TP 2, old ranks 1 and 2). Host 0
    holds old ranks 0 and 2 (2's as a copy, in its copies folder), host 1 old rank 1: stage 1 is joined
    on rank 0 with rank 1's part sent over, and the checkpoint holds the full tensors."""
    from ldt.storage import checkpoint_files as files
    from ldt.training.checkpoint import _read_part

    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir)
    dirs = [str(tmp_path / "host0"), str(tmp_path / "host1")]
    for d in dirs:
        os.makedirs(d)
    gen = torch.Generator().manual_seed(0)
    proj, norm = torch.randn(4, 6, generator=gen), torch.randn(4, generator=gen)
    first = torch.randn(3, 3, generator=gen)
    base = {"world": 3, "stages": 2, "dp": 1, "dp_rank": 0, "ep": 1, "sharded": 0,
            "gated": 0, "spans": {}, "aliases": {}, "optimizer": "sgd"}
    first_layer = "decoder.layers.1.self_attention.linear_proj.weight"
    _write_part(dirs[0], run_dir, "old", 5, {**base, "rank": 0, "stage": 0, "tp": 1,
                                             "tp_rank": 0}, {f"model.{first_layer}": first})
    for rank, host in ((1, 1), (2, 0)):
        tensors = {f"model.{PROJ}": proj.chunk(2, 1)[rank - 1], f"model.{NORM}": norm}
        _write_part(dirs[host], run_dir, "old", 5, {**base, "rank": rank, "stage": 1, "tp": 2,
                                                    "tp_rank": rank - 1}, tensors, copy=host == 0)
    results = run_local_world(2, _join_world, (run_dir, dirs), timeout_s=90)
    found = files.step_dir(run_dir, 5)
    assert results == [(found, 2), (found, 1)]
    files.verify(found)  # sealed, every checksum right
    assert files.read_info(found)["optimizer"] == "sgd"  # its parts' state is SGD's
    read = {}
    for part in files.parts(found):
        sd = _read_part(found, part, {PROJ: None, NORM: None, first_layer: None}, (), True,
                        "train.resume")
        read.update(sd["model"])
    assert torch.equal(read[PROJ], proj) and torch.equal(read[NORM], norm)
    assert torch.equal(read[first_layer], first)


def test_the_run_counters_cross_the_join_as_the_part_holds_them():
    """A joined checkpoint's run_state is what the parts hold, whichever rank joins a stage
    (the all-reduce's MAX over ranks with and without a part): fp16's hysteresis count is
    below 0 after repeated overflows, and a key no part holds stays absent."""
    from ldt.training.snapshot import run_tensors
    from ldt.training.snapshot_join import run_state_from, run_vector

    counters = {"lr_steps": 3, "loss_scale": 131072.0, "growth_tracker": 0,
                "hysteresis_tracker": -2}
    holder = run_vector({1: [({}, {"step": torch.tensor(2), **run_tensors(counters)})]})
    other = run_vector({})  # a rank that joins no stage (rank 0 seals the checkpoint)
    assert run_state_from(torch.maximum(holder, other)) == counters
    bf16 = run_vector({0: [({}, run_tensors({"lr_steps": 4}))]})  # no loss scale
    assert run_state_from(torch.maximum(bf16, other)) == {"lr_steps": 4}


# ---- the optimizer that wrote a snapshot ---------------------------------------------------
ONE_RANK = {"rank": 0, "world": 1, "stages": 1, "stage": 0, "tp": 1, "tp_rank": 0, "dp": 1,
            "dp_rank": 0, "ep": 1, "sharded": 0, "gated": 0, "spans": {}, "aliases": {}}
"""The meta of the one part of a one-rank layout's snapshot (no optimizer named)."""


def test_a_snapshot_names_the_optimizer_that_wrote_it(tmp_path):
    """A part's meta names its optimizer; it crosses between ranks as a number in Held, and
    the choice says it (None for parts of an earlier ldt, which name none)."""
    from ldt.storage.snapshot_parts import OPTIMIZERS, check_optimizer

    run_dir, shm = str(tmp_path / "run"), str(tmp_path / "shm")
    os.makedirs(run_dir)
    _write_part(shm, run_dir, "sgd run", 5, {**ONE_RANK, "optimizer": "sgd"},
                {f"model.{NORM}": torch.ones(4)})
    _write_part(shm, run_dir, "older ldt", 6, ONE_RANK, {f"model.{NORM}": torch.ones(4)})
    found = held_here(shm, run_dir, 0)
    assert sorted(h.optimizer for h in found) == [-1, OPTIMIZERS.index("sgd")]
    assert choose(found, after=-1, steps=100).optimizer is None  # step 6's: unknown
    assert choose(found, after=-1, steps=7).optimizer == "sgd"  # step 5's
    check_optimizer(None, "adam", "an older snapshot")  # unknown: accepted
    check_optimizer("sgd", "sgd", "a snapshot")
    with pytest.raises(CheckpointError, match="train.optimizer is adam, which keeps other state: "
                                              "resume with train/optimizer=sgd"):
        check_optimizer("sgd", "adam", "a snapshot")


def test_a_snapshot_of_another_optimizer_is_not_joined(tmp_path):
    """join_newest (a world of one rank, in this process) refuses to join an Adam run's
    snapshot into a checkpoint of an SGD run, which would drop its moments without a word,
    and writes nothing."""
    import torch.distributed as dist

    from ldt.storage import checkpoint_files as files
    from ldt.training.snapshot_join import join_newest

    run_dir, shm = str(tmp_path / "run"), str(tmp_path / "shm")
    os.makedirs(run_dir)
    _write_part(shm, run_dir, "adam run", 5, {**ONE_RANK, "optimizer": "adam"},
                {f"model.{NORM}": torch.ones(4)})
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(CheckpointError, match=r"the snapshot of step 5 in host memory "
                           r"\(layout \w+, under .*\) was written by a train/optimizer=adam run, "
                           "and this run's train.optimizer is sgd"):
            join_newest(shm, run_dir, after=-1, steps=100, model=None,
                        info={"steps": 100, "optimizer": "sgd"}, keep_last=0, origin=None)
    finally:
        dist.destroy_process_group()
    assert not os.path.exists(files.step_dir(run_dir, 5))
