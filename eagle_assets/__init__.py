"""eagle-assets: exact, observable EAGLE-3 drafter training data as a Dagster asset pipeline.

``defs`` (the Dagster ``Definitions``) is loaded lazily, so ``dagster job execute -m eagle_assets`` finds it while
importing a submodule (the server process, the domain code) does not load the catalog or the asset graph.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "defs":
        from eagle_assets.definitions import defs

        return defs
    raise AttributeError(f"module 'eagle_assets' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), "defs"])
