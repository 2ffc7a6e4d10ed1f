"""The package's layers (DESIGN.md §1) import downwards only, with no import cycle (imports inside functions and
under TYPE_CHECKING counted); the engine and everything below import and run without Ray, the YAML config or the
HTTP stack; `import domino_ray` is light and exposes the public API lazily; the sampling rules and the config are
torch-free."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "domino_ray"
TESTS = Path(__file__).resolve().parent

# Each subpackage (or top-level module) of domino_ray and its layer: a module imports from its own subpackage or
# from a lower layer, never from its own layer's other subpackages or from above. The package's own `__init__`
# (the lazy public API) is above them all.
LAYERS = {
    "backend": 0,      # the C++ sources, their build, the only Python naming torch.ops.domino_ray
    "kv": 1,           # the block pool, the KV pools, attention over a row's blocks
    "target": 2,       # target loading and forward, fused layers, packed linear layers
    "spec_decode": 3,  # draft, checkpoint layouts, proposer, verification, the width policy, statistics
    "sample": 4,       # sampling parameters, a step's sampling and acceptance, penalties, rng
    "engine": 5,       # scheduling, admission, the step, graphs, memory plan, the loop thread
    "frontend": 6,     # prompt + SamplingParams -> requests; completions -> text (the only builder of a Request)
    "llm": 7,          # the Python API
    "training": 7,     # draft training
    "config": 7,       # the job's YAML config, for the edges
    "batch": 8,        # the Ray Data edge
    "serve": 8,        # the Ray Serve edge
}
CORE = ("backend", "kv", "target", "spec_decode", "sample", "engine")  # importable without Ray, omegaconf or the HTTP stack
BLOCKED = ("ray", "omegaconf", "fastapi", "starlette", "httpx", "uvicorn", "aiohttp")


def module_files(root: Path = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package (packages by their `__init__.py`)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports_of(name: str, path: Path, modules) -> set[str]:
    """The package modules `name` imports anywhere in its file (module level, functions, TYPE_CHECKING blocks),
    each resolved to the deepest module it names; its own parent packages left out (imported anyway)."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                base = ".".join(anchor[:len(anchor) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + "."):
                found.add(target)
    return found


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    modules = module_files(root)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def layer_of(module: str) -> str | None:
    """`domino_ray.spec_decode.draft` -> "spec"; the package itself -> None."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def layering_violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for module, targets in graph.items():
        own = layer_of(module)
        if own is None:
            continue  # the package's lazy public API
        for target in targets:
            theirs = layer_of(target)
            if theirs is None:
                bad.append(f"{module} imports the package itself ({target}), which imports every layer")
            elif theirs != own and LAYERS[theirs] >= LAYERS[own]:
                bad.append(f"{module} (layer {own}) imports {target} (layer {theirs})")
    return sorted(bad)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_every_subpackage_has_a_layer():
    found = {layer_of(m) for m in module_files()} - {None}
    assert found == set(LAYERS), f"give each subpackage a layer in LAYERS: {sorted(found ^ set(LAYERS))}"


def test_imports_point_downwards_only():
    assert layering_violations(import_graph()) == []


def test_no_import_cycle_between_modules():
    assert cycles(import_graph()) == []


def test_the_checks_see_an_upward_import_and_a_cycle(tmp_path):
    """The checks above on a copy of the package with one upward import added inside a function (the shape of the
    old cycle: KV storage reaching up to the draft, which imports it): both fail."""
    import shutil

    copy = tmp_path / "domino_ray"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("assets", "csrc", "__pycache__"))
    kv_cache = copy / "kv" / "pools.py"
    kv_cache.write_text(kv_cache.read_text() + "\n\ndef _upward():\n    from domino_ray.spec_decode.draft import DominoDraft\n")
    graph = import_graph(copy)
    assert layering_violations(graph) == ["domino_ray.kv.pools (layer kv) imports domino_ray.spec_decode.draft "
                                          "(layer spec_decode)"]
    assert any({"domino_ray.kv.pools", "domino_ray.spec_decode.draft"} <= set(c) for c in cycles(graph))


def test_subpackage_inits_import_nothing():
    """Importing a module imports its parent packages: they stay empty, so a module costs only what it imports."""
    for name, path in module_files().items():
        if path.name == "__init__.py" and name != "domino_ray":
            tree = ast.parse(path.read_text())
            assert not [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))], name


def run_python(code: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                          cwd=str(TESTS))


def test_the_engine_and_below_import_and_run_without_ray_config_or_http():
    """Every module of the core layers imports with Ray, omegaconf and the HTTP stack blocked (an import of any of
    them raises), and a tiny speculative engine generates."""
    core = sorted(m for m in module_files() if layer_of(m) in CORE)
    assert {"domino_ray.engine.core", "domino_ray.spec_decode.draft", "domino_ray.backend.ops"} <= set(core)
    code = (f"import sys\nfor name in {BLOCKED!r}:\n    sys.modules[name] = None\n"  # `import name` now raises
            + "".join(f"import {name}\n" for name in core)
            + "from tiny_models import ragged_prompts, tiny_draft, tiny_target\n"
              "from domino_ray.engine.request import Request\n"
              "from domino_ray.engine.core import SpecEngine\n"
              "from domino_ray.spec_decode.proposer import DominoProposer\n"
              "from domino_ray.sample.params import SamplingParams\n"
              "target = tiny_target()\n"
              "engine = SpecEngine(target, DominoProposer(tiny_draft(target), target), max_rows=2, max_model_len=64)\n"
              "out = engine.generate([Request(i, p, SamplingParams(max_new_tokens=5, ignore_eos=True))\n"
              "                       for i, p in enumerate(ragged_prompts(3))])\n"
              "assert [len(c.token_ids) for c in out] == [5, 5, 5]\n"
              f"loaded = [m for m in sys.modules if m.split('.')[0] in {BLOCKED!r} and sys.modules[m] is not None]\n"
              "assert not loaded, loaded\n")
    result = run_python(code)
    assert result.returncode == 0, result.stderr[-3000:]


def test_package_import_is_light():
    result = run_python("import sys, domino_ray; print(sorted({'torch', 'ray'} & set(sys.modules)))")
    assert result.stdout.strip() == "[]", result.stderr


@pytest.mark.parametrize("name, loads, leaves", [
    ("SamplingParams", [], ["torch", "ray"]),
    ("DominoLLM", ["torch"], ["ray"]),
    ("SpecEngine", ["torch"], ["ray"]),
    ("build_processor", ["ray"], []),
])
def test_the_public_api_comes_from_the_package_lazily(name, loads, leaves):
    """Each name is its module's own object, and importing it loads only what that module needs."""
    import domino_ray

    code = (f"import sys, domino_ray\nvalue = domino_ray.{name}\n"
            f"import {domino_ray._API[name]} as home\nassert value is home.{name}\n"
            f"print(sorted(m for m in {[*loads, *leaves]!r} if m in sys.modules))")
    result = run_python(code)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split()[-1] == str(sorted(loads)).replace(" ", ""), result.stdout


def test_every_public_name_resolves():
    import domino_ray

    assert set(domino_ray.__all__) == {"__version__", *domino_ray._API}
    assert {"DominoLLM", "build_engine", "load_target", "load_tokenizer", "encode_prompt", "load_draft", "SpecEngine",
            "Request", "SamplingParams", "total_stats", "DominoEngineProcessorConfig",
            "build_processor"} <= set(domino_ray.__all__)
    for name in domino_ray._API:
        assert getattr(domino_ray, name) is not None
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        domino_ray.nothing_here  # noqa: B018


def test_sampling_rules_and_config_import_without_torch():
    code = ("import sys; sys.modules['torch'] = None\n"  # any `import torch` now raises ImportError
            "import domino_ray.sample.params, domino_ray.config\n"
            "domino_ray.config.load_config()\n"  # the checks run (generation.* via sampling_params)
            "assert not any(m == 'torch' or m.startswith('torch.') for m in sys.modules if sys.modules[m])\n")
    result = run_python(code, timeout=60)
    assert result.returncode == 0, result.stderr


MAX_MODULE_LINES, MAX_FUNCTION_LINES = 400, 60


def oversized(root: Path = PACKAGE) -> list[str]:
    """Modules over MAX_MODULE_LINES lines and functions over MAX_FUNCTION_LINES (decorators and docstring included):
    each should be readable in one sitting."""
    bad = []
    for name, path in module_files(root).items():
        source = path.read_text()
        if source.count("\n") > MAX_MODULE_LINES:
            bad.append(f"{name}: {source.count(chr(10))} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    bad.append(f"{name}.{node.name}: {length} lines")
    return bad


def test_no_module_over_400_lines_and_no_function_over_60():
    assert oversized() == []


def test_the_size_check_sees_a_long_function(tmp_path):
    package = tmp_path / "domino_ray"
    package.mkdir()
    (package / "long.py").write_text("def f():\n" + "    x = 1\n" * MAX_FUNCTION_LINES)
    assert oversized(package) == ["domino_ray.long.f: 61 lines"]
