"""A rank's done-marker: in a step's staging directory, written by its agent once the rank's files are
durable (storage/markers.py write), read by the coordinator before the commit (storage/commit.py's strategies).
JSON, checked whole when parsed: the staging directory is shared, so a marker is input like any file."""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Dict

from easyckpt.errors import ManifestError
from easyckpt.formats.manifest import FileEntry, parse_files


@dataclasses.dataclass(frozen=True)
class Marker:
    rank: int
    step: int
    files: Dict[str, FileEntry]           # relpath -> the manifest entry the rank's files get
    info: Dict[str, Any]                  # what the adapter recorded (merged into the manifest's "info")

    def to_json(self) -> bytes:
        return json.dumps({"rank": self.rank, "step": self.step, "info": self.info,
                           "files": {rel: e.to_json() for rel, e in self.files.items()}}).encode()

    @classmethod
    def parse(cls, data: bytes) -> "Marker":
        """The marker these bytes hold; ManifestError (a ValueError) says what is wrong."""
        try:
            obj = json.loads(data)
        except (ValueError, UnicodeDecodeError):
            raise ManifestError("a done-marker that is not JSON") from None
        if not isinstance(obj, dict):
            raise ManifestError("a done-marker that is not an object")
        for key in ("rank", "step"):
            value = obj.get(key)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
                raise ManifestError(f"a done-marker's {key} is {str(value)[:40]!r}, expected an integer >= 0")
        files, info = obj.get("files"), obj.get("info", {})
        if not isinstance(files, dict) or not isinstance(info, dict):
            raise ManifestError("a done-marker's files or info is not an object")
        return cls(obj["rank"], obj["step"], parse_files(files), info)
