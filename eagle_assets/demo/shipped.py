"""The embedded default target as the project ships it: ``eagle_assets/demo/target/``, a Hugging Face model
directory (3.9 MB of float32 safetensors, the tokenizer with its chat template, ``recipe.json``) made by
``python -m eagle_assets.demo.build --ship`` from the recipe in this package.

Shipped rather than built on each machine because the build's bytes hold on one kind of CPU only
(:mod:`eagle_assets.demo.trainer`): every machine now serves the same weights, and the pipeline starts at once.
``recipe.json`` names the recipe hash and the weights' sha256 the build wrote and the gate's verdict on them; both
are checked before the directory is used, so an edited recipe (or a broken checkout) is found, not served.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from importlib import resources
from pathlib import Path

from eagle_assets.demo.recipe import RECIPE_FILE, recipe_hash

# The files of a built target that are shipped (the build's own work files never are).
SHIPPED_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json", RECIPE_FILE)
WEIGHTS_FILE = "model.safetensors"


class DemoTargetStale(RuntimeError):
    """The shipped target does not match this checkout's recipe or its own recorded weights; the message says
    which and the command that rebuilds and ships it."""


def shipped_dir() -> Path:
    """``eagle_assets/demo/target`` inside the installed package (it may not exist in a broken install)."""
    return Path(str(resources.files("eagle_assets.demo").joinpath("target")))


def weights_sha256(model_dir: Path) -> str:
    """sha256 (hex) of ``model_dir/model.safetensors``."""
    return hashlib.sha256((Path(model_dir) / WEIGHTS_FILE).read_bytes()).hexdigest()


def demo_target() -> Path:
    """The shipped target's directory, after checking that it is the one this checkout's recipe makes.

    Raises:
        DemoTargetStale: a file is missing (the package was installed without its data, or a Git LFS pointer was
            checked out instead of the weights), the recipe hash in ``recipe.json`` is not this checkout's
            (``eagle_assets/demo/`` or ``DemoRecipe`` was edited), or the weights' sha256 is not the recorded one.
    """
    path = shipped_dir()
    rebuild = ("rebuild and ship it with `python -m eagle_assets.demo.build --ship` (about three minutes on 2 "
               "cores), or reinstall the package from a clean checkout")
    missing = [name for name in SHIPPED_FILES if not (path / name).is_file()]
    if missing:
        raise DemoTargetStale(f"the shipped demo target {path} lacks {', '.join(missing)}: {rebuild}")
    meta = json.loads((path / RECIPE_FILE).read_text())
    if meta.get("recipe_hash") != recipe_hash():
        raise DemoTargetStale(
            f"the shipped demo target {path} was built from recipe {str(meta.get('recipe_hash'))[:16]}, and this "
            f"checkout's eagle_assets/demo/ gives recipe {recipe_hash()[:16]}: the recipe or its source changed "
            f"since the weights were shipped; {rebuild}")
    if weights_sha256(path) != meta.get("weights_sha256"):
        raise DemoTargetStale(f"{path / WEIGHTS_FILE} is not the file its build wrote (sha256 "
                              f"{weights_sha256(path)[:12]}... against {str(meta.get('weights_sha256'))[:12]}... in "
                              f"recipe.json): {rebuild}")
    return path


def ship(model_dir: Path, dest: Path | None = None) -> Path:
    """Copy a built target that passed its gate into ``dest`` (default :func:`shipped_dir`), replacing what is
    there in one rename; returns ``dest``.

    Raises:
        ValueError: ``model_dir`` has no passing gate in its ``recipe.json`` (a rejected or ungated build).
    """
    model_dir, dest = Path(model_dir), Path(dest or shipped_dir())
    gate = json.loads((model_dir / RECIPE_FILE).read_text()).get("gate")
    if not gate or gate.get("failures"):
        raise ValueError(f"{model_dir} did not pass the demo gate (recipe.json: gate {gate and gate['failures']}); "
                         "only a passing build is shipped")
    tmp = Path(tempfile.mkdtemp(prefix=".target-", dir=dest.parent))
    for name in SHIPPED_FILES:
        shutil.copyfile(model_dir / name, tmp / name)
    tmp.chmod(0o755)
    if dest.exists():
        old = dest.with_name(f".{dest.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        dest.rename(old)
        shutil.rmtree(old)
    tmp.rename(dest)
    return dest
