"""The integrations import their framework only when imported themselves: ``import ampviz`` (and the export
module, the CLI, the integrations package) loads none of transformers, lightning, accelerate, wandb, tensorboard."""

import json
import subprocess
import sys

FRAMEWORKS = ("transformers", "lightning", "pytorch_lightning", "accelerate", "wandb", "tensorboard", "deepspeed")


def top_level_modules_after(code: str) -> set:
    out = subprocess.run([sys.executable, "-c", f"{code}\nimport sys, json; print(json.dumps(sorted(sys.modules)))"],
                         capture_output=True, text=True, check=True)
    return {m.split(".")[0] for m in json.loads(out.stdout.strip().splitlines()[-1])}


def test_the_core_export_cli_and_integrations_package_load_no_framework():
    loaded = top_level_modules_after("import ampviz, ampviz.export, ampviz.cli, ampviz.integrations")
    assert not loaded & set(FRAMEWORKS), sorted(loaded & set(FRAMEWORKS))


def test_the_accelerate_integration_needs_no_import_of_accelerate():
    # it reads what the Accelerator holds (scaler, sync_gradients); the user's loop has imported accelerate
    loaded = top_level_modules_after("import ampviz.integrations.accelerate")
    assert not loaded & set(FRAMEWORKS), sorted(loaded & set(FRAMEWORKS))


def test_the_deepspeed_integration_needs_no_import_of_deepspeed():
    # it tells an engine by its class names and reads what the engine holds; deepspeed is imported only to write
    # its version into run.meta at the end, by which time the user's loop has imported it
    loaded = top_level_modules_after("import ampviz.integrations.deepspeed")
    assert not loaded & set(FRAMEWORKS), sorted(loaded & set(FRAMEWORKS))
