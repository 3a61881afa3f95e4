"""Reading only the items a rank needs of a large shared file (torch_dist's ``__R_0.distcp``): the agent
records each item's place and checksum in the manifest; the loader reads and checks just the items asked
for; a damaged item that is asked for rejects the step, one that is not is never read; a malformed item
list rejects the step before anything is read. And which items a rank's load request picks."""
from __future__ import annotations

import json

import pytest

from easyckpt.engine.load.stepread import read_files, read_step
from easyckpt.errors import ManifestError
from easyckpt.formats import manifest as mf
from easyckpt.megatron import torchdist
from easyckpt.megatron.state import Parallel

ITEMS = [b"a" * 100, b"b" * 50, b"c" * 70]


def make_step(tmp_path, ids=None):
    step = tmp_path / "iter_0000010"
    step.mkdir()
    data = b"".join(ITEMS)
    (step / "__0_0.distcp").write_bytes(data)
    items, at = [], 0
    for n, item in enumerate(ITEMS):
        items.append([at, len(item), mf.checksum(item), ids[n] if ids else None])
        at += len(item)
    files = {"__0_0.distcp": {"size": len(data), "checksum": mf.checksum(data), "format": "dcp", "items": items}}
    return step, mf.validate(mf.build(10, "job", "megatron", 1, mf.parse_files(files)).to_json())


def damage(step, at):
    path = step / "__0_0.distcp"
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def test_only_the_items_asked_for_are_read_and_checked(tmp_path):
    step, man = make_step(tmp_path)
    trees, problem, nbytes, _ = read_files(str(step), man, [("__0_0.distcp", False, [1])], None)
    assert problem is None and nbytes == 50 and trees == {"__0_0.distcp": None}
    damage(step, 10)                       # item 0: not asked for, not read
    trees, problem, nbytes, _ = read_files(str(step), man, [("__0_0.distcp", False, [1, 2])], None)
    assert problem is None and nbytes == 120
    damage(step, 160)                      # item 2
    _, problem, _, _ = read_files(str(step), man, [("__0_0.distcp", False, [1, 2])], None)
    assert problem and problem.corrupt and "item 2" in problem.reason and "corrupted" in problem.reason
    _, problem, _, _ = read_files(str(step), man, [("__0_0.distcp", False, [7])], None)
    assert problem and "no item 7" in problem.reason


@pytest.mark.parametrize("items", [
    "nope",
    [[0, 100, "x", None], [50, 50, "y", None]],            # overlapping
    [[0, 100, "x", None], [100, 200, "y", None]],          # past the end of the file
    [[0, 100, "x", ["k", [0], [1, 2]]]],                   # offsets and sizes disagree
    [[0, 100, "x", ["k", [-1], [1]]]],
    [[0, 100, 5, None]],
    [[0, 100, "x"]],
])
def test_a_malformed_item_list_rejects_the_step(tmp_path, items):
    step, man = make_step(tmp_path)
    raw = man.to_json()
    raw["files"]["__0_0.distcp"]["items"] = items
    with pytest.raises(ManifestError, match=r"files\['__0_0.distcp'\]\.items"):
        mf.validate(raw)               # refused when parsed: no Manifest holds such items
    (step / mf.MANIFEST_NAME).write_text(json.dumps(raw))
    _, problem, _, _ = read_step(str(step), lambda m: [("__0_0.distcp", False, [0])])
    assert problem and problem.corrupt and "items" in problem.reason


def test_a_rank_picks_the_items_its_request_overlaps(tmp_path):
    ids = [["w", [0, 0], [2, 4]], ["w", [2, 0], [2, 4]], ["rng_state/shard_0_0", None, None]]
    _, man = make_step(tmp_path, ids)
    where = Parallel(rank=0, tp=0, pp=0, dp=0, tp_size=1, pp_size=1, dp_size=2)
    # rows 2..3 only: the second chunk, and the object (small, always checked)
    got = torchdist.needed(where, 2, man, [("w", [3, 0], [1, 4])])
    assert ("__0_0.distcp", False, [1, 2]) in got
    got = torchdist.needed(where, 2, man, [("w", [0, 0], [4, 4])])
    assert ("__0_0.distcp", False, [0, 1, 2]) in got
    got = torchdist.needed(where, 2, man, [("other", [0], [4])])
    assert ("__0_0.distcp", False, [2]) in got
    # without a request (or a file without items: a checkpoint Megatron wrote): whole files, i mod world
    assert ("__0_0.distcp", False) in torchdist.needed(where, 2, man)


def test_what_a_load_reads_chunks_overlapping_its_boxes_and_the_objects_it_names():
    from easyckpt.engine.load.dcp import boxes_of, wanted_items
    asked = wanted_items(boxes_of([("w", [2, 0], [2, 4]), ("b", [0], [3])]), {"rng"})
    assert asked(["w", [0, 0], [4, 4]]) and asked(["w", [3, 2], [1, 1]]) and asked(["b", [2], [5]])
    assert not asked(["w", [0, 0], [2, 4]]) and not asked(["w", [4, 0], [2, 4]]) and not asked(["b", [3], [2]])
    assert not asked(["x", [2, 0], [2, 4]]) and not asked(["w", [2], [2]])     # another key, another rank of shape
    assert asked(["rng", None, None]) and not asked(["other", None, None])
    assert asked(None)                                                        # unknown identity: taken
    assert wanted_items({}, None)(["anything", None, None])                   # None: every object


def test_a_sparse_file_holds_its_pieces_at_their_offsets_and_zeros_between(tmp_path):
    from easyckpt.storage.posix import PosixStorage
    path = tmp_path / "__1_0.distcp"
    PosixStorage().write_sparse(str(path), 1000, [(100, b"x" * 50), (900, bytearray(b"y" * 100))])
    data = path.read_bytes()
    assert len(data) == 1000 and data[100:150] == b"x" * 50 and data[900:] == b"y" * 100
    assert data[:100] == bytes(100) and data[150:900] == bytes(750)
    with pytest.raises(FileExistsError):
        PosixStorage().write_sparse(str(path), 10, [])
    with pytest.raises(ValueError, match="outside"):
        PosixStorage().write_sparse(str(tmp_path / "other"), 10, [(5, b"123456")])
