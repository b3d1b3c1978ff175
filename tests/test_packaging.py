"""The wheel a user installs: it carries the bundled recipes and calibration texts, and the names
the README gives them (`recipes/NAME.yaml`, `calibration/NAME.txt`) find them from any directory
(they were only in the checkout, so the README's first Python example failed after `pip install`)."""

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path


def test_an_installed_wheel_finds_its_bundled_recipes_and_calibration(repo, tmp_path):
    source = tmp_path / "source"  # built from a copy: setuptools writes build/ beside the sources
    source.mkdir()
    for part in ("pyproject.toml", "README.md", "compress", "recipes", "calibration"):
        copy = shutil.copytree if (repo / part).is_dir() else shutil.copy
        copy(repo / part, source / part, **({"ignore": shutil.ignore_patterns("__pycache__")} if (repo / part).is_dir() else {}))
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                            "-w", str(tmp_path / "dist"), str(source)], capture_output=True, text=True, cwd=tmp_path)
    assert built.returncode == 0, built.stderr[-2000:]
    wheel = next((tmp_path / "dist").glob("compress-*.whl"))
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    recipes = sorted(p.name for p in (repo / "recipes").glob("*.yaml"))
    assert sorted(p.name for p in (site / "compress" / "bundled_recipes").glob("*.yaml")) == recipes
    assert (site / "compress" / "bundled_calibration" / "default.txt").read_bytes() == (repo / "calibration" / "default.txt").read_bytes()

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # the wheel first; what PYTHONPATH held besides stays (the dependencies, where they are installed that way)
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])), "PATH": "/usr/bin:/bin",
           "HF_HUB_OFFLINE": "1"}
    probe = ("import json, compress\n"
             "from compress import load_recipe\n"
             "from compress.calibration import resolve_data_path\n"
             "r = load_recipe('recipes/w8a16-absmax.yaml')\n"
             "print(json.dumps([compress.__file__, r.source, str(resolve_data_path('calibration/heldout-tinyshakespeare.txt'))]))\n")
    ran = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=elsewhere, env=env)
    assert ran.returncode == 0, ran.stderr[-2000:]
    package, recipe, heldout = json.loads(ran.stdout)
    assert Path(package).parent == site / "compress"  # the wheel's copy, not the checkout's
    assert Path(recipe) == site / "compress" / "bundled_recipes" / "w8a16-absmax.yaml"
    assert Path(heldout) == site / "compress" / "bundled_calibration" / "heldout-tinyshakespeare.txt"
    listed = subprocess.run([sys.executable, "-m", "compress", "--json", "recipes"], capture_output=True, text=True,
                            cwd=elsewhere, env=env)
    assert listed.returncode == 0, listed.stderr[-2000:]
    assert [row["recipe"] for row in json.loads(listed.stdout)] == [f"recipes/{name}" for name in recipes]
