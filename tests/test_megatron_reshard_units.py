"""In-process checks of the torch layout's resharding pieces (easyckpt/megatron/reshard_torch.py): the
sharding map read from storage is validated field by field, saved blocks are cut and joined exactly, a
gap is an error, and the files a resume reads (or the refusal) follow from the manifest. The end-to-end
runs on real Megatron models are in tests/test_megatron_reshard.py."""
from __future__ import annotations

import pytest
import torch

from easyckpt.errors import CheckpointError, EasyCkptError
from easyckpt.megatron import reshard_torch as rt
from easyckpt.megatron.torchdist import changed


def entry(key, shape, offset, sizes, first=0, rows=-1, loose=False):
    return [key, list(shape), list(offset), list(sizes), first, rows, loose]


def test_blocks_saved_on_two_tp_ranks_fill_one_rank_and_one_rank_fills_two():
    whole = torch.arange(24, dtype=torch.float32).view(6, 4)
    pieces = rt.Pieces()
    pieces.add("model", whole[:3].clone(), [entry("w", (6, 4), (0, 0), (3, 4))], "tp0")
    pieces.add("model", whole[3:].clone(), [entry("w", (6, 4), (3, 0), (3, 4))], "tp1")
    dst = torch.zeros(6, 4)
    pieces.fill("model", dst, [entry("w", (6, 4), (0, 0), (6, 4))], "w")
    assert torch.equal(dst, whole)
    # the other way, split along the other axis
    one = rt.Pieces()
    one.add("model", whole.clone(), [entry("w", (6, 4), (0, 0), (6, 4))], "tp0")
    half = torch.zeros(6, 2)
    one.fill("model", half, [entry("w", (6, 4), (0, 2), (6, 2))], "w")
    assert torch.equal(half, whole[:, 2:])


def test_rows_of_one_local_tensor_under_two_keys_and_prepended_axes():
    # SwiGLU: Megatron splits fc1's local weight into two keys, each a run of rows; a layer axis prepended
    local = torch.arange(16, dtype=torch.float32).view(4, 4)
    pieces = rt.Pieces()
    pieces.add("model", local, [entry("w", (2, 2, 4), (0, 0, 0), (1, 2, 4), 0, 2),
                                entry("v", (2, 2, 4), (0, 0, 0), (1, 2, 4), 2, 2)], "fc1")
    dst = torch.zeros(4, 4)
    pieces.fill("model", dst, [entry("w", (2, 2, 4), (0, 0, 0), (1, 2, 4), 0, 2),
                               entry("v", (2, 2, 4), (0, 0, 0), (1, 2, 4), 2, 2)], "fc1")
    assert torch.equal(dst, local)


def test_a_gap_or_a_changed_shape_is_an_error_and_a_padded_vocabulary_may_grow():
    pieces = rt.Pieces()
    pieces.add("model", torch.ones(3, 4), [entry("w", (6, 4), (0, 0), (3, 4))], "tp0")
    with pytest.raises(CheckpointError, match="do not cover"):
        pieces.fill("model", torch.zeros(6, 4), [entry("w", (6, 4), (0, 0), (6, 4))], "w")
    with pytest.raises(CheckpointError, match="global shape"):
        pieces.fill("model", torch.zeros(8, 4), [entry("w", (8, 4), (0, 0), (8, 4))], "w")
    with pytest.raises(CheckpointError, match="no exp_avg"):
        pieces.fill("exp_avg", torch.zeros(3, 4), [entry("w", (6, 4), (0, 0), (3, 4))], "w")
    vocab = rt.Pieces()
    vocab.add("model", torch.ones(6, 4), [entry("e", (6, 4), (0, 0), (6, 4), loose=True)], "tp0")
    dst = torch.full((8, 4), 7.0)
    vocab.fill("model", dst, [entry("e", (8, 4), (0, 0), (8, 4), loose=True)], "e")
    assert torch.equal(dst[:6], torch.ones(6, 4)) and torch.equal(dst[6:], torch.full((2, 4), 7.0))


def test_a_block_that_does_not_fit_its_tensor_is_an_error():
    pieces = rt.Pieces()
    with pytest.raises(CheckpointError, match="does not hold"):
        pieces.add("model", torch.ones(3, 4), [entry("w", (6, 4), (0, 0), (4, 4))], "tp0")


def good_map():
    return {"version": rt.VERSION, "layout": "tp2.pp1.dp1.vp1.ep1",
            "tensors": {"model/w": [entry("w", (6, 4), (0, 0), (3, 4))]}, "params": {"0.w": "model/w"},
            "opt_params": [["0.w"]]}


@pytest.mark.parametrize("damage", [
    lambda m: m.update(version=2),
    lambda m: m.update(tensors=[]),
    lambda m: m["tensors"].update({"w": [entry("w", (6, 4), (0, 0), (3, 4))]}),          # no "model/" part
    lambda m: m["tensors"]["model/w"][0].__setitem__(2, [5, 0]),                          # outside the shape
    lambda m: m["tensors"]["model/w"][0].__setitem__(1, [6]),                             # ranks disagree
    lambda m: m["tensors"]["model/w"][0].__setitem__(4, "0"),
    lambda m: m["tensors"]["model/w"][0].__setitem__(5, -2),
    lambda m: m["tensors"]["model/w"][0].__setitem__(1, [6, -4]),
    lambda m: m.update(params={"0.w": "model/other"}),
    lambda m: m.update(opt_params=[["0.x"]]),
])
def test_a_damaged_sharding_map_is_refused_before_use(damage):
    assert rt._checked(good_map(), "m") is not None
    bad = good_map()
    damage(bad)
    with pytest.raises(CheckpointError):
        rt._checked(bad, "mp_rank_00/" + rt.SHARDMAP)


NONE = {"tensors": {}}     # a rank's own sharding map, with nothing in it (which files, not which tensors)


def manifest(*files):
    from easyckpt.formats.manifest import FileEntry, build
    return build(10, "job", "megatron", 2, {f: FileEntry(1, "00") for f in files})


def test_the_files_a_resume_on_other_tp_sizes_reads_or_the_refusal():
    files = ["mp_rank_00/model_optim_rng.pt", "mp_rank_01/model_optim_rng.pt", f"mp_rank_00/{rt.SHARDMAP}",
             f"mp_rank_01/{rt.SHARDMAP}", "mp_rank_00/distrib_optim_dp000.pt", "mp_rank_01/distrib_optim_dp000.pt",
             "easyckpt_rng/rank_00000.safetensors"]
    got = [rel for rel, _ in rt.needed(manifest(*files), "tp2.pp1.dp1.vp1.ep1", "tp1.pp1.dp2.vp1.ep1", 10, NONE)]
    assert sorted(got) == sorted(f for f in files if not f.startswith("easyckpt_rng"))
    with pytest.raises(EasyCkptError, match="without easyckpt's sharding map"):
        rt.needed(manifest(*files[:3]), "tp2.pp1.dp1.vp1.ep1", "tp1.pp1.dp2.vp1.ep1", 10, NONE)
    # with the experts split over EP ranks (and pipeline stages): every EP rank's directory
    ep = [f"mp_rank_00_00{p}_00{e}/{name}" for p in (0, 1) for e in (0, 1)
          for name in ("model_optim_rng.pt", rt.SHARDMAP, f"distrib_optim_dp00{e}.pt")]
    got = [rel for rel, _ in rt.needed(manifest(*ep), "tp1.pp2.dp2.vp1.ep2", "tp1.pp1.dp4.vp1.ep1", 10, NONE)]
    assert sorted(got) == sorted(ep)
    assert rt.expert_split("tp1.pp2.dp2.vp1.ep2") and not rt.expert_split("tp2.pp1.dp1.vp1.ep1")
    assert changed("tp2.pp1.dp1.vp1.ep1", "tp1.pp1.dp2.vp1.ep1") == ["tp", "dp"]
    assert changed("tp1.pp1.dp2.vp1.ep2", "tp1.pp1.dp2.vp1.ep1") == ["ep"]
