"""Resources shared by the assets: where the catalog and the files are, and which target model to use."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import dagster as dg

from eagle_assets.catalog import Catalog, load_catalog
from eagle_assets.storage.shards import Layout
from eagle_assets.target_model.setup import TargetSetup, load_target_setup


@lru_cache(maxsize=8)
def _cached_catalog(path: str, mtime: float) -> Catalog:
    return load_catalog(Path(path))


class PipelineSettings(dg.ConfigurableResource):
    """The dataset catalog (YAML path) and the storage root every stage writes under."""

    catalog_path: str
    storage_root: str

    def catalog(self) -> Catalog:
        path = Path(self.catalog_path)
        return _cached_catalog(str(path), path.stat().st_mtime)

    def layout(self) -> Layout:
        return Layout(Path(self.storage_root), Path(self.catalog_path).stem)


class TargetModel(dg.ConfigurableResource):
    """The target model: ``demo`` (the embedded default the package ships) or a local HF model directory."""

    model: str = "demo"

    def resolve(self) -> Path:
        """Directory of the target model.

        Raises ``FileNotFoundError`` naming the path when a configured model directory does not exist, and
        ``demo.shipped.DemoTargetStale`` when the shipped demo target does not match this checkout's recipe.
        """
        if self.model == "demo":
            from eagle_assets.demo.shipped import demo_target

            return demo_target()
        path = Path(self.model).expanduser()
        if not path.exists():
            raise FileNotFoundError(
                f"target model directory {path} does not exist: set target.model in the catalog to a local "
                "Hugging Face model directory (config.json + tokenizer files), or to 'demo'"
            )
        return path

    def setup(self, profile_overrides: dict | None = None) -> TargetSetup:
        """The target's tokenizer, family profile, vocab size, control and blank ids under the catalog's
        ``target.profile`` overrides (``target_model.setup``: loaded once per process)."""
        return load_target_setup(self.resolve(), profile_overrides)
