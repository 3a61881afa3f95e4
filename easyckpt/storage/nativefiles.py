"""One snapshot file in the framework's native layout, written from the slot's bytes and the skeleton its checked
metadata holds: easyckpt's shard file, a raw file, a torch.save file, a torch DCP data file. What the agent persists
(agent/stepwriter.py) and what a resharded load renders into a private directory from the nodes' memory
(engine/load/render.py) are the same bytes, written here.

Each writer appends the file to a Writer (storage/base.py) and returns its checksum and, where a load may read
it in parts, its items. Tensor bytes go from the slot to the Writer as they lie (write_mapped); a thread
checksums the same bytes meanwhile. Nothing is unpickled: a torch.save file is the trainer's pickle and the
slot's bytes assembled (formats/torchzip.py).
"""
from __future__ import annotations

import base64
import queue
import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

from easyckpt.formats import manifest as mf
from easyckpt.formats import torchzip
from easyckpt.formats.shardfile import encode_header, file_entries
from easyckpt.formats.shardformat import ShardFormat
from easyckpt.formats.slotmeta import SlotFile
from easyckpt.storage.base import Writer

# a written file's checksum, and its items where a load may read it in parts
Written = Tuple[str, Optional[Tuple[mf.Item, ...]]]


def _write_safetensors(out: Writer, view: memoryview, f: SlotFile) -> Written:
    """easyckpt's shard file: its header, then the tensors straight from the slot."""
    header = encode_header(file_entries(f.tensors, f.start), f.skeleton, data_phase=f.start)
    return _write_shard(out, header, view, f.start, f.end), None


def _write_raw(out: Writer, view: memoryview, f: SlotFile) -> Written:
    data = base64.b64decode(f.skeleton["__raw"])
    out.write(data)
    return mf.checksum(data), None


def _write_shard(out: Writer, header: bytes, view: memoryview, start: int, end: int) -> str:
    hasher = mf.Hasher()
    hasher.update(header)
    worker = threading.Thread(target=hasher.update, args=(view[start:end],), daemon=True)
    worker.start()
    try:
        out.write(header)
        out.write_mapped(view, start, end)
    finally:
        worker.join()
    return hasher.hexdigest()


class _Hashed:
    """Appends to a shard file, from bytes or from the slot. A worker thread checksums what is written
    meanwhile (xxh3 releases the GIL): the whole file, and each item alone (manifest ``items``: a load
    then reads and checks only the items it needs)."""

    def __init__(self, out: Writer, view: memoryview):
        self.out, self.view, self.hasher = out, view, mf.Hasher()
        self.items: List[List[Any]] = []        # [offset, length, hasher, id] until finish
        self._queue: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._error: Optional[BaseException] = None
        self._worker = threading.Thread(target=self._hash, daemon=True, name="easyckpt-hash")
        self._worker.start()

    def _hash(self) -> None:
        current: Optional[mf.Hasher] = None
        while True:
            data = self._queue.get()
            if data is None:
                return
            if isinstance(data, tuple):          # ("item", hasher or None): an item begins or ends
                current = data[1]
                continue
            if self._error is None:
                try:
                    self.hasher.update(data)
                    if current is not None:
                        current.update(data)
                except BaseException as exc:   # noqa: BLE001 - reported by finish()
                    self._error = exc

    def begin_item(self, ident: Any) -> None:
        h = mf.Hasher()
        self.items.append([self.out.size, None, h, ident])
        self._queue.put(("item", h))

    def end_item(self) -> None:
        self.items[-1][1] = self.out.size - self.items[-1][0]
        self._queue.put(("item", None))

    def write(self, data: bytes) -> None:
        self._queue.put(data)
        self.out.write(data)

    def write_slot(self, begin: int, end: int) -> None:
        self._queue.put(self.view[begin:end])
        self.out.write_mapped(self.view, begin, end)

    def stop(self) -> None:
        """Let the worker end (after an error on the writer's side too)."""
        if self._worker.is_alive():
            self._queue.put(None)
            self._worker.join()

    def finish(self) -> Tuple[str, Tuple[mf.Item, ...]]:
        """The file's checksum and its items."""
        self.stop()
        if self._error is not None:
            raise self._error
        return self.hasher.hexdigest(), tuple(mf.Item(o, n, h.hexdigest(), ident) for o, n, h, ident in self.items)


def _write_dcp(out: Writer, view: memoryview, f: SlotFile) -> Written:
    """A torch.distributed.checkpoint data file: its items back to back, each a torch.save archive of one
    tensor (offsets relative to the item, as DCP's reader slices the file) or bytes. Each item must come
    out at the size the trainer put in the checkpoint's metadata: a mismatch fails the persist. Returns
    the file's checksum and each item's [offset, length, checksum, id] (manifest ``items``: a load then
    reads and checks only the items its rank needs)."""
    ranges = f.ranges()
    dst = _Hashed(out, view)
    try:
        for n, item in enumerate(f.skeleton["__dcp"]):
            start = out.size
            dst.begin_item(item.get("id"))
            if "b" in item:
                dst.write(base64.b64decode(item["b"]))
            else:
                torchzip.write_torch_file(dst.write, dst.write_slot, lambda: out.size - start,
                                          base64.b64decode(item["pkl"]), [ranges[item["t"]]],
                                          slot_phase=False)
                if out.size - start != item["n"]:
                    raise ValueError(f"{f.relpath}: item {n} came out at {out.size - start} bytes, its "
                                     f"metadata says {item['n']}")
            dst.end_item()
        return dst.finish()
    finally:
        dst.stop()


def _write_torch(out: Writer, view: memoryview, f: SlotFile) -> Written:
    """A framework-native torch.save file from the trainer's pickle and the tensor bytes in the slot.
    Its items: the head (everything before the first storage's bytes: the pickle), then each storage's
    bytes, named by the snapshot's tensor key (a reshard reads the pickle and the storages it needs)."""
    ranges = f.ranges()
    keys = f.skeleton["storages"]
    dst = _Hashed(out, view)
    try:
        dst.begin_item([torchzip.HEAD, None, None])
        head = {"open": True}

        def at_storage(i: int) -> None:
            if head["open"]:
                dst.end_item()
                head["open"] = False
            dst.begin_item([keys[i], None, None])

        torchzip.write_torch_file(dst.write, dst.write_slot, lambda: out.size,
                                  base64.b64decode(f.skeleton["__torchzip"]), [ranges[k] for k in keys],
                                  at_storage=at_storage, after_storage=lambda i: dst.end_item())
        if head["open"]:       # no storage: the head is the whole file
            dst.end_item()
        return dst.finish()
    finally:
        dst.stop()


# the agent's half of each shard format (formats/shardformat.py): one file from the slot's bytes and the
# skeleton the slot's metadata holds (checked by slotmeta.SKELETON_CHECKS)
WRITERS: Dict[ShardFormat, Callable[[Writer, memoryview, SlotFile], Written]] = {
    ShardFormat.SAFETENSORS: _write_safetensors, ShardFormat.TORCH: _write_torch, ShardFormat.RAW: _write_raw,
    ShardFormat.DCP: _write_dcp,
}
