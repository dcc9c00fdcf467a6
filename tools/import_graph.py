"""kvprobe's own import graph, read from the source (nothing is imported): its circles and its arrows back up.

    python tools/import_graph.py [--root DIR] [--list]

Every ``.py`` file under ``kvprobe/`` and ``experiments/`` (as ``kvprobe.experiments.*``) is a module; an edge is
an ``import`` / ``from ... import`` of another kvprobe module, wherever it is written. Each edge has a kind:
``top`` (module scope, run at import), ``lazy`` (inside a function or method) or ``typing`` (under
``if TYPE_CHECKING:``, never run). ``from pkg import name`` is an edge to ``pkg.name`` when that is a module,
else to ``pkg``; the implicit import of a parent package's ``__init__`` is not counted (as grimp does not).

- **circles**: strongly connected components of more than one module in the graph of runtime edges
  (``top`` and ``lazy``: a function-local import closes a circle as surely as a top-level one).
- **rooms**: ``kvprobe/<part>/`` or ``kvprobe/<part>.py`` (the package's ``__init__`` is the room ``kvprobe``),
  and ``experiments``. Room edges are the module edges between two rooms, of any kind.
- **arrows back up**: the fewest room arrows that point up in any layering of the rooms (an exact minimum
  feedback arc set of the room graph, edges of every kind counted once per room pair): 0 exactly when the rooms
  import each other in no circle, however lazily. The arrows listed are those of the best layering found.
- **floors**: that layering's height of each room: floor 0 imports no other room, any other room stands one
  floor above the highest room it imports down to.

``--list`` prints each circle's modules and each arrow back up with the files that make it.
tests/test_import_graph.py holds the numbers to their targets (0 circles, at most 2 arrows back up).
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

PACKAGE = "kvprobe"
MAPPED = {"experiments": "kvprobe.experiments"}  # top-level folders installed inside the package


@dataclass
class Graph:
    modules: dict[str, Path]
    # (importer, imported) -> kinds seen ("top", "lazy", "typing") with the importing file's line numbers
    edges: dict[tuple[str, str], dict[str, list[int]]] = field(default_factory=dict)

    def add(self, src: str, dst: str, kind: str, line: int) -> None:
        if src != dst:
            self.edges.setdefault((src, dst), {}).setdefault(kind, []).append(line)


def module_files(root: Path) -> dict[str, Path]:
    """module name -> file, for kvprobe/ and the mapped top-level folders."""
    out: dict[str, Path] = {}
    for folder, name in ((PACKAGE, PACKAGE), *MAPPED.items()):
        base = root / folder
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(base).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"] if rel.name == "__init__" else list(rel.parts)
            out[".".join([name, *parts])] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, modules: dict[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        if node.level:  # relative import
            base = module.split(".") if is_package else module.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            pkg = ".".join(base + ([node.module] if node.module else []))
        else:
            pkg = node.module or ""
        names = [f"{pkg}.{a.name}" if f"{pkg}.{a.name}" in modules else pkg for a in node.names]
    out = []
    for name in names:
        while name and name not in modules:  # `import kvprobe.x.y` of a name inside a module: that module
            name = name.rpartition(".")[0]
        if name:
            out.append(name)
    return out


def read_graph(root: Path) -> Graph:
    modules = module_files(root)
    graph = Graph(modules)
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"

        def visit(node: ast.AST, kind: str) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    for dst in _targets(child, module, is_package, modules):
                        graph.add(module, dst, kind, child.lineno)
                    continue
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                    visit(child, "lazy" if kind == "top" else kind)
                elif isinstance(child, ast.If) and _is_type_checking(child.test):
                    for stmt in child.body:
                        visit(ast.Module(body=[stmt], type_ignores=[]), "typing")
                    for stmt in child.orelse:
                        visit(ast.Module(body=[stmt], type_ignores=[]), kind)
                else:
                    visit(child, kind)

        visit(tree, "top")
    return graph


def sccs(nodes: list[str], succ: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components (iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on, stack, out = set(), [], []
    counter = 0
    for start in nodes:
        if start in index:
            continue
        work = [(start, iter(sorted(succ.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(succ.get(w, ())))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    out.append(sorted(comp))
    return out


def circles(graph: Graph) -> list[list[str]]:
    succ: dict[str, set[str]] = defaultdict(set)
    for (a, b), kinds in graph.edges.items():
        if "top" in kinds or "lazy" in kinds:
            succ[a].add(b)
    return sorted((c for c in sccs(sorted(graph.modules), succ) if len(c) > 1), key=lambda c: (-len(c), c))


def room_of(module: str) -> str:
    parts = module.split(".")
    return "experiments" if parts[:2] == ["kvprobe", "experiments"] else (parts[1] if len(parts) > 1 else PACKAGE)


def room_edges(graph: Graph) -> dict[tuple[str, str], list[str]]:
    """(room A, room B) -> 'importer -> imported (kind, line ...)' of each module edge between two rooms."""
    out: dict[tuple[str, str], list[str]] = defaultdict(list)
    for (a, b), kinds in sorted(graph.edges.items()):
        if room_of(a) != room_of(b):
            out[(room_of(a), room_of(b))] += [f"{a} -> {b} ({k}, line {', '.join(map(str, ls))})"
                                              for k, ls in kinds.items()]
    return dict(out)


def _best_order(rooms: list[str], arrows: set[tuple[str, str]]) -> list[str]:
    """The rooms of one strongly connected set, bottom first, in an order with the fewest arrows pointing up
    (an exact minimum feedback arc set, by dynamic programming over subsets: fine for the ~20 rooms here)."""
    n = len(rooms)
    if n > 22:
        raise SystemExit(f"{n} rooms in one circle: too many for the exact layering")
    idx = {r: i for i, r in enumerate(rooms)}
    importers = [0] * n  # importers[v]: the rooms that import v (placed below v, each is an arrow up)
    for a, b in arrows:
        if a in idx and b in idx:
            importers[idx[b]] |= 1 << idx[a]
    full = (1 << n) - 1
    cost = [0] + [n * n] * full
    choice = [-1] * (full + 1)
    for s in range(full + 1):
        if cost[s] == n * n and s:
            continue
        for v in range(n):
            if not s >> v & 1:
                t = s | 1 << v
                c = cost[s] + bin(importers[v] & s).count("1")
                if c < cost[t]:
                    cost[t], choice[t] = c, v
    order, s = [], full
    while s:
        order.append(rooms[choice[s]])
        s &= ~(1 << choice[s])
    return order[::-1]


def floors(graph: Graph) -> dict[str, int]:
    """Each room's floor in the layering with the fewest arrows pointing up: within each set of rooms that
    import each other (directly or not), the order of :func:`_best_order`; then each room one floor above the
    highest room it imports down to (floor 0: imports no other room)."""
    rooms = sorted({room_of(m) for m in graph.modules})
    arrows = set(room_edges(graph))
    succ: dict[str, set[str]] = defaultdict(set)
    for a, b in arrows:
        succ[a].add(b)
    rank: dict[str, int] = {}
    for comp in sccs(rooms, succ):
        for i, r in enumerate(_best_order(comp, arrows) if len(comp) > 1 else comp):
            rank[r] = i
    comp_of = {r: i for i, comp in enumerate(sccs(rooms, succ)) for r in comp}
    down = {(a, b) for a, b in arrows if comp_of[a] != comp_of[b] or rank[b] < rank[a]}
    memo: dict[str, int] = {}

    def height(r: str) -> int:
        if r not in memo:
            memo[r] = 1 + max((height(b) for a, b in down if a == r), default=-1)
        return memo[r]

    return {r: height(r) for r in rooms}


def arrows_back_up(graph: Graph) -> dict[tuple[str, str], list[str]]:
    """The room arrows that point to the importer's floor or above (in the layering of :func:`floors`), with
    the module imports that make each."""
    floor = floors(graph)
    return {(a, b): where for (a, b), where in room_edges(graph).items() if floor[b] >= floor[a]}


def summary(root: Path) -> dict[str, object]:
    graph = read_graph(root)
    floor = floors(graph)
    lazy = sum(len(k.get("lazy", ())) for k in graph.edges.values())
    return {"modules": len(graph.modules), "edges": len(graph.edges), "lazy imports": lazy,
            "rooms": len(floor), "floors": max(floor.values()) + 1, "room arrows": len(room_edges(graph)),
            "circles": circles(graph), "arrows back up": arrows_back_up(graph), "floor of": floor}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", default=str(Path(__file__).resolve().parents[1]), help="the checkout to read")
    parser.add_argument("--list", action="store_true", help="print each circle and each arrow back up")
    args = parser.parse_args(argv)
    s = summary(Path(args.root))
    print(f"modules {s['modules']}, module edges {s['edges']} ({s['lazy imports']} function-local imports); "
          f"rooms {s['rooms']}, floors {s['floors']}, room arrows {s['room arrows']}")
    print(f"circles: {len(s['circles'])}")
    print(f"arrows back up: {len(s['arrows back up'])}")
    if args.list:
        for c in s["circles"]:
            print(f"  circle of {len(c)}: {' '.join(c)}")
        floor = s["floor of"]
        for (a, b), where in s["arrows back up"].items():
            print(f"  {a} (floor {floor[a]}) -> {b} (floor {floor[b]}):")
            for w in where:
                print(f"    {w}")
        print("  floors: " + ", ".join(f"{r} {f}" for r, f in sorted(floor.items(), key=lambda x: (-x[1], x[0]))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
