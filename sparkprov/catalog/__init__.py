"""The model catalog: recipes as data (recipes/*.yaml), rendering a launch for a host, the
preflight linter and the memory planner. See load.py, render.py, lint.py, memory.py."""

from sparkprov.catalog.load import Catalog, RepoInfo, load_catalog

__all__ = ["Catalog", "RepoInfo", "load_catalog"]
