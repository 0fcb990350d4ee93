"""The package's layout keeps its promises (docs/ARCHITECTURE.md): each part imports only the parts
below it in the drawing (``ALLOWED``), no import cycles between its modules, the side of the
processes beside the trainer (write/, keeper/, format/, storage/) never needs torch or the
training and read sides at import time, and the commands reach a checkpoint only through its
``Storage``."""

import ast
import pathlib
import subprocess
import sys

import async_ckpt

PACKAGE = pathlib.Path(async_ckpt.__file__).parent


def _module_name(path: pathlib.Path) -> str:
    parts = ("async_ckpt",) + path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_targets(path: pathlib.Path, everywhere: bool = False):
    """``(module, names)`` of each ``from module import names`` and ``import module`` in ``path``
    (relative ones resolved), at its top level or ``everywhere`` (inside functions too)."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree) if everywhere else tree.body:
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = (".".join(parts[:len(parts) - node.level + 1])
                        if node.level <= len(parts) else "<above the package>")
                yield (f"{base}.{node.module}" if node.module else base), [a.name for a in node.names]
            else:
                yield node.module or "", [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            yield from ((a.name, []) for a in node.names)


def _imports(path: pathlib.Path, everywhere: bool = False) -> set[str]:
    """The package modules ``path`` imports when it is imported, or ``everywhere`` (imports
    inside functions too: deliberate lazy imports, which break no cycle at import time but are
    dependencies all the same)."""
    found = set()
    for target, names in _import_targets(path, everywhere):
        found |= {n for n in [f"{target}.{name}" for name in names] + [target] if n in MODULES}
    return found - {_module_name(path)}


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
GRAPH = {name: _imports(path) for name, path in MODULES.items()}
EVERY_IMPORT = {name: _imports(path, everywhere=True) for name, path in MODULES.items()}

# The drawing of docs/ARCHITECTURE.md: each part (a sub-package, or a module at the top) and the
# parts it may import besides itself and LEAVES, which every part may import.
LEAVES = {"async_ckpt", "errors", "checks"}
ALLOWED = {
    "storage": set(),
    "format": {"storage"},
    "write": {"format", "storage"},
    "keeper": {"write", "format", "storage"},  # write: how the trainer starts a process
    "distributed": set(),
    "stats": {"write"},  # the writer's figure records (write/protocol.py)
    "rng": set(),
    "determinism": set(),
    "tensors": {"rng"},
    "train": {"tensors", "rng", "write", "keeper", "format", "storage", "distributed"},
    "data": {"tensors"},
    "read": {"tensors", "rng", "format", "storage", "distributed"},
    "options": {"format", "storage", "distributed"},
    "engine": {"options", "stats", "data", "distributed", "tensors", "rng", "train", "write",
               "read", "format", "storage"},
    "tools": {"engine", "read", "tensors", "format", "storage"},  # the engine: import-dcp
    # rng, options, tools (the DCP interop torchtitan's adapter reuses): see docs/ARCHITECTURE.md
    "integrations": {"engine", "options", "data", "rng", "tools"},
    "__main__": {"tools"},
}


def _part(module: str) -> str:
    return module.split(".")[1] if "." in module else module


def test_every_part_has_its_place_in_the_drawing():
    parts = {_part(m) for m in MODULES} - LEAVES
    assert parts == ALLOWED.keys()


def test_each_part_imports_only_what_is_below_it_in_the_drawing():
    against = {(m.removeprefix("async_ckpt."), n.removeprefix("async_ckpt."))
               for m, imported in EVERY_IMPORT.items() for n in imported
               if _part(n) not in ALLOWED.get(_part(m), set()) | LEAVES | {_part(m)}}
    assert against == set(), "imports against docs/ARCHITECTURE.md"


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
    writer_side = [m for m in MODULES
                   if m.split(".")[1:2] in (["write"], ["keeper"], ["format"], ["storage"])]
    assert {"async_ckpt.write.writer", "async_ckpt.keeper.keeper"} <= set(writer_side)
    for module in writer_side:
        reached, todo = set(), [module]
        while todo:
            for nxt in GRAPH[todo.pop()] - reached:
                reached.add(nxt)
                todo.append(nxt)
        wrong = sorted(m for m in reached if m.split(".")[1:2] in (["train"], ["read"], ["tools"])
                       or m in ("async_ckpt.engine", "async_ckpt.data", "async_ckpt.distributed",
                                "async_ckpt.tensors", "async_ckpt.rng"))
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


# What touches a file system by a path, in the os module (and the builtin open).
_FILE_FUNCTIONS = {"open", "listdir", "scandir", "walk", "stat", "lstat", "unlink", "remove",
                   "rename", "replace", "rmdir", "mkdir", "makedirs", "exists", "lexists",
                   "isdir", "isfile", "islink", "getsize", "access", "chmod"}
# The commands that take a checkpoint DIR (or s3:// URL) and read nothing else: export also
# writes the file it is asked for, import-dcp reads a DCP checkpoint, supervise watches a run's
# local directory (through LocalStorage's heartbeats()).
_CHECKPOINT_COMMANDS = ["common", "ls", "inspect", "verify", "gc"]


def _file_calls(path: pathlib.Path) -> list[str]:
    calls = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Name) and f.id == "open":
            calls.append("open")
        elif isinstance(f, ast.Attribute) and f.attr in _FILE_FUNCTIONS:
            base = f.value
            chain = [base.attr, base.value.id] if isinstance(base, ast.Attribute) and isinstance(
                base.value, ast.Name) else [base.id] if isinstance(base, ast.Name) else []
            if chain and chain[-1] in ("os", "shutil", "pathlib"):
                calls.append(".".join(reversed(chain)) + "." + f.attr)
    return calls


def test_the_commands_reach_a_checkpoint_only_through_its_storage():
    """No os file function in the commands that work on a checkpoint, nor the local storage's
    modules (a lock is ``Storage.exclude_engines``): what they do on a directory they do alike
    on a bucket prefix (tests/test_cli_remote.py) or any other Storage (tests/test_storage.py)."""
    for name in _CHECKPOINT_COMMANDS:
        module = f"async_ckpt.tools.{name}"
        assert _file_calls(MODULES[module]) == [], module
        local = sorted(n for n in EVERY_IMPORT[module]
                       if n in ("async_ckpt.storage.local", "async_ckpt.storage.locks"))
        assert local == [], module


def test_every_import_of_the_package_names_one_of_its_modules():
    """A relative import that climbs out of the package, or names a module that moved, is found
    here even inside a function, where no other test may run it."""
    compiled = {_module_name(p.with_name(p.name.split(".")[0] + ".py"))
                for p in PACKAGE.rglob("*.so")} | {_module_name(p.with_suffix(".py"))
                                                   for p in PACKAGE.rglob("*.pyi")}
    known = MODULES.keys() | compiled
    wrong = sorted({(name, target) for name, path in MODULES.items()
                    for target, _ in _import_targets(path, everywhere=True)
                    if target.startswith(("async_ckpt", "<above")) and target not in known})
    assert not wrong, f"imports of modules that do not exist: {wrong}"


def _string_constants(path: pathlib.Path) -> set[str]:
    return {node.value for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)}


def test_no_module_outside_format_spells_out_a_tag_of_the_state_tree():
    """format/ owns the tags of the state tree (``{"$tensor": 3}``: ``format/tree.py``'s
    ``Leaf``) and of its value trees (``{"$tuple": [...]}``: ``format/values.py``'s ``Kind``);
    the others build and read the tree through them, so a tag is written in one place."""
    from async_ckpt.format.tree import Leaf
    from async_ckpt.format.values import Kind

    tags = {leaf.value for leaf in Leaf} | {kind.value for kind in Kind if kind.startswith("$")}
    spelled = {name: sorted(_string_constants(path) & tags) for name, path in MODULES.items()}
    assert {"$tensor", "$dtensor", "$tuple"} <= set(spelled["async_ckpt.format.tree"]
                                                     + spelled["async_ckpt.format.values"])
    assert {name: found for name, found in spelled.items()
            if found and _part(name) != "format"} == {}


# Keys of a shard index's storage table, replica digests, tensor table and sharded-tensor table
# (docs/FORMAT.md 3.4 to 3.7): format/ parses them into records (format/records.py), and no other
# module reads the parsed JSON by them.
_INDEX_KEYS = {"storages", "chunks", "ref", "chunks_xxh3", "index_xxh3", "replicas", "dtensors",
               "global_shape", "tensors", "tensor", "storage", "offset", "dtype", "shape",
               "stride"}
# Modules outside format/ with a message of their own that shares one of those keys.
_OWN_FORMATS = {"async_ckpt.keeper.protocol": "a hold's layout and the keeper's answer carry its "
                "'storages' (with their 'offset') and pass the tensor table on as 'tensors', "
                "which read_held checks with the format's validator",
                "async_ckpt.train.capture": "a group of tensors being planned has 'replicas' and "
                "its first 'tensor'"}


def _index_key_uses(path: pathlib.Path) -> list[str]:
    """Each ``x["key"]``, ``x.get("key")`` and ``"key" in x`` of ``path`` with a key of
    ``_INDEX_KEYS``, as ``line: key``."""
    uses = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Subscript):
            key = node.slice
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "get" and node.args):
            key = node.args[0]
        elif isinstance(node, ast.Compare) and isinstance(node.ops[0], (ast.In, ast.NotIn)):
            key = node.left
        else:
            continue
        if isinstance(key, ast.Constant) and key.value in _INDEX_KEYS:
            uses.append(f"{node.lineno}: {key.value}")
    return uses


def test_only_the_format_reads_a_parsed_index_by_its_keys():
    """The storage, tensor and sharded-tensor tables of a shard's index are read through
    format/'s records, built by its validators: a module outside format/ that indexes the parsed
    JSON is found here."""
    found = {name: uses for name, path in MODULES.items()
             if _part(name) != "format" and name not in _OWN_FORMATS
             for uses in [_index_key_uses(path)] if uses}
    assert not found, f"modules that read a parsed shard index by string key: {found}"
    assert all(_index_key_uses(MODULES[name]) for name in _OWN_FORMATS)  # each exemption is used


def test_only_the_format_touches_a_shard_readers_parsed_index():
    """``ShardReader.index`` is the parsed JSON; the others read a shard through the reader's
    records and accessors (``tensors``, ``storages``, ``tree``, ``is_shard_of``, ``data_files``,
    ...): an ``x.index`` outside format/ is found here (a staging slot's number and
    ``operator.index`` aside)."""
    found = {name: [f"{node.lineno}" for node in ast.walk(ast.parse(path.read_text()))
                    if isinstance(node, ast.Attribute) and node.attr == "index"
                    and not (isinstance(node.value, ast.Name)
                             and node.value.id in ("slot", "operator"))]
             for name, path in MODULES.items() if _part(name) != "format"}
    assert {name: lines for name, lines in found.items() if lines} == {}


def test_what_the_writer_tells_the_trainer_is_typed_all_the_way_down():
    """The writer's answers (``write/protocol.py``'s ``WriterEvent``) carry records, never a dict
    read by string keys in another module: a field typed ``dict`` (or holding one) is found
    here."""
    import dataclasses
    import typing

    from async_ckpt.write import protocol

    def dict_fields(cls, seen=()):
        for field in dataclasses.fields(cls):
            hint = typing.get_type_hints(cls)[field.name]
            for part in (hint, *typing.get_args(hint)):
                if part is dict or typing.get_origin(part) is dict:
                    yield f"{cls.__name__}.{field.name}"
                elif dataclasses.is_dataclass(part) and part not in seen:
                    yield from dict_fields(part, (*seen, cls))

    events = typing.get_args(protocol.WriterEvent)
    assert protocol.Committed in events and protocol.RemoteStatus in events
    assert [name for event in events for name in dict_fields(event)] == []


def test_the_command_line_decides_its_exit_codes_in_one_place():
    """``tools/common.py`` declares every exit code (``EXIT_*``) with the help that explains
    them; a command returning a number of its own (``return 2``, ``return 128 + signum``) is
    found here."""
    def is_int(node) -> bool:
        return isinstance(node, ast.Constant) and type(node.value) is int

    def is_code(value) -> bool:
        """``N``, ``N + x``, ``f(..., N)``, ``N if c else x``."""
        return (is_int(value) or isinstance(value, ast.BinOp) and (is_int(value.left)
                                                                  or is_int(value.right))
                or isinstance(value, ast.Call) and any(map(is_int, value.args))
                or isinstance(value, ast.IfExp) and (is_code(value.body) or is_code(value.orelse)))

    def literal_codes(path: pathlib.Path) -> list[str]:
        return [f"{node.lineno}: {ast.unparse(node.value)}"
                for node in ast.walk(ast.parse(path.read_text()))
                if isinstance(node, ast.Return) and is_code(node.value)]

    found = {name: codes for name, path in MODULES.items()
             if _part(name) == "tools" and name != "async_ckpt.tools.common"
             for codes in [literal_codes(path)] if codes}
    assert found == {}, f"exit codes decided outside tools/common.py: {found}"


def test_paths_become_storages_only_at_the_public_entry_points():
    """Below the edges every function takes a ``Storage``: a path or URL is turned into one by
    ``storage/open.py``'s ``open_storage`` at a public entry point (``async_ckpt.load``, the
    command line, the engine's constructor), so an ``s3://`` string can never reach a function
    that would take it for a local path. A parameter typed ``str | Storage`` is found here."""
    found = set()
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                arguments = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                for annotation in (a.annotation for a in arguments if a.annotation is not None):
                    text = ast.unparse(annotation)
                    if "Storage" in text and ("str" in text or "PathLike" in text):
                        found.add(f"{name}.{node.name}")
    assert found == {"async_ckpt.storage.open.open_storage", "async_ckpt.read.snapshot.load"}
