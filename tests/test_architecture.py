"""The layering of ARCHITECTURE.md, checked from the source: imports of `mass_ops` point one way.

Imports are read with `ast` from every module, at any depth (inside functions and `if TYPE_CHECKING:` blocks too),
so an import cycle cannot hide behind a function-level import.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "mass_ops"
MAX_ROOT_MODULES = 12
# Domain packages keep the algorithms; they take what they need as arguments and never reach up into the stage layer.
DOMAIN_PACKAGES = ("search", "judge", "render", "train", "export", "evaluation", "runtime", "store", "compute", "llm")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path) -> Iterator[tuple[str, ast.AST]]:
    """Every module `path` imports (absolute name), with the node, wherever the import statement stands."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            yield target, node
            for alias in node.names:  # `from mass_ops import stages` imports the submodule
                yield f"{target}.{alias.name}", node


def child_of(module: str) -> str | None:
    """The direct child of `mass_ops` that `module` belongs to (`mass_ops.search.driver` → `search`)."""
    parts = module.split(".")
    if parts[0] != "mass_ops" or len(parts) < 2:
        return None
    child = parts[1]
    exists = (PACKAGE / child).is_dir() or (PACKAGE / f"{child}.py").is_file()
    return child if exists else None


def child_graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = defaultdict(set)
    for path in PACKAGE.rglob("*.py"):
        source = child_of(module_name(path))
        if source is None:
            continue
        for target, _ in imported_modules(path):
            child = child_of(target)
            if child and child != source:
                edges[source].add(child)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one member (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(set(edges) | {n for targets in edges.values() for n in targets}):
        if node not in index:
            visit(node)
    return found


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_between_the_parts_of_mass_ops():
    edges = child_graph()
    assert edges["stages"], "the graph reader found no imports at all"
    assert cycles(edges) == []


def test_domain_packages_never_import_the_stage_layer():
    offenders = []
    for package in DOMAIN_PACKAGES:
        for path in (PACKAGE / package).rglob("*.py"):
            offenders += [
                f"{path.relative_to(PACKAGE)}:{node.lineno} imports {target}"
                for target, node in imported_modules(path)
                if child_of(target) == "stages"
            ]
    assert offenders == []


def test_mass_ops_never_imports_airflow_except_the_lazy_demo_command():
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        tree_functions = {
            node.lineno: node
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
            if isinstance(node, ast.FunctionDef)
        }
        for target, node in imported_modules(path):
            if target.split(".")[0] not in {"airflow", "mass_ops_airflow"}:
                continue
            inside_demo = path.name == "cli.py" and any(
                fn.name == "demo" and fn.lineno <= node.lineno <= (fn.end_lineno or 0) for fn in tree_functions.values()
            )
            if not inside_demo:
                offenders.append(f"{path.relative_to(PACKAGE)}:{node.lineno} imports {target}")
    assert offenders == []


def test_at_most_twelve_modules_at_the_root_and_the_stage_layer_in_stages():
    modules = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(modules) <= MAX_ROOT_MODULES, modules
    stage_families = {p.stem for p in (PACKAGE / "stages").glob("*.py")}
    assert {"search", "collect", "rank", "render", "train", "export", "register", "evaluate", "nightly", "units"} <= (
        stage_families
    )


def test_the_airflow_side_reaches_the_core_through_the_stage_api():
    """Operators, DAGs and the demo call `mass_ops.stages.api`; they never attach a cycle or run a stage family
    themselves (they may build Kubernetes specs with `mass_ops.compute`)."""
    root = PACKAGE.parent
    offenders = []
    for folder in (root / "plugins", root / "dags"):
        for path in folder.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                names = []
                if isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
                elif isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                for name in names:
                    stage_family = name.startswith("mass_ops.stages.") and not (
                        name == "mass_ops.stages.api" or name.startswith("mass_ops.stages.api.")
                    )
                    if name == "mass_ops.context" or stage_family:
                        offenders.append(f"{path.relative_to(root)}:{node.lineno} imports {name}")
    assert offenders == []


# File-level import cycles allowed, each a sorted list of modules: none.
ALLOWED_FILE_CYCLES: list[list[str]] = []


def module_file(module: str) -> str | None:
    """The `mass_ops` file that an imported name lives in: the longest prefix of `module` that is a module or a
    package (`mass_ops.store.artifacts.ArtifactStore` → `mass_ops.store.artifacts`); None outside `mass_ops`."""
    parts = module.split(".")
    while parts and parts[0] == "mass_ops":
        path = PACKAGE.parent.joinpath(*parts)
        if path.with_suffix(".py").is_file() or (path / "__init__.py").is_file():
            return ".".join(parts)
        parts.pop()
    return None


def file_graph() -> dict[str, set[str]]:
    """Module → the `mass_ops` modules it imports, counting imports inside functions and `TYPE_CHECKING` blocks."""
    edges: dict[str, set[str]] = defaultdict(set)
    for path in PACKAGE.rglob("*.py"):
        source = module_name(path)
        for target, _ in imported_modules(path):
            found = module_file(target)
            if found and found != source:
                edges[source].add(found)
    return edges


def test_module_file_resolves_names_to_their_file():
    assert module_file("mass_ops.store.artifacts.ArtifactStore") == "mass_ops.store.artifacts"
    assert module_file("mass_ops.store") == "mass_ops.store"
    assert module_file("pydantic.BaseModel") is None


def test_no_import_cycle_between_two_files_of_mass_ops():
    edges = file_graph()
    assert "mass_ops.store.artifacts" in edges["mass_ops.store.local_artifacts"], "the file graph reader found nothing"
    assert [cycle for cycle in cycles(edges) if cycle not in ALLOWED_FILE_CYCLES] == []


TESTS = PACKAGE.parent / "tests"
# Test modules of tests/train (another change is editing that folder) still import its conftest; the lead empties
# this list once they import their helpers from `tests/support/`.
CONFTEST_IMPORTERS_ALLOWED: set[str] = set()


def conftest_imports(path: Path) -> list[int]:
    """Line numbers where `path` imports a conftest module (absolute, relative or as a name of a package)."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            modules = [node.module or "", *(alias.name for alias in node.names)]
        else:
            continue
        if any("conftest" in module.split(".") for module in modules):
            lines.append(node.lineno)
    return lines


def test_no_test_module_imports_a_conftest():
    """Shared test helpers live in `tests/support/`; pytest loads conftest modules itself, and importing one as a
    library runs it a second time under another name."""
    offenders = [
        f"tests/{relative}:{line}"
        for path in sorted(TESTS.rglob("*.py"))
        if (relative := path.relative_to(TESTS).as_posix()) not in CONFTEST_IMPORTERS_ALLOWED
        for line in conftest_imports(path)
    ]
    assert offenders == []


def test_the_package_ships_its_py_typed_marker():
    """PEP 561: type checkers read the package's annotations only when `py.typed` is installed with it."""
    import tomllib

    assert (PACKAGE / "py.typed").is_file()
    pyproject = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text(encoding="utf-8"))
    assert "py.typed" in pyproject["tool"]["setuptools"]["package-data"]["mass_ops"]


def test_the_benchmark_seed_formula_is_written_once():
    """One seed index: the benchmark seeds' base (3,100,000, MASS_SPEC §10) appears in `mass_ops.seeds` only."""
    places = [
        f"{path.relative_to(PACKAGE)}:{node.lineno}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.Constant) and node.value == 3_100_000
    ]
    assert [place.split(":")[0] for place in places] == ["seeds.py"], places


# -- module docstrings ------------------------------------------------------------------------------------------------

REPO = PACKAGE.parent
MAX_MODULE_DOCSTRING_LINES = 15


# Modules whose docstring is still longer (design text not yet moved to docs/<topic>.md). Shrink, never grow.
def module_docstring_lines(source: str) -> int:
    """Source lines the module docstring spans, its quote lines included; 0 without one."""
    body = ast.parse(source).body
    first = body[0] if body else None
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        return (first.end_lineno or first.lineno) - first.lineno + 1
    return 0


def long_module_docstrings() -> dict[str, int]:
    return {
        path.relative_to(REPO).as_posix(): lines
        for folder in ("mass_ops", "plugins", "dags")
        for path in sorted((REPO / folder).rglob("*.py"))
        if (lines := module_docstring_lines(path.read_text(encoding="utf-8"))) > MAX_MODULE_DOCSTRING_LINES
    }


def test_module_docstring_lines_counts_the_quote_lines():
    assert module_docstring_lines('"""One line."""\nx = 1\n') == 1
    assert module_docstring_lines('"""\nTitle\n\nText.\n"""\n') == 5
    assert module_docstring_lines("x = 1\n") == 0
    assert module_docstring_lines("") == 0


def test_module_docstrings_state_the_contract_in_at_most_15_lines():
    """A module docstring gives the contract; design text lives in docs/<topic>.md."""
    over = long_module_docstrings()
    assert not over, f"module docstrings over {MAX_MODULE_DOCSTRING_LINES} lines (move design text to docs/): {over}"


MAX_MODULE_LINES = 900
MAX_FUNCTION_LINES = 100


def oversized(paths: list[Path]) -> list[str]:
    """Modules over `MAX_MODULE_LINES` lines and functions over `MAX_FUNCTION_LINES` lines (decorators excluded)."""
    found = []
    for path in paths:
        source = path.read_text(encoding="utf-8")
        if (lines := source.count("\n")) > MAX_MODULE_LINES:
            found.append(f"{path}: {lines} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    found.append(f"{path}:{node.lineno} {node.name}: {length} lines")
    return found


def test_no_module_over_900_lines_and_no_function_over_100():
    root = PACKAGE.parent
    paths = [*PACKAGE.rglob("*.py"), *(root / "plugins").rglob("*.py"), *(root / "dags").glob("*.py")]
    assert len(paths) > 200
    assert oversized(paths) == []


def test_the_size_check_sees_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "long.py").write_text(f"def long():\n{body}\n")
    assert oversized([tmp_path / "long.py"]) == [f"{tmp_path / 'long.py'}:1 long: {MAX_FUNCTION_LINES + 1} lines"]


# -- SQL lives in the repository --------------------------------------------------------------------------------------

# Modules outside `mass_ops/store/` that still build SQL or open a metadata session, each with why. Shrink, never grow.
SQL_OUTSIDE_STORE_ALLOWED = {
    "plugins/mass_ops_airflow/demo/airflow_home.py": "reads Airflow's own database (XCom) through Airflow's session",
    "plugins/mass_ops_airflow/demo/live.py": "reads Airflow's own database (DAG runs, task instances)",
    "plugins/mass_ops_airflow/demo/task_logs.py": "reads Airflow's own database (task instances)",
}
# What a module may take from SQLAlchemy without building SQL: its errors, and the URL parser.
SQLALCHEMY_WITHOUT_SQL = {"sqlalchemy.exc": None, "sqlalchemy.engine": {"make_url"}}
SESSION_CALLS = {"execute", "exec_driver_sql", "scalars", "scalar", "query"}


def sql_builders(path: Path) -> list[str]:
    """`line: what` for each place `path` builds SQL: a SQLAlchemy import other than its errors and URL parser (a
    plain ``import sqlalchemy as sa`` counts where it uses more than ``sa.exc``), a metadata session opened with
    ``….store.read()`` / ``….store.write()``, or a query run on something named a session or connection."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found, aliases = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "sqlalchemy":
            allowed = SQLALCHEMY_WITHOUT_SQL.get(node.module or "", set())
            if allowed is not None and not {a.name for a in node.names} <= allowed:
                found.append(f"{node.lineno}: from {node.module} import {', '.join(a.name for a in node.names)}")
        elif isinstance(node, ast.Import):
            aliases |= {a.asname or a.name for a in node.names if a.name == "sqlalchemy"}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        owner = node.value
        if isinstance(owner, ast.Name) and owner.id in aliases and node.attr != "exc":
            found.append(f"{node.lineno}: {owner.id}.{node.attr}")
        elif node.attr in {"read", "write"} and isinstance(owner, ast.Attribute) and owner.attr == "store":
            found.append(f"{node.lineno}: a metadata session (store.{node.attr})")
        elif node.attr in SESSION_CALLS:
            name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else ""
            if "session" in name or name in {"conn", "connection"}:
                found.append(f"{node.lineno}: {name}.{node.attr}")
    return sorted(set(found), key=lambda item: (int(item.split(":")[0]), item))


def sql_outside_store() -> dict[str, list[str]]:
    modules = [p for p in sorted(PACKAGE.rglob("*.py")) if (PACKAGE / "store") not in p.parents]
    modules += sorted((REPO / "plugins").rglob("*.py")) + sorted((REPO / "dags").rglob("*.py"))
    return {p.relative_to(REPO).as_posix(): places for p in modules if (places := sql_builders(p))}


def test_no_module_outside_the_store_builds_sql():
    """Queries are named methods of the repository (`mass_ops/store/repository/<aggregate>.py`)."""
    builders = {path: places for path, places in sql_outside_store().items() if path not in SQL_OUTSIDE_STORE_ALLOWED}
    assert builders == {}, "move these queries into the repository aggregate they read"


def test_the_sql_allow_list_names_only_modules_that_still_build_sql():
    assert sorted(set(SQL_OUTSIDE_STORE_ALLOWED) - set(sql_outside_store())) == []


def test_the_sql_check_sees_a_query_and_spares_errors_and_urls(tmp_path):
    module = tmp_path / "reader.py"
    module.write_text(
        "import sqlalchemy as sa\nfrom sqlalchemy.exc import SQLAlchemyError\nfrom sqlalchemy.engine import make_url\n"
        "def rows(repo, model):\n"
        "    try:\n"
        "        with repo.store.read() as session:\n"
        "            return session.scalars(sa.select(model)).all()\n"
        "    except sa.exc.OperationalError:\n"
        "        return make_url('sqlite://')\n"
        "def run(runner, context):\n"
        "    return runner.execute(context)\n"
    )
    assert sql_builders(module) == ["6: a metadata session (store.read)", "7: sa.select", "7: session.scalars"]
    module.write_text("from sqlalchemy import select, text\n")
    assert sql_builders(module) == ["1: from sqlalchemy import select, text"]


def backend_comparisons(path: Path) -> list[int]:
    """Lines where `path` compares a `….compute.backend` value (or a `backend` name) with a backend's name."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.Compare):
            continue
        names = [n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and n.value in ("local", "kubernetes")]
        reads = [
            n
            for n in ast.walk(node)
            if (isinstance(n, ast.Attribute) and n.attr == "backend") or (isinstance(n, ast.Name) and n.id == "backend")
        ]
        if names and reads:
            found.append(node.lineno)
    return found


def test_only_the_backend_module_tells_local_from_kubernetes():
    """Local and Kubernetes differ behind `compute.backend.ComputeBackend`; nothing else compares the setting."""
    root = PACKAGE.parent
    paths = [*PACKAGE.rglob("*.py"), *(root / "plugins").rglob("*.py"), *(root / "dags").glob("*.py")]
    branches = {
        str(path.relative_to(root)): lines
        for path in paths
        if path != PACKAGE / "compute" / "backend.py" and (lines := backend_comparisons(path))
    }
    assert branches == {}


def test_the_backend_check_sees_a_branch(tmp_path):
    source = 'if config.compute.backend == "local":\n    pass\nif backend != "kubernetes":\n    pass\n'
    (tmp_path / "m.py").write_text(source)
    assert backend_comparisons(tmp_path / "m.py") == [1, 3]
