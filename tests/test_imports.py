"""The core is Ray-free: every domino_ray module except the Ray edges (batch/, serve/) imports with Ray blocked;
the sampling rules and the config are torch-free too."""

import pkgutil
import subprocess
import sys

import domino_ray


def test_core_imports_without_ray():
    core = [m.name for m in pkgutil.walk_packages(domino_ray.__path__, "domino_ray.")
            if not m.name.startswith(("domino_ray.batch", "domino_ray.serve"))]
    assert {"domino_ray.engine.spec_engine", "domino_ray.spec.draft", "domino_ray.spec.checkpoint"} <= set(core)
    code = ("import sys; sys.modules['ray'] = None\n"  # any `import ray` now raises ImportError
            + "".join(f"import {name}\n" for name in core)
            + "assert not any(m == 'ray' or m.startswith('ray.') for m in sys.modules if sys.modules[m])\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_package_import_is_light():
    result = subprocess.run([sys.executable, "-c", "import sys, domino_ray; print('torch' in sys.modules)"],
                            capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "False", result.stderr


def test_sampling_rules_and_config_import_without_torch():
    code = ("import sys; sys.modules['torch'] = None\n"  # any `import torch` now raises ImportError
            "import domino_ray.spec.sampling_params, domino_ray.config\n"
            "domino_ray.config.load_config()\n"  # the checks run (generation.* via sampling_params)
            "assert not any(m == 'torch' or m.startswith('torch.') for m in sys.modules if sys.modules[m])\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
