"""Resources shared by the assets: where the catalog and the files are, and which target model to use.

Every resource here (and ``server_resource.SGLangServerResource``) is a :class:`CatalogResource`: its values come from
the catalog when the code location loads the Definitions, and its Dagster config schema is empty, so a run whose
config names one of its fields is refused at launch (``DagsterInvalidConfigError: Received unexpected config entry
...``). Whoever can launch a run from the UI can pick partitions and the run config of assets (``regenerate``), but
not the executable a server is launched with, the URL the API key is sent to, the environment variable read as that
key, the storage root or the catalog (issue 48). ``pydantic``-style ``dg.ConfigurableResource`` fields would all be
overridable from run config: Dagster merges run config over the values given at definition time.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import dagster as dg

from eagle_assets.catalog import Catalog, load_catalog
from eagle_assets.storage.shards import Layout
from eagle_assets.target_model.setup import TargetSetup, load_target_setup

CATALOG_ONLY_NOTE = (" Set in the catalog only: this resource takes no run config (a run config that names it is "
                     "refused at launch), so a run launched from the UI cannot change paths, executables, URLs or "
                     "secrets.")


@lru_cache(maxsize=8)
def _cached_catalog(path: str, mtime: float) -> Catalog:
    return load_catalog(Path(path))


class CatalogResource(dg.ResourceDefinition):
    """A Dagster resource whose values are fixed where the Definitions are built (from the catalog), never by run
    config: a ``ResourceDefinition`` with an empty config schema whose value is the object itself, unless a subclass
    passes its own ``resource_fn`` (``SGLangServerResource`` gives each run a copy of its own).

    Assets take it as ``name: dg.ResourceParam[TheClass]``; ``Definitions.resources[name]`` is the object itself.
    """

    def __init__(self, description: str, resource_fn=None):
        super().__init__(resource_fn=resource_fn or self._itself, config_schema={},
                         description=description + CATALOG_ONLY_NOTE)

    def _itself(self, _context: dg.InitResourceContext) -> "CatalogResource":
        return self


class PipelineSettings(CatalogResource):
    """The dataset catalog (YAML path) and the storage root every stage writes under.

    Attributes:
        catalog_path: the catalog file (absolute once ``build_definitions`` resolved it).
        storage_root: the folder every stage writes under (``<storage_root>/<catalog name>/...``).
    """

    def __init__(self, *, catalog_path: str, storage_root: str):
        self.catalog_path, self.storage_root = str(catalog_path), str(storage_root)
        super().__init__(f"The catalog {self.catalog_path} and the storage root {self.storage_root}.")

    def __repr__(self) -> str:
        return f"PipelineSettings(catalog_path={self.catalog_path!r}, storage_root={self.storage_root!r})"

    def catalog(self) -> Catalog:
        path = Path(self.catalog_path)
        return _cached_catalog(str(path), path.stat().st_mtime)

    def layout(self) -> Layout:
        return Layout(Path(self.storage_root), Path(self.catalog_path).stem)


class TargetModel(CatalogResource):
    """The target model: ``demo`` (the embedded default the package ships) or a local HF model directory."""

    def __init__(self, *, model: str = "demo"):
        self.model = str(model)
        super().__init__(f"The target model: {self.model}.")

    def __repr__(self) -> str:
        return f"TargetModel(model={self.model!r})"

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
