"""The package's import structure, computed from its own source (``ast``, no import executed): no circle of
imports anywhere in ``abbench/``, and no import from a floor to a higher one.

Every import counts: at module level, inside functions (a deferred import still ties the two modules) and
under ``TYPE_CHECKING``. Module A imports module B when A names B, or a name from B, in an import statement;
``from abbench.x import y`` imports ``abbench.x.y`` when that is a module, else ``abbench.x``.

The floors, lowest first (:data:`FLOORS`): a module may import modules of its own floor and of the floors
below it, never above. Every module of the package must sit on a floor, so a new module is placed
deliberately.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "abbench"

FLOORS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("abbench", "abbench.errors", "abbench.signals")),
    # the recipe for a GPU run: the standard library alone (it runs before the carried wheels are installed)
    ("device recipe", ("abbench.devicerun",)),
    # the vendored engine, in wings (ENGINE_WINGS): imports nothing of the harness (see also the tests below).
    # its contract and configuration: no torch
    ("engine contract", ("abbench.engine.contract", "abbench.engine.config", "abbench.engine.shapes",
                         "abbench.engine.stats")),
    ("engine ops", ("abbench.engine.ops",)),  # tensor functions and kernels, no model, no state
    ("engine models", ("abbench.engine.models",)),  # one file per family, the model interface, the host bank
    ("engine runtime", ("abbench.engine.runtime",)),  # Engine, prefill, decode, slot caches, plans, policy
    # the HTTP layer and the reference backend: on the contract (the tests below keep the runtime out of it)
    ("engine serve", ("abbench.engine.serve",)),
    ("engine tools", ("abbench.engine.tools",)),  # gpuchecks and reference kernels: nothing below imports them
    # the one command line of both serving backends (neither backend imports it) and the package's lazy Engine
    ("engine launcher", ("abbench.engine", "abbench.engine.serve.launch", "abbench.engine.__main__")),
    # pure formats and records, nothing of the profile: the declared checks' grammar and the wire adapters
    # sit here, below the profile that validates with them
    ("formats and records", ("abbench.prometheus", "abbench.nvml", "abbench.sse", "abbench.results",
                             "abbench.tokenizers", "abbench.auth", "abbench.checkexpr", "abbench.schedule",
                             "abbench.adapters", "abbench.loadrecords", "abbench.vocabrows")),
    ("peer engines", ("abbench.peers",)),
    ("profile", ("abbench.profile",)),
    ("analysis", ("abbench.analysis",)),  # pure: derived numbers and the gate, from results
    ("services and requests", ("abbench.response", "abbench.client", "abbench.services", "abbench.ports",
                               "abbench.telemetry", "abbench.prompts", "abbench.fingerprint",
                               "abbench.loadgen")),
    # the runner's plans (fixed rounds, auto rounds, sweeps): what to measure next, from the record; below the run
    # loop, the service slot and the requests, which they never import
    ("runner plans", ("abbench.runner.plans", "abbench.runner.rounds", "abbench.runner.sweep")),
    ("runner", ("abbench.runner",)),
    # what reads runs (report, compare) and the diagnostics, which launch services through the runner
    ("reports and diagnostics", ("abbench.report", "abbench.compare", "abbench.compare_load", "abbench.diagnostics")),
    ("command line", ("abbench.cli", "abbench.__main__")),
]


def _modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for p in sorted(PACKAGE.rglob("*.py")):
        parts = list(p.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


MODULES = _modules()


def _owner(name: str) -> str | None:
    """The module that ``name`` (a dotted name under abbench) is, or is in."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path) -> Iterator[str]:
    """The abbench modules ``module`` imports (module docstring)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in MODULES else source for a in node.names]
        else:
            continue
        for t in targets:
            if t == "abbench" or t.startswith("abbench."):
                owner = _owner(t)
                if owner is not None and owner != module:
                    yield owner


@functools.cache
def graph() -> dict[str, list[str]]:
    """Module -> the abbench modules it imports. Built when a test first asks, not at import: every xdist worker
    imports this file to collect it (parsing the whole package took ~1.2 s of CPU in each), one runs it."""
    return {m: sorted(set(_imports(m, p))) for m, p in MODULES.items()}


def _floor(module: str) -> int | None:
    best, best_len = None, -1
    for i, (_, members) in enumerate(FLOORS):
        for m in members:
            hit = module == m or (m != "abbench" and module.startswith(m + "."))
            if hit and len(m) > best_len:
                best, best_len = i, len(m)
    return best


def _circles(graph: dict[str, list[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), and modules that import themselves."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:  # the package is a few dozen modules deep at most
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, []):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_is_read_from_the_source() -> None:
    """The walk sees what it must: deferred imports, relative imports and ``from abbench import x``."""
    assert "abbench.engine.serve.launch" in graph()["abbench.cli.engine"]  # inside the serve command's body
    assert "abbench.engine.config" in graph()["abbench.engine"]  # `from abbench.engine.config import ...`
    assert "abbench.engine.runtime.engine" in graph()["abbench.engine"]  # deferred, in __getattr__
    assert "abbench.runner" in graph()["abbench.cli.experiment"]  # `from abbench import runner`
    assert len(MODULES) > 80


def test_the_circle_finder_finds_circles() -> None:
    assert _circles({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == [["a", "b", "c"]]
    assert _circles({"a": ["b"], "b": []}) == []


def test_no_import_circle_in_the_package() -> None:
    circles = _circles(graph())
    assert not circles, "import circles: " + "; ".join(" <-> ".join(c) for c in circles)


def test_every_module_sits_on_a_floor() -> None:
    unplaced = [m for m in MODULES if _floor(m) is None]
    assert not unplaced, f"modules on no floor (add them to FLOORS): {unplaced}"


def test_no_import_runs_up_a_floor() -> None:
    upward = []
    for m, targets in graph().items():
        for t in targets:
            fm, ft = _floor(m), _floor(t)
            if fm is not None and ft is not None and ft > fm:
                upward.append(f"{m} ({FLOORS[fm][0]}) imports {t} ({FLOORS[ft][0]})")
    assert not upward, "imports from a lower floor to a higher one:\n" + "\n".join(upward)


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("abbench.engine")))
def test_the_engine_imports_nothing_of_the_harness(module: str) -> None:
    outside = [t for t in graph()[module] if not (t == "abbench.engine" or t.startswith("abbench.engine."))]
    assert not outside, f"{module} imports {outside}"


ENGINE_WINGS = ("contract", "ops", "models", "runtime", "serve", "tools", "launcher")


def _wing(module: str) -> str:
    return FLOORS[_floor(module)][0].removeprefix("engine ")


def test_every_engine_module_sits_in_a_wing() -> None:
    """A new engine module is placed in a wing by its folder (or named in FLOORS), never by falling back on the
    package's own floor."""
    engine = [m for m in MODULES if m.startswith("abbench.engine.")]
    assert {_wing(m) for m in engine} == set(ENGINE_WINGS)
    loose = [m for m in engine if _wing(m) == "launcher" and m not in ("abbench.engine.serve.launch",
                                                                        "abbench.engine.__main__")]
    assert not loose, f"engine modules outside every wing (put them in a folder or name them in FLOORS): {loose}"


def test_the_engine_wings_keep_their_order() -> None:
    """contract < ops < models < runtime < serve < tools < launcher, as FLOORS lists them."""
    order = [name.removeprefix("engine ") for name, _ in FLOORS if name.startswith("engine")]
    assert order == list(ENGINE_WINGS)


def test_the_serving_layer_and_the_reference_stand_on_the_contract() -> None:
    """The HTTP layer and the transformers reference never import the runtime (only the launcher builds an
    Engine), the reference imports the contract, and nothing below the serving layer imports it or the tools."""
    serve = [m for m in MODULES if m.startswith("abbench.engine.serve.") and m != "abbench.engine.serve.launch"]
    assert "abbench.engine.serve.reference" in serve and "abbench.engine.serve.server" in serve
    for m in serve:
        assert not [t for t in graph()[m] if t.startswith("abbench.engine.runtime")], m
    assert "abbench.engine.contract" in graph()["abbench.engine.serve.reference"]
    assert "abbench.engine.runtime.engine" in graph()["abbench.engine.serve.launch"]
    for m in MODULES:
        if m.startswith(("abbench.engine.runtime", "abbench.engine.models", "abbench.engine.ops")):
            assert not [t for t in graph()[m] if t.startswith(("abbench.engine.serve", "abbench.engine.tools"))], m


def _calls(module: str) -> Iterator[ast.Call]:
    for node in ast.walk(ast.parse(MODULES[module].read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            yield node


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("abbench.engine.runtime")))
def test_the_runtime_probes_no_model_by_name(module: str) -> None:
    """The model interface (abbench.engine.models.base) defaults every optional hook, so the runtime calls them:
    no ``hasattr``, and no ``getattr`` with a default, anywhere in the runtime."""
    probes = [f"line {c.lineno}: {c.func.id}" for c in _calls(module)
              if c.func.id == "hasattr" or (c.func.id == "getattr" and len(c.args) == 3)]
    assert not probes, f"{module} probes by name: {probes}"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("abbench.engine.")
                                           and _wing(m) == "contract"))
def test_the_engine_contract_needs_no_torch(module: str) -> None:
    tree = ast.parse(MODULES[module].read_text(encoding="utf-8"))
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [n for n in names if n == "torch" or n.startswith("torch.")], module


def test_neither_backend_imports_the_launcher_and_the_runner_no_diagnostics() -> None:
    for backend in ("abbench.engine.serve.server", "abbench.engine.serve.reference"):
        assert "abbench.engine.serve.launch" not in graph()[backend]
    assert {"abbench.engine.serve.server", "abbench.engine.serve.reference"} <= set(graph()["abbench.engine.serve.launch"])
    runner = [m for m in MODULES if m == "abbench.runner" or m.startswith("abbench.runner.")]
    for m in runner:
        assert not [t for t in graph()[m] if t.startswith("abbench.diagnostics")], m
