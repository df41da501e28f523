"""The package's shape: the folders are the layers the data passes through, and imports only run downward.

``LAYERS`` is the one list of the layers, lowest first: the ground the stages stand on, the stages in the order the
data flows, then the Dagster layer and the CLI (the README's architecture section draws the same picture). Every
import in the package (module level and inside functions, read with ``ast``) must

- point to the same layer or one below (no upward import),
- take no private name (``_x``) from another module,
- close no circle of modules (strongly connected components of the import graph),
- never reach ``eagle_assets_tests`` (the test servers and models stay out of the product).

The checks run over a throwaway package too, with a circle and an upward import planted, so that a checker that
stopped seeing them would fail here.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

PACKAGE = "eagle_assets"
PACKAGE_DIR = Path(__file__).resolve().parents[1] / PACKAGE

# Lowest first. A module belongs to the first layer one of whose names is it or a package above it.
LAYERS: list[tuple[str, ...]] = [
    ("figures",),            # running length histograms, duration sketches, plots
    ("storage",),            # storage root, atomic writes, Parquet shards
    ("serving",),            # SGLang's /generate protocol, the client, the embedded server
    ("formats",),            # source dataset layouts -> conversations
    ("target_model",),       # tokenizers, family profiles, chat-template rendering
    ("structure",),          # a reply's token structure and drop reasons
    ("catalog",),            # the catalog's specs and loader
    ("demo",),               # the embedded default target model
    ("raw_prompts",),        # stage 1
    ("tokenized_prompts",),  # stage 2
    ("generations",),        # stage 3
    ("qc",),                 # stage 4
    ("drafter.data",),       # stage 5: the rows a drafter learns from and is tested on, the draft vocab
    ("drafter.features",),   #   what the target gives a row: aux hidden states (local or served), the teacher
    ("drafter.family",),     #   what a drafter family gives training and evaluation, and the registry of families
    ("drafter.eagle3", "drafter.dflash", "drafter.dspark"),  # the families: EAGLE-3, DFlash, DSpark
    ("drafter.evaluation",), #   acceptance walks, suites, reports, verdicts (the training loop measures with them)
    ("drafter.training", "drafter"),  # the loop any family plugs into, its recipe, state and launch
    ("exports",),            # stage 6: speculators / SpecForge exports
    ("lineage",),            # input versions, generation fingerprints, code and catalog identity (no Dagster)
    ("assets",),             # Dagster: assets, checks, resources, sensors, schedules
    ("definitions", ""),     # Dagster: the Definitions object; "" is the root package (lazy `defs`)
    ("cli",),                # eagle-assets
]


def module_names(package_dir: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under ``package_dir`` (a package is its ``__init__``)."""
    out = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = [package, *path.relative_to(package_dir).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports_of(name: str, path: Path, modules: dict[str, Path], package: str) -> list[tuple[str, list[str], int]]:
    """(imported module, names taken, line) for every import of ``package`` in one module, resolved to modules."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == package or alias.name.startswith(package + ".") \
                        or alias.name.startswith(package + "_tests"):
                    found.append((alias.name, [], node.lineno))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not (target == package or target.startswith(package + ".") or target.startswith(package + "_tests")):
                continue
            names = []
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in modules:
                    found.append((sub, [], node.lineno))
                else:
                    names.append(alias.name)
            if names:
                found.append((target, names, node.lineno))
    return found


def layer_of(module: str, package: str, layers: list[tuple[str, ...]]) -> int | None:
    rel = module[len(package) + 1:] if module != package else ""
    for index, names in enumerate(layers):
        for top in names:
            if rel == top or (top and rel.startswith(top + ".")):
                return index
    return None


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module, or a module importing itself (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
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
            if len(component) > 1 or v in edges.get(v, ()):
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def check_package(package_dir: Path, package: str, layers: list[tuple[str, ...]]) -> list[str]:
    """Every violation of the layering rules in one package, as readable lines (empty when it holds)."""
    modules = module_names(package_dir, package)
    problems = []
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        here = layer_of(name, package, layers)
        if here is None:
            problems.append(f"{name}: in no layer of LAYERS (add its package to the list, in data-flow order)")
            continue
        for target, names, line in imports_of(name, path, modules, package):
            where = f"{path.relative_to(package_dir.parent)}:{line}"
            if not (target == package or target.startswith(package + ".")):
                problems.append(f"{where}: {name} imports {target} (test code) -- the product never imports tests")
                continue
            if target not in modules:
                problems.append(f"{where}: {name} imports {target}, which is not a module of {package}")
                continue
            if target != name:
                edges[name].add(target)
            there = layer_of(target, package, layers)
            if there is not None and there > here:
                problems.append(f"{where}: upward import: {name} (layer {layers[here]}) imports {target} "
                                f"(layer {layers[there]}, above it) -- move the shared part down or pass it in")
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private and target != name:
                problems.append(f"{where}: {name} takes private {', '.join(private)} from {target} -- make it "
                                "public where it is defined, or move it to the module that uses it")
    for component in circles(edges):
        problems.append("import circle: " + " <-> ".join(component))
    return problems


def test_the_package_imports_downward_only_without_circles():
    problems = check_package(PACKAGE_DIR, PACKAGE, LAYERS)
    assert not problems, "\n".join(problems)


def test_every_layer_is_a_folder_or_module_of_the_package():
    for names in LAYERS:
        for top in names:
            if top:
                path = PACKAGE_DIR.joinpath(*top.split("."))
                assert path.is_dir() or path.with_suffix(".py").is_file(), top


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def test_the_checker_sees_a_planted_circle_an_upward_import_and_a_private_name(tmp_path):
    pkg = tmp_path / "toy"
    layers = [("low", ""), ("high",)]
    _write(pkg, {
        "__init__.py": "",
        "low/__init__.py": "",
        "low/a.py": "from toy.low.b import thing\n",
        "low/b.py": "def f():\n    from toy.low.a import other\n    from toy.high.d import top\n",
        "high/__init__.py": "",
        "high/c.py": "from toy.low.a import _hidden\nimport toy_tests.servers\n",
        "high/d.py": "",
        "loose.py": "",
    })
    problems = check_package(pkg, "toy", layers)
    text = "\n".join(problems)
    assert "import circle: toy.low.a <-> toy.low.b" in text
    assert "upward import: toy.low.b" in text and "imports toy.high.d" in text
    assert "takes private _hidden from toy.low.a" in text
    assert "toy.high.c imports toy_tests.servers (test code)" in text
    assert "toy.loose: in no layer" in text
    # and a clean toy package passes
    clean = tmp_path / "clean"
    _write(clean, {"__init__.py": "", "low/__init__.py": "", "low/a.py": "", "high/__init__.py": "",
                   "high/c.py": "from clean.low.a import thing\nfrom . import d\n", "high/d.py": ""})
    assert check_package(clean, "clean", layers) == []
    assert len(problems) == 5, text
