"""The agent's replies as typed records (formats/replies.py) and the adapters' read items (engine/load/reads.py),
in process: each reply round-trips through the wire, a bad field is refused naming it, the status reply
keeps what is good of a partly odd one, and needed()'s tuple form becomes Reads."""
from __future__ import annotations

import pytest

from easyckpt.engine.load.reads import Read, as_reads
from easyckpt.errors import BadMessage
from easyckpt.formats import replies
from easyckpt.formats.replies import (
    ErrorReply,
    FlushReply,
    HelloReply,
    ListenReply,
    PeersReply,
    ReplicaFetchReply,
    ReplicaListReply,
    ReplicaSent,
    ReplicaStatus,
    SigtermStatus,
    StatusReply,
)

EVERY = [HelloReply(True, agent_pid=7), HelloReply(False, error="refused"), FlushReply(True, 5),
         FlushReply(False, 5, "disk full"), ListenReply(True, port=4242), PeersReply(True),
         ReplicaListReply(True, steps=[(4, 2, 0)], problems=["node 3: gone"]),
         ReplicaFetchReply(True, slot=1, bytes=100, seconds=0.5, node=0), ErrorReply("bad field"),
         StatusReply(agent_pid=9, job_id="abc", save_dir="/x", world_size=2, coordinator=True, connected=[0, 1],
                     failed_steps={15: "disk full"}, sigterm=SigtermStatus(1.5, 40, 2.0, False),
                     commits=[(10, 1024, 0.25)],
                     replicas=ReplicaStatus(node=1, nnodes=2, factor=2, targets={0: "10.0.0.1:9"},
                                            sent={0: ReplicaSent(4, 32, 0.1, [1])}))]


@pytest.mark.parametrize("reply", EVERY, ids=lambda r: type(r).__name__)
def test_every_reply_round_trips_through_the_wire(reply):
    assert replies.parse_reply(replies.encode_reply(reply)) == reply


def test_a_reply_with_a_bad_field_is_refused_naming_the_field():
    with pytest.raises(BadMessage, match=r"flush\.step"):
        replies.reply_from_wire({"op": "flush", "ok": True, "step": "5"})
    with pytest.raises(BadMessage, match=r"hello\.agent_pid = -1 is out of range"):
        replies.reply_from_wire({"op": "hello", "ok": True, "agent_pid": -1})
    with pytest.raises(BadMessage, match="field 'ok' is missing"):
        replies.reply_from_wire({"op": "listen", "port": 3})
    with pytest.raises(BadMessage, match="not a reply"):
        replies.reply_from_wire({"op": "shutdown"})
    with pytest.raises(BadMessage, match="not JSON"):
        replies.parse_reply(b"{nope")


def test_the_status_reply_keeps_what_is_good_and_drops_what_is_not():
    got = replies.status_from_wire({"agent_pid": "x", "dead_ranks": [1, "2", -3, 4],
                                    "failed_steps": {"9": "disk full", "x": "y", "10": 3},
                                    "commits": [[5, 10, 0.5], [6, -1, 0.1]], "replicas": {"node": "one"}})
    assert got.agent_pid == 0 and got.dead_ranks == [1, 4] and got.failed_steps == {9: "disk full"}
    assert got.commits == [(5, 10, 0.5)] and got.replicas == ReplicaStatus()


def test_expect_turns_an_error_reply_or_another_kind_into_bad_message():
    assert replies.expect(FlushReply(True, 3), FlushReply).step == 3
    with pytest.raises(BadMessage, match="no key"):
        replies.expect(ErrorReply("no key"), FlushReply)
    with pytest.raises(BadMessage, match="expected a flush reply"):
        replies.expect(HelloReply(True, agent_pid=1), FlushReply)


def test_needed_in_the_tuple_form_becomes_reads():
    pick = lambda tree: []  # noqa: E731
    assert Read.of(("a.pt", True)) == Read("a.pt", True)
    assert Read.of(("d.distcp", False, [3, 1])) == Read("d.distcp", items=(3, 1))
    assert Read.of(("m.pt", False, pick)).pick is pick and not Read.of(("m.pt", False, pick)).whole

    class State:
        @as_reads
        def needed(self, manifest):
            return [("model.safetensors", False), Read("rng.safetensors", True)]

    assert State().needed({}) == [Read("model.safetensors"), Read("rng.safetensors", True)]


def test_a_done_marker_round_trips_and_a_bad_one_is_refused_saying_what():
    from easyckpt.errors import ManifestError
    from easyckpt.formats.manifest import FileEntry
    from easyckpt.formats.marker import Marker
    from easyckpt.formats.shardformat import ShardFormat
    good = Marker(1, 10, {"model.safetensors": FileEntry(4, "ab", ShardFormat.SAFETENSORS)}, {"run": 1.5})
    assert Marker.parse(good.to_json()) == good
    for bad, says in ((b"[]", "not an object"), (b'{"rank": -1, "step": 1, "files": {}}', "rank"),
                      (b'{"rank": 0, "step": 1, "files": {"../x": {"size": 1, "checksum": "a"}}}', "files"),
                      (b'{"rank": 0, "step": 1, "files": {"a": {"size": 1}}}', "checksum is missing")):
        with pytest.raises(ManifestError, match=says):
            Marker.parse(bad)


def test_a_manifest_round_trips_through_json_keeping_what_a_newer_writer_added():
    import json

    from easyckpt.formats.manifest import FileEntry, Item, Manifest, build
    from easyckpt.formats.shardformat import ShardFormat
    files = {"a.distcp": FileEntry(7, "ab", ShardFormat.DCP, (Item(0, 7, "cd", ["w", [0], [7]]),), extra={"future": 1}),
             "b.json": FileEntry(2, "ef", derived_by="easyckpt convert")}
    man = build(5, "job", "pytorch", 2, files, {"run": 1.5, "protect": [3, "x"], "layout": "tp1"}, job_name="j")
    raw = man.to_json()
    raw["newer_field"] = {"x": 1}
    again = Manifest.parse(json.loads(json.dumps(raw)))
    assert again.to_json() == raw and again.extra == {"newer_field": {"x": 1}}
    assert again.files["a.distcp"] == files["a.distcp"] and again.files["b.json"].shard_format == ShardFormat.SAFETENSORS
    assert again.run == 1.5 and again.protect == {3} and again.layout == "tp1" and again.nbytes == 9
    assert again.same_job("another id", "j") and not again.same_job("job", "k") and "job_name='j'" in again.job_words()
    assert again.with_files({"c.bin": FileEntry(1, "00")}, drop=["b.json"]).files.keys() == {"a.distcp", "c.bin"}


def test_slot_metadata_parses_to_records_and_names_a_bad_field():
    import json

    from easyckpt.errors import BadSlotMeta
    from easyckpt.formats import slotmeta
    from easyckpt.formats.shardformat import ShardFormat
    f = {"relpath": "m.safetensors", "persist": True, "fmt": "safetensors", "start": 100, "end": 112,
         "tensors": [["w", "F32", [3], 100, 112]]}
    meta = {"step": 4, "files": [f], "skeletons": {"m.safetensors": {"w": {"__t": "w"}}}, "info": {"layout": "tp2"}}
    got = slotmeta.parse(json.dumps(meta).encode(), 4, 100, 200)
    assert got.layout == "tp2" and got.files[0].fmt == ShardFormat.SAFETENSORS and got.files[0].ranges() == {"w": (100, 112)}
    f["tensors"][0][4] = 116
    with pytest.raises(BadSlotMeta, match="w at \\[100, 116\\) is not 3 x 4 bytes"):
        slotmeta.parse(json.dumps(meta).encode(), 4, 100, 200)
