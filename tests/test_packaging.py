"""The project's promises about itself: environment.yml agrees with pyproject, CI runs the README's
test command, committed notebooks carry no outputs."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import yaml
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
CONDA_TO_PIP = {"pytorch": "torch"}


def pyproject():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_environment_yml_lists_the_same_dependencies_as_pyproject():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    conda = {}
    for dep in env["dependencies"]:
        if isinstance(dep, dict) or dep.split(">")[0].split("=")[0].strip() in ("python", "pip"):
            continue
        req = Requirement(dep.replace("=", "==", 1) if re.match(r"^[\w-]+=[^=]", dep) else dep)
        conda[CONDA_TO_PIP.get(req.name, req.name)] = req.specifier
    pip = {Requirement(d).name: Requirement(d).specifier for d in pyproject()["project"]["dependencies"]}
    assert conda == pip, f"environment.yml {conda} != pyproject {pip}"


def test_torch_is_a_range_that_admits_2_13():
    torch_req = next(Requirement(d) for d in pyproject()["project"]["dependencies"] if d.startswith("torch"))
    assert "2.13.0" in torch_req.specifier and not any(s.operator == "==" for s in torch_req.specifier)


def test_ci_runs_the_readme_test_command_verbatim():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)\n```", readme, re.S)
    test_cmd = next(b for b in blocks if "pytest" in b)
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_cmd in ci, f"{test_cmd!r} is not a line of .ci/run"
    assert "pip install -q torch==2.13.0" in ci
    assert ci.index("pip install -q torch==2.13.0") < ci.index(test_cmd)


def test_committed_notebooks_are_stripped():
    for nb_path in sorted((ROOT / "lessons").glob("*.ipynb")):
        nb = json.loads(nb_path.read_text())
        assert "widgets" not in nb.get("metadata", {}), f"{nb_path.name} carries widget state"
        assert nb["metadata"].get("kernelspec", {}).get("name") == "python3", nb_path.name
        for cell in nb["cells"]:
            if cell["cell_type"] == "code":
                assert not cell.get("outputs") and cell.get("execution_count") is None, \
                    f"{nb_path.name} carries outputs: strip it before committing"


# what `pip install ampviz` alone must do: record, save, load, summarise; the rest says what to install
_WITHOUT_EXTRAS = r'''
import importlib.abc, sys
BLOCKED = {"plotly", "ipywidgets", "anywidget", "sklearn", "tqdm", "numba", "jupyterlab", "pandas", "IPython"}
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked: not installed without extras)")
sys.meta_path.insert(0, Block())
import importlib.util
_find = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a: None if name.split(".")[0] in BLOCKED else _find(name, *a)
'''


def test_the_core_records_saves_loads_and_summarises_without_any_extra(tmp_path):
    """With every optional package hidden, as after a plain `pip install ampviz` (tqdm hidden too, though
    torch itself would import it when present)."""
    import subprocess
    import sys
    script = _WITHOUT_EXTRAS + r'''
import torch, ampviz
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cpu")
with ampviz.Recorder(model, opt, scaler=scaler, path="run.npz") as rec:
    for _ in range(5):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(torch.randn(4, 8)).float().pow(2).mean()
        scaler.scale(loss).backward(); scaler.step(opt); scaler.update(); opt.zero_grad()
        rec.step(loss)
run = ampviz.Run.load("run.npz")
assert run.n_steps == 5 and run.counts.sum() > 0
from ampviz.cli import main
assert main(["info", "run.npz"]) == 0
assert main(["report", "run.npz", "-o", "r.html"]) == 1
assert main(["demo", "-o", "demo"]) == 1
import ampviz.plots
'''
    out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert "Traceback" in out.stderr and "MissingExtra" in out.stderr       # the last line: importing ampviz.plots
    lines = out.stderr.splitlines()
    assert 'ampviz: error: ampviz report needs plotly, which is not installed: pip install "ampviz[viz]"' in lines
    assert ('ampviz: error: ampviz demo needs scikit-learn, which is not installed: '
            'pip install "ampviz[lessons]"') in lines
    assert "steps" in out.stdout and "run.npz" in out.stdout


@pytest.mark.slow
def test_pip_install_without_extras_in_a_fresh_venv(tmp_path):
    """A real `pip install .` into a new venv (torch from the local CPU wheel first, as .ci/run does)."""
    import subprocess
    import sys
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    pip = [py, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    torch_wheel = subprocess.run(pip + ["torch==2.13.0"], capture_output=True, text=True)
    if torch_wheel.returncode != 0:
        pytest.skip(f"no torch 2.13.0 wheel reachable: {torch_wheel.stderr[-300:]}")
    subprocess.run(pip + [str(ROOT)], check=True, capture_output=True)
    listed = subprocess.run([py, "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True).stdout
    names = {line.split("==")[0].lower() for line in listed.splitlines()}
    assert not names & {"plotly", "ipywidgets", "scikit-learn", "jupyterlab", "numba", "anywidget"}, names
    script = r'''
import torch, ampviz
model = torch.nn.Linear(8, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
with ampviz.Recorder(model, opt, path="run.npz") as rec:
    for _ in range(3):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        loss.backward(); opt.step(); opt.zero_grad(); rec.step(loss)
assert ampviz.Run.load("run.npz").n_steps == 3
import importlib.metadata, pathlib
assert importlib.metadata.version("ampviz") == ampviz.__version__          # one source for the version
assert (pathlib.Path(ampviz.__file__).parent / "py.typed").is_file()       # type information ships
'''
    subprocess.run([py, "-c", script], cwd=tmp_path, check=True, timeout=300)
    info = subprocess.run([str(venv / "bin" / "ampviz"), "info", "run.npz"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert info.returncode == 0 and "3 (3 with histograms)" in info.stdout, info.stderr
    report = subprocess.run([str(venv / "bin" / "ampviz"), "report", "run.npz", "-o", "r.html"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=300)
    assert report.returncode == 1 and report.stderr.strip() == (
        'ampviz: error: ampviz report needs plotly, which is not installed: pip install "ampviz[viz]"')


def test_a_core_test_file_runs_without_the_notebook_plugin():
    # nbmake is an extra of [test]; a contributor with only pytest can still run one file
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:nbmake", "-p", "no:cacheprovider", "-q",
                          "--collect-only", "tests/test_formats.py"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and "collected" in out.stdout, out.stdout[-1500:] + out.stderr[-1500:]
