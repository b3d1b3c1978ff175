"""compress: model compression for Hugging Face transformers, driven by YAML recipes.

Python API (the CLI is a thin layer over it):

    from compress import load_recipe, run_recipe, evaluate_model
    report = run_recipe(load_recipe("recipes/w8a16-absmax.yaml"), output="out/w8")
"""

__version__ = "0.1.0"

from compress.errors import CompressError  # noqa: E402
from compress.recipe import load_recipe, parse_recipe  # noqa: E402
from compress.pipeline import run_recipe, evaluate_model  # noqa: E402

__all__ = ["CompressError", "load_recipe", "parse_recipe", "run_recipe", "evaluate_model", "__version__"]
