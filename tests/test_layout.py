"""The house's rules: the practitioner core never reaches into the classroom, stays light to import, and
private names stay inside their package."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ampviz"
HEAVY = ("plotly", "ipywidgets", "anywidget", "jupyterlab", "jupyter_server", "notebook", "sklearn", "IPython",
         "pandas", "tqdm")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path):
    """(line, absolute module, imported names) of every import in a file, lazy ones included."""
    tree = ast.parse(path.read_text())
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, []
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module
            yield node.lineno, mod, [a.name for a in node.names]


def core_files():
    return [p for p in PACKAGE.rglob("*.py") if "lessons" not in p.relative_to(PACKAGE).parts]


def loaded_modules(code: str) -> list:
    out = subprocess.run([sys.executable, "-c", f"{code}\nimport sys, json; print(json.dumps(sorted(sys.modules)))"],
                         capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


# the core never imports the classroom, except through ONE place: ampviz.examples.fixtures hands `ampviz demo` and the
# runnable examples the classroom's data sets and models. Each allowed edge, with why:
CLASSROOM_GATEWAY = "ampviz.examples.fixtures"
ALLOWED_INTO_THE_CLASSROOM = {
    (CLASSROOM_GATEWAY, "ampviz.lessons.data"): "digits, digit_rows and Split: the data `ampviz demo`, the Trainer "
                                                "and ddp_amp train on",
    (CLASSROOM_GATEWAY, "ampviz.lessons.models"): "sigmoid_mlp (the demo's network) and TransformerClassifier "
                                                  "(ddp_amp's)",
}


def classroom_targets(mod, names):
    """The classroom modules an import reaches: `import ampviz.lessons.x`, `from ampviz.lessons import x`, ..."""
    if mod == "ampviz.lessons":
        return [f"ampviz.lessons.{n}" for n in names] or [mod]
    if (mod or "").startswith("ampviz.lessons."):
        return [mod]
    return ["ampviz.lessons"] if mod == "ampviz" and "lessons" in names else []


def test_no_core_file_imports_the_classroom_but_through_the_one_listed_place():
    offenders, used = [], set()
    for path in core_files():
        me = module_name(path)
        for line, mod, names in imports_of(path):
            for target in classroom_targets(mod, names):
                if (me, target) in ALLOWED_INTO_THE_CLASSROOM:
                    used.add((me, target))
                else:
                    offenders.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    assert not offenders, ("the core must not import ampviz.lessons (only " + CLASSROOM_GATEWAY + " may, and only "
                           "the modules listed in ALLOWED_INTO_THE_CLASSROOM):\n" + "\n".join(offenders))
    assert used == set(ALLOWED_INTO_THE_CLASSROOM), f"listed edges that no longer exist: " \
                                                    f"{set(ALLOWED_INTO_THE_CLASSROOM) - used}"


def test_the_classroom_modules_the_core_reaches_import_nothing_else_of_the_classroom():
    # what the gateway hands on must not pull plotly, widgets or the other lessons into `ampviz demo` or ddp_amp
    for _, target in ALLOWED_INTO_THE_CLASSROOM:
        path = PACKAGE / "lessons" / (target.rsplit(".", 1)[1] + ".py")
        for line, mod, names in imports_of(path):
            assert not classroom_targets(mod, names), f"{path.relative_to(ROOT)}:{line} imports {mod}"
            assert not (mod or "").startswith(("ampviz.plots", "ampviz.widgets")), f"{path.name}:{line} imports {mod}"


# examples/ holds runnable programs (ddp_amp, trainer, evaluation) and what they need (process_group, fixtures).
# What it may import from ampviz, and who in the core may import it, each with why:
EXAMPLES_MAY_IMPORT = {
    "ampviz": "the public names (Recorder, RecordOptions), as a user's script would",
    "ampviz._args": "the argument checks every module shares",
    "ampviz.record": "the Trainer records with the Recorder",
    "ampviz.run": "the Trainer returns a Run",
    "ampviz.examples": "its own modules",
    "ampviz.lessons.data": "through " + CLASSROOM_GATEWAY + " only (checked above)",
    "ampviz.lessons.models": "through " + CLASSROOM_GATEWAY + " only (checked above)",
}
MAY_IMPORT_EXAMPLES = {        # outside ampviz/examples/ and the classroom
    "ampviz.demo": "`ampviz demo` trains with the examples' train_classifier on the fixtures",
}


def test_examples_import_only_the_listed_parts_and_only_demo_imports_them():
    offenders, importers = [], set()
    for path in (PACKAGE / "examples").rglob("*.py"):
        for line, mod, names in imports_of(path):
            if not mod or mod.split(".")[0] != "ampviz":
                continue
            if mod in ("ampviz", "ampviz.lessons"):           # `from ampviz import plots` imports a module
                is_module = [n for n in names if (ROOT / mod.replace(".", "/") / n).is_dir()
                             or (ROOT / mod.replace(".", "/") / f"{n}.py").is_file()]
                targets = [f"{mod}.{n}" for n in is_module] + ([mod] if len(is_module) < len(names) else [])
            else:
                targets = [mod]
            for target in targets:
                if not any(target == a or target.startswith(a + ".") for a in EXAMPLES_MAY_IMPORT if a != "ampviz") \
                        and target != "ampviz":
                    offenders.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    for path in core_files():
        me = module_name(path)
        if me == "ampviz.examples" or me.startswith("ampviz.examples."):
            continue
        for line, mod, names in imports_of(path):
            targets = [mod or ""] + [f"{mod}.{n}" for n in names if mod == "ampviz"]
            if any(t == "ampviz.examples" or t.startswith("ampviz.examples.") for t in targets):
                if me in MAY_IMPORT_EXAMPLES:
                    importers.add(me)
                else:
                    offenders.append(f"{path.relative_to(ROOT)}:{line} imports {mod}")
    assert not offenders, "\n".join(offenders)
    assert importers == set(MAY_IMPORT_EXAMPLES), f"listed importers that no longer import ampviz.examples: " \
                                                  f"{set(MAY_IMPORT_EXAMPLES) - importers}"


def test_the_classroom_is_one_package_of_topic_modules_that_name_their_lessons():
    # a lesson is named by its number ("02", or "02b" for a second part), an appendix by its file's stem
    lesson_numbers = {p.stem.split("_")[0] for p in (ROOT / "lessons").glob("[0-9][0-9]*_*.ipynb")}
    lesson_numbers |= {p.stem for p in (ROOT / "lessons").glob("appendix_*.ipynb")}
    for path in sorted((PACKAGE / "lessons").glob("*.py")):
        if path.name == "__init__.py":
            continue
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        named = {w.strip(",.()") for w in doc.split("Used by lessons", 1)[-1].split()[:12]}
        assert "Used by lessons" in doc and named & lesson_numbers, f"{path.name}: docstring must name its lessons"


@pytest.mark.parametrize("code", ["import ampviz", "import ampviz.plots", "import ampviz.widgets",
                                  "import ampviz.report, ampviz.cli, ampviz.gradient_trace, ampviz.integrations"])
def test_importing_the_core_loads_nothing_of_the_classroom(code):
    loaded = loaded_modules(code)
    assert not [m for m in loaded if m.startswith("ampviz.lessons")], loaded


@pytest.mark.parametrize("code", ["import ampviz.demo", "import ampviz.examples.ddp_amp, ampviz.examples.trainer"])
def test_the_demo_and_the_examples_load_of_the_classroom_only_what_the_gateway_hands_on(code):
    loaded = {m for m in loaded_modules(code) if m.startswith("ampviz.lessons")}
    assert loaded == {"ampviz.lessons"} | {target for _, target in ALLOWED_INTO_THE_CLASSROOM}, loaded


def test_import_ampviz_stays_light():
    baseline = set(loaded_modules("import torch, numpy"))      # torch itself imports tqdm when it is there
    loaded = set(loaded_modules("import ampviz")) - baseline
    heavy = [m for m in loaded if m.split(".")[0] in HEAVY]
    assert not heavy, f"import ampviz loads {sorted({m.split('.')[0] for m in heavy})}: the core is torch + numpy"


def test_private_names_stay_inside_their_package():
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        me = module_name(path)
        my_package = me if path.name == "__init__.py" else me.rsplit(".", 1)[0]
        for line, mod, names in imports_of(path):
            if not mod or not mod.startswith("ampviz"):
                continue
            parts = mod.split(".")
            for i, part in enumerate(parts):
                if part.startswith("_") and not part.startswith("__"):
                    owner = ".".join(parts[:i])              # the package the private module belongs to
                    if not (my_package == owner or my_package.startswith(owner + ".")):
                        offenders.append(f"{path.relative_to(ROOT)}:{line} imports private module {mod}")
            owner = mod.rsplit(".", 1)[0]                     # the package of the module the names come from
            for n in names:
                inside = mod == my_package or my_package == owner or my_package.startswith(owner + ".")
                if n.startswith("_") and not n.startswith("__") and not inside:
                    offenders.append(f"{path.relative_to(ROOT)}:{line} imports private name {n} from {mod}")
    assert not offenders, "\n".join(offenders)


# the pipeline: record/ produces a run/ that doctor, replay, export, report, plots and widgets read. Neither
# reaches up the pipeline, except these edges, each listed with why:
ALLOWED_UPWARD = {
    ("ampviz.run.run", "ampviz.doctor"): "Run.diagnose() and Run.summary() are thin wrappers of ampviz.doctor "
                                         "(imported lazily: ampviz.doctor imports Run)",
}
ABOVE = {
    "ampviz.run": ("ampviz.record", "ampviz.doctor", "ampviz.export", "ampviz.report", "ampviz.cli", "ampviz.demo",
                   "ampviz.plots", "ampviz.widgets", "ampviz.integrations", "ampviz.examples"),
    "ampviz.record": ("ampviz.doctor", "ampviz.export", "ampviz.report", "ampviz.cli", "ampviz.demo", "ampviz.plots",
                      "ampviz.widgets", "ampviz.integrations", "ampviz.examples"),
}


def test_record_and_run_are_packages_whose_private_modules_nobody_else_imports():
    for package in ("record", "run"):
        assert (PACKAGE / package / "__init__.py").is_file()
    flat = sorted(p.name for p in PACKAGE.glob("_r*.py") if p.name.startswith(("_record", "_run")))
    assert not flat, f"top-level modules that belong in record/ or run/: {flat}"
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        me = module_name(path)
        for line, mod, names in imports_of(path):
            for package in ("ampviz.record", "ampviz.run"):
                targets = [mod or ""] + [f"{mod}.{n}" for n in names if mod == package]
                private = [t for t in targets if t.startswith(package + "._")]
                if private and not (me == package or me.startswith(package + ".")):
                    offenders.append(f"{path.relative_to(ROOT)}:{line} imports {private[0]}")
    assert not offenders, "\n".join(offenders)


def test_record_and_run_never_import_up_the_pipeline_except_the_listed_edges():
    offenders, used = [], set()
    for package, above in ABOVE.items():
        for path in (PACKAGE / package.split(".")[1]).rglob("*.py"):
            me = module_name(path)
            for line, mod, _ in imports_of(path):
                hit = next((a for a in above if mod and (mod == a or mod.startswith(a + "."))), None)
                if hit is None:
                    continue
                if (me, hit) in ALLOWED_UPWARD:
                    used.add((me, hit))
                else:
                    offenders.append(f"{path.relative_to(ROOT)}:{line} imports {mod}")
    assert not offenders, "\n".join(offenders)
    assert used == set(ALLOWED_UPWARD), f"listed edges that no longer exist: {set(ALLOWED_UPWARD) - used}"


def test_docs_layout_lists_every_folder_and_core_module():
    layout = (ROOT / "docs" / "layout.md").read_text()
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if path.name.startswith("_") or rel.parts[0] == "lessons":
            continue
        assert path.stem in layout, f"docs/layout.md does not mention {rel}"
    for folder in ("record/", "run/", "lessons/", "plots/", "widgets/", "examples/", "integrations/", "tests/",
                   "benchmarks/", "docs/"):
        if (PACKAGE / folder).exists() or (ROOT / folder).exists():
            assert folder in layout, f"docs/layout.md does not mention {folder}"


def test_the_package_tests_benchmarks_and_lessons_pass_ruff():
    # pyproject's [tool.ruff] (notebooks included): unused imports, undefined names, import order, line length
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(ROOT)], capture_output=True,
                            text=True, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-1000:]
