"""`compress keys`: every recipe key with its type, default and meaning, read from the schema
itself (the pydantic models the recipe is validated with), so the reference cannot drift from
what a recipe accepts.

    sections()      one row per stage (the registry) and per recipe section
    keys(name)      one row per key of a stage or section; a nested section's keys are dotted
                    (`weights.group_size`, `train.lr`), a list of sections' with [] (`mappings[].smooth`)
"""

from __future__ import annotations

import types
import typing
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from compress.errors import CompressError


def _sections() -> dict[str, tuple[str, type[BaseModel]]]:
    from compress.recipe import CalibrationConfig, EvaluationConfig, RecipeFile
    from compress.stages import STAGES

    return {"recipe": ("section", RecipeFile), "calibration": ("section", CalibrationConfig),
            "evaluation": ("section", EvaluationConfig), **{name: ("stage", cls) for name, cls in STAGES.items()}}


def _summary(cls: type) -> str:
    return (cls.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ")


def sections() -> list[dict]:
    return [{"name": name, "kind": kind, "summary": _summary(cls)} for name, (kind, cls) in _sections().items()]


def keys(name: str) -> list[dict]:
    found = _sections()
    if name not in found:
        raise CompressError(f"no stage or recipe section named {name!r}", f"name one of: {', '.join(found)}")
    return list(_rows(found[name][1], ""))


# QuantArgs serves weights and activations alike; what only one side takes is left out of the other
# side's rows (the scheme refuses it there): weights have no tokens and no run-time ranges, and
# activations are per token or per tensor (or FP4 blocks, FP8 groups), never per output channel or tile.
_NOT_ON = {"weights": ({"dynamic"}, {"token"}), "input_activations": ({"block_structure"}, {"channel", "block"})}


def _rows(cls: type[BaseModel], prefix: str):
    dropped_keys, dropped_choices = _NOT_ON.get(prefix.rstrip(".").rsplit(".", 1)[-1], (set(), set()))
    for key, field in cls.model_fields.items():
        if key.startswith("_") or key in dropped_keys:
            continue
        nested, many = _section_of(field.annotation)
        if nested is not None and nested is not cls:
            yield {"key": prefix + key, "type": "list of sections" if many else "section",
                   "default": _default(field), "description": field.description or _summary(nested)}
            yield from _rows(nested, f"{prefix}{key}{'[]' if many else ''}.")
        else:
            kind = _type_name(field.annotation)
            if key == "strategy" and dropped_choices:
                kind = " | ".join(c for c in kind.split(" | ") if c not in dropped_choices)
            yield {"key": prefix + key, "type": kind, "default": _default(field), "description": field.description or ""}


def _section_of(annotation: Any) -> tuple[type[BaseModel] | None, bool]:
    """The model a key holds (directly, optionally, or as a list of them), and whether a list."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, False
    if typing.get_origin(annotation) in (list, tuple) and args and isinstance(args[0], type) and issubclass(args[0], BaseModel):
        return args[0], True
    if _is_union(annotation) and len(args) == 1:
        return _section_of(args[0])
    return None, False


def _is_union(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (Union, types.UnionType)


def _type_name(annotation: Any) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Annotated:  # a validated string (a target pattern): its base type
        return _type_name(args[0])
    if origin is Literal:
        return " | ".join(str(a).lower() if isinstance(a, bool) else str(a) for a in args)
    if _is_union(annotation):
        named = [_type_name(a) for a in args if a is not type(None)]
        return " | ".join(dict.fromkeys(named)) + (" | null" if type(None) in args else "")
    if origin in (list, tuple, set):
        return f"list of {_type_name(args[0])}" if args else "list"
    if origin is dict or annotation is dict:
        return "mapping"
    if annotation is Any:
        return "any"
    return {"str": "text", "int": "integer", "float": "number", "bool": "true | false"}.get(
        getattr(annotation, "__name__", ""), getattr(annotation, "__name__", str(annotation)))


def _default(field) -> str:
    if field.is_required():
        return "required"
    value = field.default_factory() if field.default_factory is not None else field.default
    if value is PydanticUndefined:
        return "required"
    if isinstance(value, BaseModel):
        return "(its keys' defaults)"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ", ".join(map(str, value)) + "]"  # as a YAML flow list
    return str(value)
