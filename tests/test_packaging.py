"""The project's promises about itself: environment.yml agrees with pyproject, CI runs the README's
test command, committed notebooks carry no outputs."""

import json
import re
from pathlib import Path

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
