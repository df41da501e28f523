"""The identity of the code and the catalog a result was made by: the package's version, git commit and source
hash, installed package versions, and the catalog file's and loaded catalog's digests (``provenance.json`` of a
drafter checkpoint carries them; ``assets.provenance`` writes it)."""

from __future__ import annotations

import hashlib
import importlib.metadata
import platform
import subprocess
from pathlib import Path
from typing import Any

from eagle_assets.catalog import Catalog
from eagle_assets.lineage.versions import canonical_digest, file_sha256

PACKAGES = ("eagle-assets", "torch", "transformers", "tokenizers", "safetensors", "numpy", "pyarrow", "dagster",
            "dagster-k8s")
PACKAGE_DIR = Path(__file__).resolve().parents[1]  # the eagle_assets package, not this lineage/ folder


def package_versions() -> dict[str, str | None]:
    """Installed distribution versions of :data:`PACKAGES` (None when absent) and ``python``."""
    out: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    out["python"] = platform.python_version()
    return out


def source_sha256(package_dir: Path = PACKAGE_DIR) -> str:
    """sha256 hex over (relative path, bytes) of the package's ``.py`` and ``.jinja`` files, sorted by path."""
    h = hashlib.sha256()
    for path in sorted(p for p in package_dir.rglob("*") if p.suffix in (".py", ".jinja") and p.is_file()):
        h.update(str(path.relative_to(package_dir)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def _git(repo: Path, *args: str) -> str | None:
    try:
        proc = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def code_identity(package_dir: Path = PACKAGE_DIR) -> dict[str, Any]:
    """Version, git commit / dirty flag of the checkout holding ``package_dir`` (None when it is not one), source
    sha256."""
    repo = package_dir.parent
    commit = dirty = None
    if (repo / ".git").exists():
        commit = _git(repo, "rev-parse", "HEAD")
        status = _git(repo, "status", "--porcelain", "--untracked-files=no")
        dirty = None if status is None else bool(status)
    try:
        version = importlib.metadata.version("eagle-assets")
    except importlib.metadata.PackageNotFoundError:
        version = None
    return {"version": version, "git_commit": commit, "git_dirty": dirty, "source_sha256": source_sha256(package_dir)}


def catalog_identity(catalog: Catalog, path: Path) -> dict[str, Any]:
    """Path and sha256 of the catalog file ``path``, sha256 of the loaded ``catalog``, and its training block."""
    path = Path(path)
    return {"path": str(path), "file_sha256": file_sha256(path),
            "loaded_sha256": canonical_digest(catalog.model_dump(mode="json")),
            "training": catalog.training.model_dump(mode="json")}
