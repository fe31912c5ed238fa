"""Whether a JSON schema's `$ref`s leave it any finite value to match.

llguidance compiles a schema whose references loop without end (``{"$ref": "#"}``, two
definitions that name each other, an object that requires a property of its own type)
into a grammar that matches nothing: the model may only stop at once, and the reply is
empty. `ref_loop` finds such a schema before it is used.

The test is productivity, as for a context-free grammar's nonterminals. Each subschema is
a node that can match a finite value when all of its conjuncts can (its `$ref` target,
its `allOf` members, one member of each `anyOf` / `oneOf`) and, when `type` limits it to
objects and arrays, the parts such a value must hold can (the `required` properties, the
first `minItems` items). Every other keyword is assumed satisfiable, so the test only ever
refuses a schema that truly matches nothing; one it cannot follow (a `$ref` by `$id` or
anchor, a nested `$id`) passes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import unquote

Path = tuple[str | int, ...]


class _Graph:
    """An and-or graph over subschemas: a node is satisfiable when all of an "and" node's
    children are, or any of an "or" node's."""

    def __init__(self, root: Any) -> None:
        self.root = root
        self.kinds: list[str] = []  # "and" | "or"
        self.children: list[list[int]] = []
        self.refs: dict[int, str] = {}  # node -> the $ref it follows, for the message
        self._ids: dict[Path, int] = {}
        self._todo: list[tuple[int, Path, Any]] = []

    def node(self, path: Path, schema: Any) -> int:
        if path not in self._ids:
            self._ids[path] = self._new("and")
            self._todo.append((self._ids[path], path, schema))
        return self._ids[path]

    def _new(self, kind: str, children: list[int] | None = None) -> int:
        self.kinds.append(kind)
        self.children.append(children or [])
        return len(self.kinds) - 1

    def build(self) -> bool:
        """Expand every reachable subschema; False when the schema is beyond this test."""
        self.node((), self.root)
        while self._todo:
            i, path, schema = self._todo.pop()
            if schema is False:
                self.kinds[i] = "or"  # no children: never satisfiable
            if not isinstance(schema, Mapping):
                continue
            if path and "$id" in schema:
                return False  # refs below resolve against another base
            self.children[i] = self._conjuncts(path, schema, i)
        return True

    def _conjuncts(self, path: Path, schema: Mapping[str, Any], i: int) -> list[int]:
        out = []
        ref = schema.get("$ref")
        if isinstance(ref, str) and (target := _resolve(self.root, ref)) is not None:
            out.append(self.node(*target))
            self.refs[i] = ref
        out += [self.node((*path, "allOf", j), s) for j, s in _items(schema, "allOf")]
        for key in ("anyOf", "oneOf"):
            if isinstance(schema.get(key), list):
                members = [self.node((*path, key, j), s) for j, s in _items(schema, key)]
                out.append(self._new("or", members))
        types = schema.get("type")
        types = [types] if isinstance(types, str) else types
        if _only_containers(types):
            shapes = []  # a value of any one of the allowed types will do
            if "object" in types:
                shapes.append(self._new("and", self._required(path, schema)))
            if "array" in types:
                shapes.append(self._new("and", self._first_items(path, schema)))
            out.append(self._new("or", shapes))
        return out

    def _required(self, path: Path, schema: Mapping[str, Any]) -> list[int]:
        props, required = schema.get("properties"), schema.get("required")
        if not isinstance(props, Mapping) or not isinstance(required, list):
            return []
        return [
            self.node((*path, "properties", name), props[name])
            for name in required
            if isinstance(name, str) and name in props
        ]

    def _first_items(self, path: Path, schema: Mapping[str, Any]) -> list[int]:
        need = schema.get("minItems", 0)
        if not isinstance(need, int) or need <= 0:
            return []
        prefix = schema.get("prefixItems")
        prefix = prefix if isinstance(prefix, list) else []
        out = [self.node((*path, "prefixItems", j), s) for j, s in enumerate(prefix[:need])]
        items = schema.get("items")
        if need > len(prefix) and isinstance(items, Mapping | bool):
            out.append(self.node((*path, "items"), items))
        return out

    def satisfiable(self) -> list[bool]:
        """Which nodes can match a finite value: the least fixed point, by a worklist."""
        n = len(self.kinds)
        parents: list[list[int]] = [[] for _ in range(n)]
        for i, kids in enumerate(self.children):
            for k in kids:
                parents[k].append(i)
        waiting = [len(kids) for kids in self.children]  # an "and" node's unsatisfied kids
        done = [False] * n
        ready = [i for i in range(n) if self.kinds[i] == "and" and not self.children[i]]
        for i in ready:
            done[i] = True
        while ready:
            k = ready.pop()
            for p in parents[k]:
                waiting[p] -= 1
                if not done[p] and (self.kinds[p] == "or" or waiting[p] == 0):
                    done[p] = True
                    ready.append(p)
        return done


def ref_loop(schema: Any) -> str | None:
    """None when `schema` can match some finite JSON value (or the test cannot tell);
    otherwise the message of why not, naming a `$ref` on the loop when there is one."""
    graph = _Graph(schema)
    if not graph.build():
        return None
    done = graph.satisfiable()
    if done[0]:
        return None
    loops = [ref for i, ref in graph.refs.items() if not done[i]]
    if loops:
        return f"no finite JSON value matches the schema: its $ref {loops[0]!r} loops back"
    return "no JSON value matches the schema"


def _only_containers(types: Any) -> bool:
    """Whether a `type` keyword allows objects and/or arrays only."""
    if not isinstance(types, list) or not types:
        return False
    return all(t in ("object", "array") for t in types)


def _items(schema: Mapping[str, Any], key: str) -> list[tuple[int, Any]]:
    value = schema.get(key)
    return list(enumerate(value)) if isinstance(value, list) else []


def _resolve(root: Any, ref: str) -> tuple[Path, Any] | None:
    """A local JSON pointer ("#", "#/$defs/a") -> (its path, the subschema there)."""
    if ref == "#":
        return (), root
    if not ref.startswith("#/"):
        return None  # another document, an $id or an anchor: not followed
    path: list[str | int] = []
    node = root
    for raw in ref[2:].split("/"):
        key = unquote(raw).replace("~1", "/").replace("~0", "~")
        if isinstance(node, Mapping) and key in node:
            path.append(key)
            node = node[key]
        elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
            path.append(int(key))
            node = node[int(key)]
        else:
            return None
    return tuple(path), node
