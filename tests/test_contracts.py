"""The import rules of .importlinter hold: the agent never imports torch, pickle or trainer-side code; formats
stay torch-free and shared; adapters never import the agent or the storage layer, nor each other; storage
never imports torch or either process's code. The contracts live in .importlinter; this runs them.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_hold():
    try:
        import importlinter  # noqa: F401
    except ImportError:
        pytest.fail("import-linter is missing: install the test extra (pip install -e '.[test]'); "
                    "the import contracts are part of the test run")
    # lint-imports' own entry point, run by this interpreter so that it sees the same packages; --no-cache:
    # nothing written into the source tree
    cmd = [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
                                 "sys.exit(lint_imports_command())",
           "--config", str(ROOT / ".importlinter"), "--no-cache"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "BROKEN" not in out, f"an import contract is broken:\n{out[-8000:]}"


PACKAGE = ROOT / "easyckpt"
MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 60


def _modules():
    return sorted(p for p in PACKAGE.rglob("*.py"))


def test_no_module_and_no_function_is_longer_than_the_limit():
    import ast
    long = []
    for path in _modules():
        text = path.read_text(encoding="utf-8")
        rel = path.relative_to(ROOT)
        if len(text.splitlines()) > MAX_MODULE_LINES:
            long.append(f"{rel}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{rel}:{node.lineno} {node.name}: {n} lines")
    assert not long, "over the limits (module 450 lines, function 60):\n" + "\n".join(long)


MAX_LOAD_PARAMETERS = 6


def test_no_function_of_the_loader_takes_more_than_six_parameters():
    """The loader's context travels as one Ranks (engine/load/sources.py), not as loose arguments."""
    import ast
    wide = []
    for path in sorted((PACKAGE / "engine" / "load").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                names = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs]
                names += [p.arg for p in (a.vararg, a.kwarg) if p is not None]
                n = len([p for p in names if p not in ("self", "cls")])
                if n > MAX_LOAD_PARAMETERS:
                    wide.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {n} parameters")
    assert not wide, "over 6 parameters:\n" + "\n".join(wide)


def test_no_import_circle_between_modules():
    import grimp
    graph = grimp.build_graph("easyckpt")
    circles = set()
    for module in graph.modules:
        if not module.startswith("easyckpt"):
            continue
        for imported in graph.find_modules_directly_imported_by(module):
            if imported.startswith("easyckpt") and imported != module and \
                    graph.chain_exists(importer=imported, imported=module):
                circles.add(tuple(sorted((module, imported))))
    # a package's __init__ and its own submodules (the package re-exports what they define) is no circle of code
    circles = {(a, b) for a, b in circles if not (b.startswith(a + ".") or a.startswith(b + "."))}
    assert not circles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in sorted(circles))


# The one function that parses a save directory's name into a back-end: storage/resolve.py's ``remote``; every other
# caller asks the back-end (``storage_for(path).local``, its verbs) or resolve (``is_url``, ``is_store_url``).
URL_PARSERS = {"easyckpt/storage/resolve.py", "easyckpt/storage/s3client.py"}     # s3client: its own URLs' form
# switched by the engine's change (issue 52: ``storage_for(path).local``); remove each entry as it goes


def _url_tests(tree) -> list:
    """Lines that call ``remote(...)`` or test a string for a URL scheme ("://" in x, x.startswith("s3://"))."""
    import ast
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            if name == "remote":
                found.append(node.lineno)
            elif name in ("startswith", "match") and any(
                    isinstance(a, ast.Constant) and isinstance(a.value, str) and "://" in a.value for a in node.args):
                found.append(node.lineno)
        elif isinstance(node, ast.Compare) and isinstance(node.left, ast.Constant) and \
                isinstance(node.left.value, str) and "://" in node.left.value:
            found.append(node.lineno)
    return found


def test_a_paths_url_scheme_is_parsed_in_one_place():
    import ast
    where = []
    for path in _modules():
        rel = str(path.relative_to(ROOT))
        if rel in URL_PARSERS:
            continue
        where += [f"{rel}:{line}" for line in _url_tests(ast.parse(path.read_text(encoding="utf-8")))]
    assert not where, ("a path's scheme is tested outside storage/resolve.py (ask resolve.storage_for(path).local, "
                       "resolve.is_url or the back-end's verbs):\n" + "\n".join(where))
    tree = ast.parse((PACKAGE / "storage" / "resolve.py").read_text(encoding="utf-8"))
    parsers = [n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "remote"]
    assert parsers == ["remote"]


def test_each_shard_format_is_named_in_one_module():
    """formats/shardformat.py writes the format names; everything else dispatches through ShardFormat (a
    name like "torch" has other meanings too: what is checked is its use as a format)."""
    import re
    names = ("safetensors", "torch", "raw", "dcp")
    as_format = re.compile(r"""(?:fmt\s*(?:==|=|!=)\s*|["'](?:fmt|format)["']\s*:\s*)["'](%s)["']""" % "|".join(names))
    bare = re.compile(r"""["'](raw|dcp)["']""")
    found = []
    for path in _modules():
        if path.name == "shardformat.py":
            continue
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if as_format.search(line) or bare.search(line):
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not found, "a shard format named outside formats/shardformat.py:\n" + "\n".join(found)


def test_every_shard_format_has_its_three_halves():
    from easyckpt.storage.nativefiles import WRITERS
    from easyckpt.engine.shards.codecs import DECODE, FLATTEN
    from easyckpt.formats.shardformat import ShardFormat
    from easyckpt.formats.slotmeta import SKELETON_CHECKS
    for table in (SKELETON_CHECKS, WRITERS, FLATTEN, DECODE):
        assert set(table) == set(ShardFormat), table
