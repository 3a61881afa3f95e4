"""tree.flatten of a tree shaped like the one before, as straight-line code made from that tree.

A training loop hands the snapshot a tree of the same shape every step: the same dicts, lists and keys, tensors
in the same places, only numbers changing. flatten walks it node by node (a call, a type dispatch and a path per
node: an AdamW state of 4 parameters took 75 us on the test VM, the largest part of a tiny snapshot's fixed cost).
A plan is that walk written out once, as one function for the tree's shape: it reads each node where the walk
found it, checks that it is of the same type (a dict with the same keys, of the same types, in the same order; a
list of the same length; a number, string or None; a tensor), takes the tensors in the walk's order and builds
the skeleton in one expression from the values it read. For a tree of that shape, that is what flatten returns,
key for key; for any other, the plan answers None and the caller walks (and makes the new shape's plan).

The code is made from templates: the tree's keys reach it as constants, never as text. A tree holding anything
but dicts, lists and tuples of exact types, numbers, strings, None, tensors and numpy arrays gets no plan
(flatten alone takes it), as does one too big or too deep to be worth it.
"""
from __future__ import annotations

import collections
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import torch

from easyckpt.engine.shards.tree import Tensors, flatten

try:
    import numpy as np
except ImportError:  # numpy is optional for the engine
    np = None  # type: ignore[assignment]

_SCALARS = frozenset({int, float, bool, str, type(None)})
_KEYS = frozenset({int, bool, str, type(None)})
_DICTS = (dict, collections.OrderedDict)        # (a module's state_dict is an OrderedDict)
MAX_NODES = 2048        # a bigger tree gets no plan: making its code takes long (0.1 s for 1,000 tensors)
MAX_DEPTH = 40          # (the skeleton is one nested expression)
_GiveUp = ValueError    # the tree holds a node no plan takes (raised while writing a plan, caught by make)


class ConstantSkeleton(dict):
    """The skeleton of a plan whose tree holds no number, string or None: the same object at every snapshot, never
    changed (read by the slot's JSON only)."""


class FlatPlan:
    """``run(tree)``: flatten(tree) when ``tree`` has the shape of the tree the plan was made from, else None."""

    def __init__(self, run: Callable[[Any], Optional[Tuple[List[torch.Tensor], Any]]], keys: List[str]):
        self._run, self.keys = run, keys

    @classmethod
    def make(cls, tree: Any, tensors: Tensors) -> Optional["FlatPlan"]:
        """The plan of ``tree``, whose flatten gave ``tensors``; None when it holds a node no plan takes."""
        keys = [k for k, _ in tensors]
        writer = _Writer(keys)
        try:
            expr = writer.node("t0", tree, 0)
        except _GiveUp:             # a node no plan takes
            return None
        if writer.taken != len(keys):
            return None
        numpy = {"NDARRAY": np.ndarray, "contiguous": np.ascontiguousarray} if np is not None else {}
        scope: Dict[str, Any] = {
            "K": tuple(writer.consts), "C": tuple(writer.types), "KT": tuple(writer.key_tuples),
            "KTT": tuple(writer.key_types), "SC": _SCALARS, "TENSOR": torch.Tensor, "STRIDED": torch.strided,
            "from_numpy": torch.from_numpy, "CONSTANT": ConstantSkeleton, **numpy}
        body = "".join(f"    {line}\n" for line in writer.lines)
        # a tree without a number, string or None in it (a model's state dict) has the same skeleton at every
        # snapshot: built once and handed out as the same object, which tells the slot's JSON (metajson.py) it
        # is unchanged without a look at it (a model of 160 tensors: its skeleton's building and marshal, each time)
        made = f"S = CONSTANT({expr})\n" if writer.leaves == 0 and type(tree) in _DICTS else ""
        code = f"{made}def run(t0):\n    X = []\n{body}    return X, {'S' if made else expr}\n"
        exec(compile(code, "<easyckpt.treeplan>", "exec"), scope)    # noqa: S102 - our own templates only
        return cls(scope["run"], keys)

    def run(self, tree: Any) -> Optional[Tuple[Any, Tensors]]:
        try:
            got = self._run(tree)
        except (KeyError, IndexError, TypeError, AttributeError):
            return None             # (the checks come before each read, so this is a safety net only)
        if got is None:
            return None
        return got[1], list(zip(self.keys, got[0]))


class _Writer:
    """The lines of a plan's code and its skeleton expression, written along one tree."""

    def __init__(self, keys: List[str]) -> None:
        self.keys = keys                # the tensors' keys as flatten gave them, in its order
        self.lines: List[str] = []
        self.consts: List[Any] = []
        self.types: List[type] = []
        self.key_tuples: List[Tuple[Any, ...]] = []
        self.key_types: List[Tuple[type, ...]] = []
        self.taken = 0
        self.leaves = 0                 # the numbers, strings and None read into the skeleton
        self._names = 0

    def _child(self, var: str, index: str) -> str:
        self._names += 1
        if self._names > MAX_NODES:
            raise _GiveUp("too big")
        name = f"t{self._names}"
        self.lines.append(f"{name} = {var}[{index}]")
        return name

    def _tensor_key(self) -> str:
        if self.taken >= len(self.keys):
            raise _GiveUp("more tensors than the walk found")
        self.consts.append(self.keys[self.taken])
        self.taken += 1
        return f"K[{len(self.consts) - 1}]"

    def node(self, var: str, node: Any, depth: int) -> str:
        """The skeleton expression of ``node`` (read into ``var``); the checks and reads go to ``lines``."""
        if depth > MAX_DEPTH:
            raise _GiveUp("too deep")
        kind = type(node)
        if kind in _SCALARS:
            self.leaves += 1
            self.lines.append(f"if type({var}) not in SC: return None")
            return var
        if isinstance(node, torch.Tensor):
            self.lines.append(f"if not isinstance({var}, TENSOR) or {var}.layout is not STRIDED: return None")
            self.lines.append(f"X.append({var}.detach() if {var}.requires_grad else {var})")
            return '{"__t": %s}' % self._tensor_key()
        if np is not None and kind is np.ndarray:
            self.lines.append(f"if type({var}) is not NDARRAY: return None")
            self.lines.append(f"X.append(from_numpy(contiguous({var})))")
            return '{"__np": %s}' % self._tensor_key()
        if kind in _DICTS:
            return self._dict(var, node, depth)
        if kind is list or kind is tuple:
            self.types.append(kind)
            self.lines.append(f"if type({var}) is not C[{len(self.types) - 1}] or len({var}) != {len(node)}: "
                              f"return None")
            items = ", ".join(self.node(self._child(var, str(i)), v, depth + 1) for i, v in enumerate(node))
            return f"[{items}]" if kind is list else f'{{"__tuple": [{items}]}}'
        raise _GiveUp(kind.__name__)

    def _dict(self, var: str, node: Any, depth: int) -> str:
        keys = tuple(node)
        # (a float key neither: 0.0 and -0.0 are the same key of the same type, written differently)
        if any(type(k) not in _KEYS for k in keys):
            raise _GiveUp("a key that is not a plain value")
        plain = all(type(k) is str and not k.startswith("__") for k in keys)
        self.types.append(type(node))
        self.key_tuples.append(keys)
        self.key_types.append(tuple(type(k) for k in keys))    # (1, 1.0 and True are equal keys)
        j = len(self.types) - 1
        same = f"tuple({var}) != KT[{len(self.key_tuples) - 1}]"
        if not plain:
            same += f" or tuple(map(type, {var})) != KTT[{len(self.key_types) - 1}]"
        self.lines.append(f"if type({var}) is not C[{j}] or {same}: return None")
        parts = []
        for key, value in node.items():
            self.consts.append(key)
            k = f"K[{len(self.consts) - 1}]"
            sub = self.node(self._child(var, k), value, depth + 1)
            parts.append(f"{k}: {sub}" if plain else f"[{k}, {sub}]")
        return "{" + ", ".join(parts) + "}" if plain else '{"__dict": [' + ", ".join(parts) + "]}"


class Flattener:
    """flatten for the shards of one rank's snapshots, through the plan of each shard's last shape. A shard whose
    shape keeps changing (a list in it growing every step) soon gets no new plans: after ``EAGER_MAKES`` plans,
    another is made only once the last one served ``SERVED_BEFORE_REMAKE`` snapshots. The first snapshot only walks
    (its plan is made at the second): making a plan of a big state costs a few walks (about 0.1 s for 1,000
    tensors on the test VM), which the first save, the one a job waits for at its start, need not pay."""

    EAGER_MAKES = 4
    SERVED_BEFORE_REMAKE = 16

    def __init__(self) -> None:
        self._plans: Dict[str, Optional[FlatPlan]] = {}
        self._makes: Dict[str, int] = {}
        self._served: Dict[str, int] = {}
        self._walked: Set[str] = set()

    def flatten(self, relpath: str, tree: Any) -> Tuple[Any, Tensors]:
        plan = self._plans.get(relpath)
        if plan is not None:
            got = plan.run(tree)
            if got is not None:
                self._served[relpath] += 1
                return got
        skeleton, tensors = flatten(tree)
        if relpath not in self._walked:
            self._walked.add(relpath)
            return skeleton, tensors
        makes = self._makes.get(relpath, 0)
        if makes < self.EAGER_MAKES or self._served.get(relpath, 0) >= self.SERVED_BEFORE_REMAKE:
            self._plans[relpath] = FlatPlan.make(tree, tensors)
            self._makes[relpath], self._served[relpath] = makes + 1, 0
        return skeleton, tensors
