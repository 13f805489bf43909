"""The import graph of anectypes and its dashboard, read from the source (every import, also those inside
functions): no circle, and nothing imports upward (docs/architecture.md has the layers)."""

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# lowest first; a module belongs to the longest prefix that names it
LAYERS = [["anectypes", "anectypes.errors"],
          ["anectypes.host", "anectypes.cli"],
          ["anectypes.mil"],
          ["anectypes.device"],
          ["anectypes.model"],
          ["anectypes.data"],
          ["anectypes.formats"],
          ["anectypes.runs"],
          ["anectypes.sources"],
          ["anectypes.train", "anectypes.generate", "anectypes.eval"],
          ["anectypes.bench"],
          ["anectypes.doctor", "anectypes.export", "anectypes.mil.__main__"],       # the commands
          ["anectypes.dashboard", "anectypes.web"]]


def modules():
    """{dotted name: (path, is a package)} of every module; web/ is anectypes.web, as it installs."""
    out = {}
    for path in [*(ROOT / "anectypes").rglob("*.py"), *(ROOT / "web").rglob("*.py")]:
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[0] == "web":
            parts.insert(0, "anectypes")
        package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if package else parts)] = (path, package)
    return out


def imports(name, path, package, known):
    """The modules of `known` that module `name` imports (`from PKG import mod` counts as mod alone)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if package else name.split(".")[:-1]
                source = ".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module else []))
            else:
                source = node.module
            subs = {f"{source}.{a.name}" for a in node.names} & set(known)
            found |= subs if subs and len(subs) == len(node.names) else subs | ({source} & set(known))
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names} & set(known)
    return found - {name}


def graph():
    known = modules()
    return {name: imports(name, path, package, known) for name, (path, package) in known.items()}


def layer(name):
    hits = [(len(prefix), i) for i, group in enumerate(LAYERS) for prefix in group
            if name == prefix or name.startswith(prefix + ".")]
    return max(hits)[1]


def test_every_module_has_a_layer_and_none_imports_upward():
    edges = graph()
    up = sorted(f"{a} -> {b}" for a, deps in edges.items() for b in deps if layer(b) > layer(a))
    assert not up, up


def test_the_import_graph_has_no_circle():
    edges = graph()
    state, circles = {}, []

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(edges[node]):
            if state.get(nxt) == "open":
                circles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"
    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    assert not circles, circles


def test_the_check_sees_a_circle_and_an_upward_import(monkeypatch):
    """The two checks above can fail: a model module importing the trainer is both."""
    edges = graph()
    edges["anectypes.model.config"] = edges["anectypes.model.config"] | {"anectypes.train.trainer"}
    monkeypatch.setattr(sys.modules[__name__], "graph", lambda: edges)
    assert layer("anectypes.train.trainer") > layer("anectypes.model.config")
    for check in (test_every_module_has_a_layer_and_none_imports_upward, test_the_import_graph_has_no_circle):
        try:
            check()
        except AssertionError:
            continue
        raise AssertionError(f"{check.__name__} missed it")
