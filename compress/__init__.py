"""compress: model compression for Hugging Face transformers, driven by YAML recipes.

Python API (the CLI is a thin layer over it):

    from compress import load_recipe, run_recipe, evaluate_model
    report = run_recipe(load_recipe("recipes/w8a16-absmax.yaml"), output="out/w8")
"""

__version__ = "0.1.0"

# The API is imported on first use (PEP 562), not with the package: importing torch and
# transformers takes seconds, and the `compress` command must be able to catch a Ctrl-C in them
# (compress/__main__.py), which it cannot while Python is still importing this package.
_API = {"CompressError": "compress.errors", "load_recipe": "compress.recipe", "parse_recipe": "compress.recipe",
        "run_recipe": "compress.pipeline", "evaluate_model": "compress.pipeline"}

__all__ = [*_API, "__version__"]


def __getattr__(name: str):
    if name in _API:
        import importlib

        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'compress' has no attribute {name!r}")
