"""Import contract: only easyckpt/storage/ changes the file system in the save directory.

Every module outside easyckpt/storage/ is read as an AST; a call that mutates the file system (rename,
remove, mkdir, fsync, rmtree, copy, open for writing, os.open with a creating or writing flag) fails the
test with file:line, unless its module is on ALLOWED below, with what it writes and where. The save
directory's own writes go through storage.savedir.SaveDir / storage.base.Storage.
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator, List, Tuple

PACKAGE = Path(__file__).resolve().parent.parent / "easyckpt"

# module (relative to easyckpt/) -> what it writes, and where: never the save directory's checkpoints
ALLOWED = {
    "ipc/shm.py": "the snapshot slots in /dev/shm (created 0600, exclusively) and their unlink",
    "ipc/jobkey.py": "the job's secret key file in /dev/shm",
    "engine/link/runlog.py": "the run directory of `easyckpt run` (launcher.py's, EASYCKPT_RUN_DIR), not the save dir",
    "cli/launcher.py": "creates and empties the run directory it hands to its child (runlog.py's)",
    "_faults.py": "the test-only EASYCKPT_FAULT_ONCE_DIR markers (a no-op unless the environment asks)",
    "config.py": "validate(): creates the save dir itself and probes that the audit log can be appended to, "
                 "before any agent exists (the probe file goes through storage.posix)",
}

_OS_MUTATORS = {"rename", "replace", "remove", "unlink", "rmdir", "removedirs", "makedirs", "mkdir", "fsync",
                "fdatasync", "truncate", "ftruncate", "symlink", "link", "chmod", "chown", "renames", "mkfifo"}
_SHUTIL_MUTATORS = {"rmtree", "move", "copy", "copy2", "copyfile", "copytree", "copymode", "copystat"}
# (not "replace": str.replace is everywhere, and Path.replace is caught by review of Path.rename's users)
_PATH_MUTATORS = {"mkdir", "rmdir", "unlink", "rename", "write_text", "write_bytes", "touch", "symlink_to",
                  "hardlink_to"}
_WRITE_FLAGS = {"O_CREAT", "O_WRONLY", "O_RDWR", "O_TRUNC", "O_APPEND"}


def _modules() -> Iterator[Path]:
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.relative_to(PACKAGE).parts[0] != "storage":
            yield path


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def _names_in(node: ast.AST) -> set:
    return {n.attr if isinstance(n, ast.Attribute) else n.id
            for n in ast.walk(node) if isinstance(n, (ast.Attribute, ast.Name))}


def _open_mode(call: ast.Call) -> str:
    mode = call.args[1] if len(call.args) > 1 else next((k.value for k in call.keywords if k.arg == "mode"), None)
    return mode.value if isinstance(mode, ast.Constant) and isinstance(mode.value, str) else ""


def violations(source: str) -> List[Tuple[int, str]]:
    """(line, call) of every file-system mutation in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        head, _, last = name.rpartition(".")
        bad = (head == "os" and last in _OS_MUTATORS) or (head == "shutil" and last in _SHUTIL_MUTATORS)
        if head == "os" and last == "open" and len(node.args) > 1 and _names_in(node.args[1]) & _WRITE_FLAGS:
            bad = True
        if name in ("open", "io.open", "os.fdopen") and any(c in _open_mode(node) for c in "wax+"):
            bad = True
        if isinstance(node.func, ast.Attribute) and head not in ("os", "shutil") and last in _PATH_MUTATORS:
            bad = True        # pathlib.Path's verbs
        if bad:
            found.append((node.lineno, name))
    return found


def test_only_the_storage_layer_changes_the_file_system():
    problems = []
    for path in _modules():
        rel = path.relative_to(PACKAGE).as_posix()
        if rel in ALLOWED:
            continue
        problems += [f"easyckpt/{rel}:{line}: {call}" for line, call in violations(path.read_text())]
    assert not problems, ("file-system writes outside easyckpt/storage/ (go through SaveDir / the Storage "
                          "interface, or add the module to ALLOWED saying what it writes where):\n"
                          + "\n".join(problems))


def test_the_allow_list_names_existing_modules_that_still_need_it():
    for rel in ALLOWED:
        path = PACKAGE / rel
        assert path.exists(), f"ALLOWED names {rel}, which does not exist"
        assert violations(path.read_text()), f"{rel} writes nothing any more: take it off ALLOWED"


def test_the_check_catches_each_kind_of_write():
    caught = [
        "import os\nos.rename('a', 'b')",
        "import shutil\nshutil.rmtree('d')",
        "open('f', 'wb')",
        "open('f', mode='a')",
        "import os\nos.open('f', os.O_WRONLY | os.O_CREAT, 0o644)",
        "import os\nos.fsync(3)",
        "from pathlib import Path\nPath('x').write_bytes(b'')",
    ]
    for source in caught:
        assert violations(source), source
    for source in ["open('f')", "open('f', 'rb')", "import os\nos.open('f', os.O_RDONLY)", "import os\nos.listdir('.')"]:
        assert not violations(source), source
