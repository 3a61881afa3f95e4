"""The rules of a memory-backed reshard (engine/load/reshardplan.py, and its tier in agree.py), in-process: which
run's snapshots make a step whole across the nodes' memory, that no mix of steps or runs is ever built, the
manifest a restore's ``needed`` reads, and which slot each rank receives from which. The reshard itself, on
simulated nodes with real torchrun jobs, is in tests/test_many_nodes.py."""
from __future__ import annotations

import os
from typing import Dict, List, Optional, Sequence, Tuple

import pytest

from easyckpt.engine.load import agree, reshardplan
from easyckpt.engine.load.held import Held

RUN = "a1b2c3d4e5f60718"


def held(rank: int, step: int, replica: bool = False, world: int = 4, run: str = RUN,
         files: Optional[Sequence[Tuple[str, bool]]] = None) -> Held:
    if files is None:
        files = [("model.pt", rank == 0), ("optim.pt", rank == 0), (f"rank_{rank}.pt", True)]
    return Held(f"/dev/shm/slot-{rank}-{int(replica)}", rank, replica, step, world, None, 1000 + rank, 2000 + rank,
                tuple(files), (("run_id", run), ("rank_said", rank)))


def four_on_three(step: int = 14) -> List[reshardplan.View]:
    """Nodes 0-2 of a 4-node job whose node 3 was lost (replicas on the next node): one new rank per node."""
    return [("node0", [held(0, step), held(3, step, replica=True)]),
            ("node1", [held(1, step), held(0, step, replica=True)]),
            ("node2", [held(2, step), held(1, step, replica=True)])]


def test_a_step_the_nodes_hold_whole_is_planned_with_own_slots_before_replicas():
    plan = reshardplan.whole(14, four_on_three())
    assert isinstance(plan, reshardplan.Whole)
    assert (plan.world_size, plan.step) == (4, 14)
    assert [(k, h.replica) for k, h in plan.holders[0]] == [("node0", False), ("node1", True)]
    assert plan.nodes() == (3, 1)
    assert plan.owner == {"model.pt": 0, "optim.pt": 0, "rank_0.pt": 0, "rank_1.pt": 1, "rank_2.pt": 2,
                          "rank_3.pt": 3}
    man = plan.manifest("0123456789ab", "pytorch")
    assert man.world_size == 4 and man.step == 14 and set(man.files) == set(plan.owner)
    assert man.info["rank_said"] == 0, "rank 0's info wins, as the commit merges it"


def test_a_rank_in_no_nodes_memory_is_named():
    views = four_on_three()
    views[0] = ("node0", [held(0, 14)])            # node 3's replica was lost with node 0's memory
    assert reshardplan.whole(14, views) == "rank(s) [3] of its 4-rank run are in no node's memory"


def test_slots_of_another_step_never_join_the_plan():
    """Rank 1's node and its replica hold only step 12: step 14 is not whole, and step 12 is not either (the
    others hold 14): no plan mixes the two."""
    views = [("node0", [held(0, 14), held(3, 14, replica=True)]),
             ("node1", [held(1, 12), held(0, 14, replica=True)]),
             ("node2", [held(2, 14), held(1, 12, replica=True)])]
    assert reshardplan.whole(14, views) == "rank(s) [1] of its 4-rank run are in no node's memory"
    assert isinstance(reshardplan.whole(12, views), str)


def test_the_same_step_of_two_runs_is_never_mixed():
    """A job that redid step 14 after a restart: rank 3's copy is the other run's, so neither run is whole."""
    views = four_on_three()
    views[0] = ("node0", [held(0, 14), held(3, 14, replica=True, run="ffffffffffffffff")])
    why = reshardplan.whole(14, views)
    assert isinstance(why, str) and "rank(s) [3]" in why and "rank(s) [0, 1, 2]" in why


def test_a_file_persisted_by_two_ranks_is_not_one_runs_snapshot():
    views = four_on_three()
    views[2] = ("node2", [held(2, 14, files=[("model.pt", True)]), held(1, 14, replica=True)])
    assert reshardplan.whole(14, views) == \
        "model.pt is persisted by both rank 0 and rank 2: not one run's snapshot"


def test_each_rank_receives_only_what_its_node_does_not_hold():
    views = four_on_three()
    plan = reshardplan.whole(14, views)
    assert isinstance(plan, reshardplan.Whole)
    wants = [reshardplan.olds_for(plan, {"model.pt", "optim.pt", f"rank_{r}.pt"}) for r in range(3)]
    assert wants == [[0], [0, 1], [0, 2]]
    moves = reshardplan.moves(plan, views, wants)
    # node 1 holds rank 0's replica; node 2 holds neither copy: node 0's own slot, sent by node 0's rank
    assert [(m.old, m.sender, m.receiver, m.held.replica) for m in moves] == [(0, 0, 2, False)]
    assert reshardplan.local(plan, "node1", 0) is not None and reshardplan.local(plan, "node2", 0) is None


def test_two_ranks_of_one_node_list_its_memory_once():
    """2 ranks per node on 2 nodes, restarted as 2 ranks on node 0 (4 -> 2): both ranks see node 0's slots."""
    node0 = [held(0, 8), held(1, 8), held(2, 8, replica=True), held(3, 8, replica=True)]
    plan = reshardplan.whole(8, [("node0", node0), ("node0", node0)])
    assert isinstance(plan, reshardplan.Whole) and plan.nodes() == (1, 2)
    assert reshardplan.moves(plan, [("node0", node0)] * 2, [[0], [0, 1]]) == []


def listing(**by_source: Dict[int, Optional[str]]) -> Dict[str, Dict[int, Optional[str]]]:
    names = ("memory", "peer", "resharded", "local", "storage", "adopted")
    return {n: dict(by_source.get(n, {})) for n in names}


def plan_of(views) -> List[Tuple[str, List[int]]]:
    return [(tier.names[0], steps) for tier, steps in agree.choose(views, {})]


def test_a_resharded_step_listed_on_one_rank_is_tried_before_an_older_committed_one():
    views = [listing(resharded={14: None, 12: None}, storage={10: None}), listing(storage={10: None})]
    assert plan_of(views) == [("resharded", [14, 12]), ("storage", [10])]


def test_a_resharded_step_older_than_the_newest_committed_one_is_not_tried():
    views = [listing(resharded={8: None}, storage={10: None}), listing(storage={10: None})]
    assert plan_of(views) == [("storage", [10])]


def test_a_resharded_listing_never_holds_back_the_memory_of_this_world_size():
    """Leftover slots of another world size may list a newer step that proves partial: the memory snapshot every
    rank holds is still tried first."""
    views = [listing(memory={12: None}, resharded={16: None}), listing(memory={12: None})]
    assert plan_of(views) == [("memory", [12]), ("resharded", [16]), ("storage", [])]


# ---- a slot moved between nodes: its bytes checked on arrival (engine/load/held.py) ---------------------------

def test_a_moved_slot_decodes_to_what_the_slot_held_and_a_changed_byte_is_refused(tmp_path, monkeypatch):
    import torch
    from test_slot_format import JOB, write_slot

    from easyckpt.engine.load import held as heldmod
    from easyckpt.ipc import shm

    d = tmp_path / "shm"
    d.mkdir(mode=0o700)
    monkeypatch.setattr(shm, "SHM_DIR", str(d))
    path = write_slot(step=5)
    # the same bytes under rank 1's name: its header says rank 0, so it is nobody's shard
    import shutil
    shutil.copy(path, shm.slot_path(JOB, 1, 0))
    [listed] = heldmod.held_here(JOB, world_size=1, layout=None)      # written by a run of 2 ranks
    assert (listed.rank, listed.step, listed.world_size, listed.replica) == (0, 5, 2, False)
    sent = heldmod.slot_bytes(listed)
    trees = heldmod.read_moved(sent, listed, "rank 0's slot")
    assert torch.equal(trees["model.safetensors"]["w"], torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert trees["model.safetensors"]["n"].tolist() == [7, 8]
    for where in (shm.HEADER_BYTES + 3, len(sent) - heldmod.DIGEST_BYTES - 2):     # a tensor byte, the metadata
        bad = bytearray(sent)
        bad[where] ^= 0x40
        with pytest.raises(ValueError, match="do not match the sender's checksum"):
            heldmod.read_moved(bad, listed, "rank 0's slot")
    assert heldmod.held_here(JOB, world_size=2, layout=None) == [], "a snapshot of this world size is memory's"
    write_slot(step=7, generation=2)          # rewritten after it was listed: never sent as step 5
    with pytest.raises(Exception, match="holds step 7, not step 5"):
        heldmod.slot_bytes(listed)


def test_thread_ranks_exchange_what_each_plan_says():
    from easyckpt._testing.ranks import run_ranks

    def body(g):
        sends = {1: [memoryview(bytearray(b"from 0"))]} if g.rank == 0 else {}
        sizes = {0: [6]} if g.rank == 1 else {}
        return g.exchange(sends, sizes)

    assert run_ranks(2, body) == [{}, {0: [bytearray(b"from 0")]}]


def test_what_a_restore_writes_beside_a_written_out_step_stays_in_memory_and_is_known_as_ours():
    """render.beside names a directory inside a step render.write made (private to us, removed with it, so a load
    that died leaves nothing remove_stale misses); a path of any other kind is refused."""
    from easyckpt.engine.load import render
    from easyckpt.ipc import shm
    made = os.path.join(shm.SHM_DIR, f"{render.PREFIX}job1-abc")
    assert render.beside(made, "universal") == os.path.join(made, ".universal")
    for wrong in ("/tmp/easyckpt-render-job1-abc", os.path.join(shm.SHM_DIR, "other-job1-abc")):
        with pytest.raises(ValueError, match="no step written out"):
            render.beside(wrong, "universal")
    with pytest.raises(ValueError):
        render.beside(made, "../x")
