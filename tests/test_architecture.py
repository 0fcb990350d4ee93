"""The package's layout keeps its promises (docs/ARCHITECTURE.md): no import cycles between its
modules, and the writer process's side (write/, format/, storage/) never needs torch or the
training and read sides at import time."""

import ast
import pathlib
import subprocess
import sys

import async_ckpt

PACKAGE = pathlib.Path(async_ckpt.__file__).parent


def _module_name(path: pathlib.Path) -> str:
    parts = ("async_ckpt",) + path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _top_level_imports(path: pathlib.Path) -> set[str]:
    """The package modules ``path`` imports when it is imported (imports inside functions are
    deliberate lazy imports and do not count)."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            names = [f"{target}.{a.name}" for a in node.names]
            found |= {n for n in names + [target] if n in MODULES}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in MODULES}
    return found - {module}


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
GRAPH = {name: _top_level_imports(path) for name, path in MODULES.items()}


def test_no_import_cycles():
    state: dict[str, str] = {}
    cycles = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(GRAPH[node]):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt):] + [nxt] if nxt in stack else [node, nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for name in sorted(GRAPH):
        if name not in state:
            visit(name, [name])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_writer_side_imports_neither_torch_nor_the_training_or_read_side():
    writer_side = [m for m in MODULES if m.split(".")[1:2] in (["write"], ["format"], ["storage"])]
    assert "async_ckpt.write.writer" in writer_side
    for module in writer_side:
        reached, todo = set(), [module]
        while todo:
            for nxt in GRAPH[todo.pop()] - reached:
                reached.add(nxt)
                todo.append(nxt)
        wrong = sorted(m for m in reached if m.split(".")[1:2] in (["train"], ["read"], ["tools"])
                       or m in ("async_ckpt.engine", "async_ckpt.data", "async_ckpt.distributed"))
        assert not wrong, f"{module} imports {wrong}"
    code = ("import sys\n" + "".join(f"import {m}\n" for m in writer_side)
            + "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_nothing_in_the_library_imports_the_framework_adapters():
    """async_ckpt.integrations sits on top: a framework is needed only by its adapter's users."""
    inside = [m for m in MODULES if m.split(".")[1:2] != ["integrations"]]
    wrong = {m: sorted(n for n in GRAPH[m] if n.startswith("async_ckpt.integrations"))
             for m in inside}
    assert not {m: n for m, n in wrong.items() if n}
