"""The code's shape: no import cycles in harness/ or analysis/, harness never imports analysis/,
and comments cite papers and formulas, not the project's history."""

import ast
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def import_graph(root: Path, packages=("harness", "analysis")) -> dict[str, set[str]]:
    """module → the project modules it imports (top-level and inside functions alike)."""
    mods = {}
    for pkg in packages:
        for p in (root / pkg).rglob("*.py"):
            name = ".".join(p.relative_to(root).with_suffix("").parts)
            mods[name.removesuffix(".__init__")] = p
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, p in mods.items():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            graph[m] |= {n for n in names if n in mods and n != m}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while (w := stack.pop()) != v:
                comp.append(w)
            if comp:
                out.append(sorted([v, *comp]))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_by_hand():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(g) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_and_harness_never_imports_analysis():
    graph = import_graph(ROOT)
    assert cycles(graph) == []
    wrong = {m: sorted(d for d in deps if d.startswith("analysis")) for m, deps in graph.items()}
    assert {m: d for m, d in wrong.items() if m.startswith("harness") and d} == {}


# harness's subpackages, lowest first: a module imports its own package and those below it, never
# one above. The entry points train and measure (with its submodules) sit above rl; integrations
# (the plug-ins for other stacks) sits above them, so nothing in harness imports it.
LAYERS = ("base", "noise", "sampling", "stats", "tasks", "objectives", "runs", "rl", "integrations")
ENTRY_POINTS = ("train", "measure")


def layer(module: str) -> float:
    """The rank of a harness module: its subpackage's place in LAYERS; an entry point sits
    between rl and integrations."""
    parts = module.split(".")
    assert len(parts) >= 2 and parts[1] in (*LAYERS, *ENTRY_POINTS), f"{module} is in no layer"
    if parts[1] in ENTRY_POINTS:
        return LAYERS.index("rl") + 0.5
    return LAYERS.index(parts[1])


def test_every_harness_module_sits_in_a_layer_and_imports_only_downward():
    graph = import_graph(ROOT, packages=("harness",))
    mods = [m for m in graph if m != "harness"]
    upward = {
        m: sorted(d for d in graph[m] if d != "harness" and layer(d) > layer(m)) for m in mods
    }
    assert {m: d for m, d in upward.items() if d} == {}


def test_nothing_in_harness_imports_the_integrations():
    graph = import_graph(ROOT, packages=("harness",))
    inward = {
        m: sorted(d for d in deps if d.startswith("harness.integrations"))
        for m, deps in graph.items()
    }
    assert {m: d for m, d in inward.items() if d and not m.startswith("harness.integrations")} == {}


def test_layer_by_hand():
    assert layer("harness.base.io") == 0
    assert layer("harness.rl.step") == LAYERS.index("rl")
    assert layer("harness.train") == layer("harness.measure.logs") > layer("harness.rl.setup")
    assert layer("harness.integrations.trl") > layer("harness.measure") == layer("harness.train")
    with pytest.raises(AssertionError, match="in no layer"):
        layer("harness.flat_module")


# the project's history: an issue by number (issue 16, issue-16, #16) or as "the issue"; a working
# session by number or as an earlier one; what a change fixed; the notes/ folder outside the tree
HISTORY = re.compile(
    r"\bissues?[- #]*[0-9]+|\bthe issue\b|\bsessions?[- #]*[0-9]+"
    r"|\b(this|that|last|previous|earlier|next) session\b|\b(before|after) the fix\b"
    r"|\bnotes/|\bnotes §",
    re.IGNORECASE,
)


@pytest.mark.parametrize(
    "line, history",
    [
        ("found in the issue-16 FP8 rerun", True),
        ("# see issue 37, item 3", True),
        ("(Issue #12)", True),
        ("as the issue proposed: the clamp arm's entropy falls", True),
        ("The issue asks for a guard", True),
        ("rerun in session 15", True),
        ("Session 3 found it", True),
        ("as decided in an earlier session", True),
        ("Before the fix the reuse path took the trainer", True),
        ("the source (arXiv 2609.38995, setup; notes/", True),
        ("notes §4", True),
        ("# CISPO (MiniMax-M1 eq. 4): clip the IS weight, not the update", False),
        ("the session's own process group (os.setsid)", False),
        ("an issue of scale: σ·√(ν/(ν−2))", False),
        ("seeds 500–509, never used by a pilot", False),
    ],
)
def test_history_pattern_by_hand(line, history):
    assert bool(HISTORY.search(line)) is history, line


FOLDERS = ["harness", "analysis", "benchmarks", "tests", "experiments", "scripts", "hydra_plugins"]
FOLDERS += ["examples"]


@pytest.mark.parametrize("folder", FOLDERS)
def test_code_comments_carry_no_project_history(folder):
    """History (issue numbers, sessions, the notes/ folder outside the repository) belongs in
    git and results/LOG.md."""
    hits = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in sorted((ROOT / folder).rglob("*"))
        if p.suffix in (".py", ".yaml", ".sh") and p != Path(__file__)
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if HISTORY.search(line)
    ]
    assert hits == []


def test_no_tracked_file_is_one_the_repository_ignores():
    """A file both tracked and ignored (a raw run folder, `results/*/*=*/`) is in the tree that
    .gitignore and results/README.md say leaves it out. The user's own excludes file is not the
    repository's, so it is left out of the check."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    git = ["git", "--no-optional-locks", "-c", "core.excludesFile=/dev/null", "-C", str(ROOT)]
    cmd = [*git, "ls-files", "--cached", "--ignored", "--exclude-standard"]
    files = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.splitlines()
    assert files == [], f"{len(files)} tracked files the repository ignores, e.g. {files[:3]}"


def test_the_loop_and_the_readme_stay_short():
    """The training loop reads as one file a person can hold (≤ 300 lines) and the README is an
    entrance, not a manual (≤ 150 lines; the manual is docs/)."""
    assert len((ROOT / "harness" / "train.py").read_text().splitlines()) <= 300
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150


# --- signatures: settings travel as options objects --------------------------------------------

MAX_PARAMS = 8


def n_params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """A function's parameters, a method's self/cls not counted (a dataclass's generated
    __init__, an options object's, is not in the source and counts nowhere)."""
    a = fn.args
    names = [p.arg for p in (*a.posonlyargs, *a.args)]
    if names[:1] in (["self"], ["cls"]):
        names = names[1:]
    return len(names) + len(a.kwonlyargs) + (a.vararg is not None) + (a.kwarg is not None)


def registered_builders() -> set[tuple[Path, int]]:
    """(file, first line) of every builder in OBJECTIVES, AGGREGATIONS, TASKS and NOISE (a
    class: its __init__): their keyword arguments are a config node's keys, the schema itself."""
    import inspect

    from harness.noise import NOISE
    from harness.objectives import AGGREGATIONS, OBJECTIVES
    from harness.tasks import TASKS

    out = set()
    for table in (OBJECTIVES, AGGREGATIONS, TASKS, NOISE):
        for fn in table.values():
            code = inspect.unwrap(fn.__init__ if isinstance(fn, type) else fn).__code__
            out.add((Path(code.co_filename).resolve(), code.co_firstlineno))
    return out


def wide_signatures(path: Path, builders: set[tuple[Path, int]]) -> list[str]:
    """`line name (n)` for each function in `path` with more than MAX_PARAMS parameters, except a
    registered builder whose parameters are all keyword-only."""
    out = []
    tree = ast.walk(ast.parse(path.read_text()))
    defs = (f for f in tree if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)))
    for fn in sorted(defs, key=lambda f: f.lineno):
        n = n_params(fn)
        first = min([fn.lineno, *(d.lineno for d in fn.decorator_list)])
        builder = n == len(fn.args.kwonlyargs) and (path.resolve(), first) in builders
        if n > MAX_PARAMS and not builder:
            out.append(f"{fn.lineno} {fn.name} ({n})")
    return out


def test_wide_signatures_by_hand(tmp_path):
    path = tmp_path / "m.py"
    path.write_text(
        "class A:\n"
        "    def f(self, a, b, c, d, e, f, g, h): ...\n"  # 8 without self
        "    def g(self, a, b, c, d, e, f, g, h, i): ...\n"  # 9
        "@register\n"
        "def h(*, a, b, c, d, e, f, g, h, i): ...\n"  # 9 keyword-only, a builder from line 4
        "def k(a, *, b, c, d, e, f, g, h, i): ...\n"  # 9, one positional: no builder
        "def m(*args, **kwargs): ...\n"  # 2
    )
    builders = {(path.resolve(), 4), (path.resolve(), 6)}
    assert wide_signatures(path, builders) == ["3 g (9)", "6 k (9)"]
    assert wide_signatures(path, set()) == ["3 g (9)", "5 h (9)", "6 k (9)"]


def test_no_harness_function_takes_more_than_eight_parameters():
    """Settings travel as one typed options object (Sampling, StepOptions, VllmOptions, ...);
    only the registered builders, whose keyword-only parameters are the config's keys, are
    wider."""
    builders = registered_builders()
    wide = {
        str(p.relative_to(ROOT)): w
        for p in sorted((ROOT / "harness").rglob("*.py"))
        if (w := wide_signatures(p, builders))
    }
    assert wide == {}


def test_no_formatter_escapes_in_harness():
    """The code reads as ruff formats it: no `fmt: skip` / `fmt: off` in harness/."""
    hits = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in sorted((ROOT / "harness").rglob("*.py"))
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if re.search(r"#\s*fmt:\s*(skip|off)", line)
    ]
    assert hits == []
