"""Every long-lived ATOM process applies contract 7 (docs/architecture.md), checked on the source
(AST), not on imports.

Process entry points are found, not listed: every function handed to `Process(target=...)`, and
every function that runs a server loop (`uvicorn.Server`, `uvicorn.run`, `kopf.run`). From each
entry point, the functions, methods and classes of its own module that it calls or references
are followed; among them there must be calls to `set_process_title(...)`, `apply_gc_policy(...)`
and `release_gc_policy(...)`. Modules that build an engine (EngineCore/ModelRunner) without being
a process of their own must be declared below with the reason.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
SOURCE_ROOTS = [ROOT / "runtime", ROOT / "operator"]
REQUIRED = ("set_process_title", "apply_gc_policy", "release_gc_policy")
ENGINE_BUILDERS = {"EngineCore", "ModelRunner"}
# A uvicorn.Config marks a server process too: `atom serve` runs a uvicorn.Server subclass.
SERVER_LOOPS = {("uvicorn", "Server"), ("uvicorn", "Config"), ("uvicorn", "run"), ("kopf", "run")}
# The shared uvicorn settings (web/listen.py): a function calling it starts a server loop too.
SERVER_CALLS = {"uvicorn_config"}

# Modules that build an engine inside someone else's process, and whose process that is.
LIBRARY_MODULES = {
    "atom_runtime.llm": "offline LLM: runs in the user's interpreter, which owns its GC",
    "atom_runtime.worker.executor": "tensor-parallel rank 0, inside the EngineCore process",
}


def _name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


@dataclass
class ModuleInfo:
    name: str
    tree: ast.Module
    defs: dict[str, list[ast.AST]] = field(default_factory=dict)  # name -> defs of that name
    imports: dict[str, str] = field(default_factory=dict)  # local name -> defining module

    @classmethod
    def parse(cls, name: str, source: str) -> ModuleInfo:
        info = cls(name, ast.parse(source))
        for node in ast.walk(info.tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                info.defs.setdefault(node.name, []).append(node)
            elif isinstance(node, ast.ImportFrom) and node.module:
                for alias in node.names:
                    info.imports[alias.asname or alias.name] = node.module
        return info

    def reachable_calls(self, entry: ast.AST, modules: dict[str, ModuleInfo]) -> set[str]:
        """Names called anywhere in the code reachable from `entry`: in this module, and in the
        project modules its reachable code names through `from ... import` (an entry point may
        leave the work to a class defined elsewhere, e.g. the API server's state and app)."""
        seen: set[int] = set()
        called: set[str] = set()
        todo: list[tuple[ModuleInfo, ast.AST]] = [(self, entry)]
        while todo:
            info, node = todo.pop()
            if id(node) in seen:
                continue
            seen.add(id(node))
            for sub in ast.walk(node):
                if isinstance(sub, ast.Call) and (n := _name(sub.func)):
                    called.add(n)
                if isinstance(sub, (ast.Name, ast.Attribute)) and (n := _name(sub)):
                    todo.extend((info, d) for d in info.defs.get(n, []))
                    other = modules.get(info.imports.get(n, ""))
                    if other is not None and other is not info:
                        todo.extend((other, d) for d in other.defs.get(n, []))
        return called

    def builds_engine(self) -> bool:
        return any(
            isinstance(n, ast.Call) and _name(n.func) in ENGINE_BUILDERS
            for n in ast.walk(self.tree)
        )


def _server_loop_functions(info: ModuleInfo) -> list[str]:
    found = []
    for defs in info.defs.values():
        for fn in defs:
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if fn.name in SERVER_CALLS:  # the settings helper itself, not a process's loop
                continue
            for n in ast.walk(fn):
                f = n.func if isinstance(n, ast.Call) else None
                if (
                    isinstance(f, ast.Attribute)
                    and isinstance(f.value, ast.Name)
                    and (f.value.id, f.attr) in SERVER_LOOPS
                ) or (isinstance(f, ast.Name) and f.id in SERVER_CALLS):
                    found.append(fn.name)
                    break
    return found


def _spawn_targets(info: ModuleInfo) -> list[tuple[str, str]]:
    """(module, function) for every `...Process(target=f, ...)` in this module."""
    out = []
    for n in ast.walk(info.tree):
        if isinstance(n, ast.Call) and _name(n.func) == "Process":
            for kw in n.keywords:
                if kw.arg == "target" and (target := _name(kw.value)):
                    out.append((info.imports.get(target, info.name), target))
    return out


def load_modules() -> dict[str, ModuleInfo]:
    modules = {}
    for root in SOURCE_ROOTS:
        for path in root.rglob("*.py"):
            name = ".".join(path.relative_to(root).with_suffix("").parts)
            modules[name.removesuffix(".__init__")] = ModuleInfo.parse(name, path.read_text())
    return modules


def entry_points(modules: dict[str, ModuleInfo]) -> set[tuple[str, str]]:
    entries = set()
    for info in modules.values():
        entries.update(_spawn_targets(info))
        entries.update((info.name, fn) for fn in _server_loop_functions(info))
    return entries


def violations(modules: dict[str, ModuleInfo]) -> list[str]:
    problems = []
    entries = entry_points(modules)
    for module, fn in sorted(entries):
        info = modules.get(module)
        if info is None or fn not in info.defs:
            problems.append(f"{module}.{fn}: process entry point not found in the source")
            continue
        called = set().union(*(info.reachable_calls(d, modules) for d in info.defs[fn]))
        missing = [r for r in REQUIRED if r not in called]
        if missing:
            problems.append(f"{module}.{fn} does not call {', '.join(missing)}")
    entry_modules = {m for m, _ in entries}
    for name, info in sorted(modules.items()):
        if info.builds_engine() and name not in entry_modules and name not in LIBRARY_MODULES:
            problems.append(f"{name} builds an engine but is neither a process entry point "
                            "applying the GC policy nor a declared library module")  # fmt: skip
    return problems


def test_every_process_entry_point_applies_gc_policy_and_title():
    modules = load_modules()
    entries = entry_points(modules)
    # The processes this checker must see (it fails if discovery breaks).
    assert {
        ("atom_runtime.engine.core_proc", "run_engine_core"),
        ("atom_runtime.server.api_server", "serve"),
    } <= entries
    assert violations(modules) == []


def test_library_modules_still_build_an_engine():
    modules = load_modules()
    for name in LIBRARY_MODULES:
        assert modules[name].builds_engine(), f"{name} no longer builds an engine: drop it"


BAD_PROCESS = """
import multiprocessing
from atom_runtime.system.process import apply_gc_policy, set_process_title

def start():
    multiprocessing.get_context("spawn").Process(target=run_thing).start()

def run_thing():
    set_process_title("Thing")
    engine = EngineCore(config)
    warm_up(engine)

def warm_up(engine):
    apply_gc_policy()
"""

GOOD_SERVER = """
import uvicorn
from atom_runtime.system.process import apply_gc_policy, release_gc_policy, set_process_title

class State:
    def ready(self):
        apply_gc_policy()

async def serve():
    set_process_title("Thing")
    state = State()
    app = build(state)
    await uvicorn.Server(app).serve()

def build(state):
    async def lifespan(app):
        yield
        release_gc_policy()
    return lifespan
"""

IMPORT_ONLY = """
import uvicorn
from atom_runtime.system.process import apply_gc_policy, release_gc_policy, set_process_title

def serve():
    uvicorn.run(app)
"""


def test_checker_names_a_process_missing_a_call():
    modules = {"pkg.bad": ModuleInfo.parse("pkg.bad", BAD_PROCESS)}
    assert violations(modules) == ["pkg.bad.run_thing does not call release_gc_policy"]


def test_checker_follows_methods_and_nested_functions():
    modules = {"pkg.good": ModuleInfo.parse("pkg.good", GOOD_SERVER)}
    assert entry_points(modules) == {("pkg.good", "serve")}
    assert violations(modules) == []


def test_checker_is_not_fooled_by_imports():
    modules = {"pkg.imp": ModuleInfo.parse("pkg.imp", IMPORT_ONLY)}
    assert violations(modules) == [
        "pkg.imp.serve does not call set_process_title, apply_gc_policy, release_gc_policy"
    ]


def test_checker_flags_an_undeclared_engine_builder():
    src = "def make():\n    return EngineCore(config)\n"
    modules = {"pkg.lib": ModuleInfo.parse("pkg.lib", src)}
    assert violations(modules) == [
        "pkg.lib builds an engine but is neither a process entry point applying the GC policy "
        "nor a declared library module"
    ]
