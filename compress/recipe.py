"""The recipe: one YAML file naming the model, the calibration set, the ordered stages, the
evaluation to run after, and the output. The whole file is validated before any model is loaded;
an error names the file, the line and the key, and suggests the nearest valid key for a typo.

    model: default                      # hub id, local directory, or `default` (bundled ref-llama)
    calibration:
      dataset: calibration/default.txt  # .txt, .jsonl, .json, .parquet, or a hub dataset name
      num_samples: 128
      seq_len: 256
    stages:
      - rtn:                            # a stage name from compress.stages.STAGES
          scheme: W8A16
    evaluation:
      datasets: [calibration/heldout-tinyshakespeare.txt]
    output: out/w8a16
"""

from __future__ import annotations

import difflib
import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from compress.errors import CompressError
from compress.tasks import TaskRequest


def named_datasets(value):
    """A dataset key names something: an empty string or list read as "calibration data  is
    empty" further on, with no name in the gap."""
    names = [value] if isinstance(value, str) else value
    if not names or any(not n.strip() for n in names):
        raise ValueError("name a file or hub dataset (an empty name or list was given)")
    return value


class CalibrationConfig(BaseModel):
    """Calibration samples: `num_samples` windows of `seq_len` tokens (or one per line/record)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    dataset: Union[str, list[str]] = Field(
        "calibration/default.txt",
        description="file path (.txt, .jsonl, a .json array, .parquet) or hub dataset name; a list is concatenated in order")
    config_name: Optional[str] = Field(None, description="hub dataset configuration, e.g. wikitext-2-raw-v1")
    split: str = Field("train", description="hub dataset split")
    text_field: str = Field("text", description="field holding the text in .jsonl/.parquet/hub records, or a conversation "
                            "(a list of {role, content} messages, rendered with the tokenizer's chat template)")
    num_samples: int = Field(128, gt=0, description="how many calibration samples, a positive integer")
    seq_len: int = Field(256, gt=0, description="tokens per sample, a positive integer")
    packing: bool = Field(True, description="true: concatenate and cut into windows; false: one sample per line/record")
    min_chars: int = Field(0, ge=0, description="unpacked mode: keep only lines/records longer than this many characters")
    shuffle: bool = Field(False, description="pick windows at random (with seed) instead of the first ones")
    streaming: bool = Field(False, description="hub datasets: read the split as a stream and stop once there are enough samples, "
                            "for corpora too big to download whole (allenai/c4); with shuffle, records are shuffled within 10,000")
    seed: Optional[int] = Field(None, description="the seed of shuffle's draw (default: the run's --seed)")

    @field_validator("dataset")
    @classmethod
    def _dataset_named(cls, value):
        return named_datasets(value)


class EvaluationConfig(BaseModel):
    """What `compress quantize` measures after the stages, against the uncompressed model."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    datasets: list[str] = Field(default_factory=list, description="text files for perplexity / KL / top-1 (or embedding fidelity on encoders)")
    seq_len: int = Field(256, ge=2, description="tokens per evaluation window (at least 2: one to predict from, one predicted)")
    max_windows: int = Field(256, gt=0, description="windows scored from each file")
    max_sentences: int = Field(200, gt=0, description="encoders: sentences taken from each file")
    batch_size: int = Field(8, gt=0, description="windows per forward")
    tasks: Optional[TaskRequest] = Field(None, description="lm-eval tasks scored on the output and on the uncompressed model: "
                                         "a list of names, or {names, num_fewshot, limit, metric, chat_template, include_path}")


STAGES_HELP = "a list of one or more stages, each `- name: {keys}`, e.g. `- rtn: {scheme: W8A16}`"
RECIPE_HELP = "start from a bundled recipe: `compress recipes` lists them"


class RecipeFile(BaseModel):
    """The top level of a recipe file. Each stage entry is `{stage-name: {its keys}}`."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: Optional[str] = Field(None, description="hub id or local directory; --model overrides it")
    calibration: Optional[CalibrationConfig] = Field(None, description="the calibration set every activation-based stage reads")
    stages: list[Any] = Field(..., min_length=1, description=STAGES_HELP)
    evaluation: Optional[EvaluationConfig] = Field(None, description="what the output is scored on after the stages")
    output: Optional[str] = Field(None, description="the output directory; --output overrides it")
    offload: Literal["none", "disk"] = Field(
        "none", description="disk: read and write the model block by block, for models larger than RAM")
    format: Literal["auto", "packed", "dense"] = Field(
        "auto", description="packed: the compressed-tensors format (int4 packed, int8, FP8, scales); dense: dequantized "
                            "weights in the model's dtype; auto: packed when every quantized layer can be expressed")

    @field_validator("stages")
    @classmethod
    def _entries_are_single_key_mappings(cls, stages: list[Any]) -> list[Any]:
        for entry in stages:
            if isinstance(entry, str):
                continue  # a bare stage name: all defaults
            if not isinstance(entry, dict) or len(entry) != 1:
                raise ValueError("each stage is a mapping with one key, the stage name, e.g. `- rtn: {scheme: W8A16}`")
        return stages


class Recipe:
    """A validated recipe: the top-level fields plus one config object per stage, in order."""

    def __init__(self, source: str, top: RecipeFile, stages: list[tuple[str, BaseModel]]):
        self.source = source
        self.model = top.model
        self.calibration = top.calibration
        self.evaluation = top.evaluation
        self.output = top.output
        self.offload = top.offload
        self.format = top.format
        self.stages = stages

    @property
    def needs_calibration(self) -> bool:
        return any(getattr(cfg, "needs_calibration", False) for _, cfg in self.stages)

    def effective(self) -> dict:
        """Every value the run used, defaults filled in: saved next to the output."""
        stages = []
        for name, cfg in self.stages:
            dumped = cfg.model_dump(mode="json")
            data = getattr(cfg, "data", None)
            if data is not None and data.dataset is None and data.generate is None and self.calibration is not None:
                dumped["data"]["seq_len"] = self.calibration.seq_len  # it trained on the calibration windows
            stages.append({name: dumped})
        return {
            "model": self.model,
            "calibration": self.calibration.model_dump() if self.calibration else None,
            "stages": stages,
            "evaluation": self.evaluation.model_dump() if self.evaluation else None,
            "output": self.output,
            "offload": self.offload,
            "format": self.format,
        }


# --------------------------------------------------------------------------------------------
# Loading and error reporting


def _node_at(root: yaml.Node | None, loc: tuple) -> tuple[yaml.Node | None, yaml.Node | None]:
    """Walk a composed YAML tree along a pydantic error location.

    Returns (deepest node reached, the key node of the last mapping step) so that an unknown key
    is reported at the key's own line.
    """
    node, key_node = root, None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                if k.value == str(part):
                    node, key_node = v, k
                    break
            else:
                return node, key_node
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node, key_node = node.value[part], None
        else:
            return node, key_node
    return node, key_node


def _fields_at(loc: tuple, stage_classes: dict[str, type[BaseModel]]) -> list[str]:
    """The valid keys of the mapping that holds the last element of `loc` (not `resolved`, which
    compress writes into a saved recipe and ignores on input)."""
    return [k for k in getattr(_model_at(loc, stage_classes), "model_fields", {}) or {} if k != "resolved"]


def _description_at(loc: tuple, stage_classes: dict[str, type[BaseModel]]) -> str | None:
    """The description of the field at `loc` (for a hint), if it has one."""
    from compress.schemes import QuantArgs

    if not loc or isinstance(loc[-1], int):
        return None
    name = str(loc[-1])
    field = (getattr(_model_at(loc, stage_classes), "model_fields", {}) or {}).get(name)
    desc = getattr(field, "description", None)
    if desc is None and len(loc) >= 2 and loc[-2] in ("weights", "input_activations"):
        # stage overrides mirror QuantArgs, which documents each field
        desc = getattr(QuantArgs.model_fields.get(name), "description", None)
    return f"{name}: {desc}" if desc else None


def _model_at(loc: tuple, stage_classes: dict[str, type[BaseModel]]) -> Any:
    """The pydantic model class of the mapping that holds the last element of `loc`."""
    cls: Any = RecipeFile
    parts = list(loc[:-1])
    if parts[:1] == ["stages"] and len(parts) >= 3:
        cls = stage_classes.get(str(parts[2]))
        parts = parts[3:]
    for part in parts:
        if cls is None or isinstance(part, int):
            continue
        field = getattr(cls, "model_fields", {}).get(part)
        if field is None:
            return None
        ann = field.annotation
        for arg in getattr(ann, "__args__", ()) or (ann,):
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                cls = arg
                break
        else:
            cls = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
    return cls


# how pydantic names the member of a union in an error's location ('str', 'list[str]', a model's class)
_UNION_MEMBER = re.compile(r"^(str|int|float|bool|none|[a-z-]+\[.*\]|[A-Z]\w*)$")


def _merged_union_errors(errors: list[dict]) -> list[dict]:
    """pydantic refuses a value that fits no member of a union once per member, under a location
    ending in the member ('calibration.dataset.str', '... .list[str]'): one error at the key,
    naming every form it may take."""
    stripped = []
    for err in errors:
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and _UNION_MEMBER.match(p)))
        stripped.append({**err, "loc": loc, "member": loc != tuple(err["loc"])})
    # a member refused inside the value (item 1 of a list) says more than another member refusing it whole
    deeper = {e["loc"][:k] for e in stripped if e["member"] for k in range(len(e["loc"]))}
    merged: list[dict] = []
    for err in stripped:
        if err["member"] and err["loc"] in deeper:
            continue
        last = merged[-1] if merged else None
        if (last is not None and last["loc"] == err["loc"] and last["msg"].startswith("Input should be ")
                and err["msg"].startswith("Input should be ")):
            last["msg"] += " or " + err["msg"].removeprefix("Input should be ")
            continue
        merged.append(err)
    return merged


def _format_error(path: str, root: yaml.Node | None, err: dict, stage_classes: dict) -> tuple[str, str | None]:
    """(message, hint) for one validation error: file, line and key, and what to do."""
    loc = tuple(err["loc"])
    node, key_node = _node_at(root, loc)
    where = key_node if err["type"] == "extra_forbidden" and key_node is not None else node
    line = f":{where.start_mark.line + 1}" if where is not None else ""
    key = ".".join(str(p) for p in loc) or "(top level)"
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        valid = _fields_at(loc, stage_classes)
        close = difflib.get_close_matches(str(loc[-1]), valid, n=1)
        hint = (f"did you mean '{close[0]}'?" if close else f"valid keys here: {', '.join(valid)}" if valid
                else "valid keys here: none (write {})")
        return f"{path}{line}: unknown key '{key}'; {hint}", None
    if err["type"] == "missing":
        return f"{path}{line}: missing required key '{key}'", _description_at(loc, stage_classes) or f"add '{loc[-1]}'"
    value = err.get("input")
    if not err["type"].startswith("value_error") and isinstance(value, (str, int, float, bool)) and not isinstance(value, type):
        msg += f", got {str(value).lower() if isinstance(value, bool) else repr(value)}"  # as the YAML spells it
    hint = err.get("hint") or _description_at(loc, stage_classes) or RECIPE_HELP
    return f"{path}{line}: {key}: {msg}", hint


def _stage_settings_hint(name: str, cls: type[BaseModel]) -> str:
    keys = [k for k in cls.model_fields if k != "resolved"]
    if not keys:
        return f"write `- {name}` alone, it has no settings"
    example = "scheme: W8A16" if "scheme" in keys else f"{keys[0]}: ..."
    try:
        cls.model_validate({})
    except ValidationError:
        return f"write `- {name}: {{{example}}}`"  # it has required settings
    return f"write `- {name}: {{{example}}}`, or `- {name}` alone for its defaults"


def _booleans_for_numbers(data: Any, stage_classes: dict[str, type[BaseModel]]) -> list[dict]:
    """YAML true/false where a number is expected, as validation errors: pydantic reads them as 1
    and 0, so `steps: true` trained one step and `num_samples: true` calibrated on one sample."""
    found: list[dict] = []

    def numeric(annotation: Any, allow_str: bool = False) -> bool:
        if get_origin(annotation) is Annotated:  # Annotated[float, Field(ge=0)]
            annotation = get_args(annotation)[0]
        kinds = [a for a in (get_args(annotation) or (annotation,)) if a is not type(None)]
        numbers = [a for a in kinds if a in (int, float)]
        return bool(numbers) and all(a in (int, float) or (allow_str and a is str) for a in kinds)

    def dict_of_numbers(annotation: Any) -> bool:
        """dict[pattern, number] fields (alpha_overrides, sparsity_overrides): their values too."""
        args = get_args(annotation) if get_origin(annotation) is dict else ()
        return len(args) == 2 and numeric(args[1], allow_str=True)

    seen: set[int] = set()  # a YAML alias may repeat a node, or hold itself

    def walk(value: Any, loc: tuple) -> None:
        if isinstance(value, (dict, list)):
            if id(value) in seen:
                return
            seen.add(id(value))
        if isinstance(value, dict):
            for key, item in value.items():
                walk(item, (*loc, key))
        elif isinstance(value, list):
            for i, item in enumerate(value):
                walk(item, (*loc, i))
        elif isinstance(value, bool) and loc and not isinstance(loc[-1], int):
            field = (getattr(_model_at(loc, stage_classes), "model_fields", None) or {}).get(loc[-1])
            hint = None  # the field's own description, found by _format_error
            if field is not None:
                numbers = numeric(field.annotation)
            elif len(loc) >= 2 and not isinstance(loc[-2], int):  # a value of a dict field?
                field = (getattr(_model_at(loc[:-1], stage_classes), "model_fields", None) or {}).get(loc[-2])
                numbers = field is not None and dict_of_numbers(field.annotation)
                hint = f"{loc[-2]}: {field.description}" if numbers and field.description else None
            else:
                numbers = False
            if numbers:
                found.append({"loc": loc, "msg": "expected a number", "type": "bool_for_number", "input": value,
                              "hint": hint})

    walk(data, ())
    return found


def _duplicate_key(node: yaml.Node | None, visited: set | None = None) -> tuple[str, int] | None:
    """The first key given twice in one mapping, and its second line: a copied line edited in one
    place only (`scheme: W4A16` then `scheme: W8A16`), which YAML resolves to the last without a word.
    Each node is visited once: an alias may repeat a node, or contain itself."""
    visited = set() if visited is None else visited
    if id(node) in visited:
        return None
    visited.add(id(node))
    if isinstance(node, yaml.MappingNode):
        seen = set()
        for key, value in node.value:
            if isinstance(key, yaml.ScalarNode):
                if key.value in seen:
                    return key.value, key.start_mark.line + 1
                seen.add(key.value)
            found = _duplicate_key(value, visited)
            if found:
                return found
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            found = _duplicate_key(item, visited)
            if found:
                return found
    return None


def parse_recipe(text: Union[str, dict], path: str = "<recipe>", default_calibration: dict | None = None) -> Recipe:
    """Validate a recipe's text (or the mapping it would load to) completely; raise CompressError
    on the first problem. `default_calibration`: the calibration section a recipe gets when its
    stages need one and it has none (`compress bench` gives the protocol's)."""
    from compress.stages import STAGES

    if isinstance(text, dict):  # validated as the YAML it would be written as (Paths as their text)
        text = yaml.safe_dump(json.loads(json.dumps(text, default=str)), sort_keys=False)
    if not isinstance(text, str):
        raise CompressError(f"{path}: a recipe is YAML text or a dict, not a {type(text).__name__}",
                            "pass the recipe's text, a dict, or use load_recipe(PATH)")
    try:
        root = yaml.compose(text)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise CompressError(f"{path}{line}: invalid YAML: {problem}", "fix the syntax at that line") from None
    duplicate = _duplicate_key(root)
    if duplicate is not None:
        key, line = duplicate
        raise CompressError(f"{path}:{line}: key '{key}' appears twice in one mapping",
                            "keep one: YAML would silently use the last")
    if not isinstance(data, dict):
        found = "an empty file" if data is None else f"a YAML {type(data).__name__}"
        raise CompressError(f"{path}: a recipe is a YAML mapping with keys model, calibration, stages, evaluation, output; "
                            f"found {found}", RECIPE_HELP)

    stage_classes = dict(STAGES)
    errors: list[dict] = []
    top = None
    try:
        top = RecipeFile.model_validate(data)
    except ValidationError as exc:
        errors.extend(exc.errors())

    stages: list[tuple[str, BaseModel]] = []
    raw_stages = data.get("stages") if isinstance(data.get("stages"), list) else []
    for i, entry in enumerate(raw_stages):
        if isinstance(entry, str):
            name, body = entry, {}
        elif isinstance(entry, dict) and len(entry) == 1:
            name, body = next(iter(entry.items()))
            body = {} if body is None else body  # `- kv_cache:` alone; but `[]`, `false` or `0` are mistakes
        else:
            continue  # reported by RecipeFile
        if name not in STAGES:
            close = difflib.get_close_matches(str(name).lower(), list(STAGES), n=1)  # QAT: qat
            hint = f"did you mean '{close[0]}'?" if close else f"known stages: {', '.join(STAGES)}"
            node, key_node = _node_at(root, ("stages", i, name))
            line = f":{(key_node or node).start_mark.line + 1}" if (key_node or node) is not None else ""
            raise CompressError(f"{path}{line}: unknown stage '{name}'", hint)
        if not isinstance(body, dict):
            errors.append({"loc": ("stages", i, name), "msg": "stage settings must be a mapping of keys", "type": "type",
                           "hint": _stage_settings_hint(name, stage_classes[name])})
            continue
        try:
            stages.append((name, stage_classes[name].model_validate(body)))
        except ValidationError as exc:
            for e in exc.errors():
                errors.append({**e, "loc": ("stages", i, name, *e["loc"])})

    booleans = _booleans_for_numbers(data, stage_classes)
    reported = {b["loc"] for b in booleans}  # pydantic may also refuse the 1 or 0 it read there
    errors = booleans + [e for e in errors if tuple(e["loc"]) not in reported]
    if errors:
        errors = _merged_union_errors(errors)
        # an unknown key first: a misspelt one (`stagez:`) is why the required key is missing
        errors.sort(key=lambda e: e["type"] != "extra_forbidden")
        first, hint = _format_error(path, root, errors[0], stage_classes)
        more = f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})" if len(errors) > 1 else ""
        raise CompressError(first + more, hint)
    assert top is not None
    if default_calibration is not None and top.calibration is None and any(
            getattr(cfg, "needs_calibration", False) for _, cfg in stages):
        top.calibration = CalibrationConfig.model_validate(default_calibration)
    recipe = Recipe(path, top, stages)
    _check_contradictions(recipe, path)
    return recipe


def _check_contradictions(recipe: Recipe, path: str) -> None:
    names = [name for name, _ in recipe.stages]
    if "kv_cache" in names[:-1]:
        i = names.index("kv_cache")
        later = next((n for n in names[i + 1:] if n != "kv_cache"), None)
        if later is None:
            raise CompressError(f"{path}: stages.{i}.kv_cache is repeated: the last one measures the same scales again",
                                "keep one kv_cache stage")
        raise CompressError(f"{path}: stages.{i}.kv_cache comes before {later}: its FP8 scales are measured on the "
                            f"weights as they are then, and {later} changes them", "make kv_cache the last stage")
    for i, (name, cfg) in enumerate(recipe.stages):
        data = getattr(cfg, "data", None)
        if data is not None and data.dataset is None and data.generate is None and recipe.calibration is not None \
                and "seq_len" in data.model_fields_set and data.seq_len != recipe.calibration.seq_len:
            raise CompressError(f"{path}: stages.{i}.{name}.data.seq_len is {data.seq_len}, but the stage trains on the "
                                f"calibration windows, of calibration.seq_len {recipe.calibration.seq_len} tokens",
                                "give the stage its own text (data.dataset), or drop data.seq_len")
        if data is not None and data.dataset is None and data.generate is None and recipe.calibration is not None \
                and recipe.calibration.packing:
            windows = recipe.calibration.num_samples
            need = (data.num_samples or 0) + data.eval_samples + (0 if data.num_samples else 1)  # at least one to train on
            if windows < need:
                asked = (f"data.num_samples {data.num_samples} + data.eval_samples {data.eval_samples}" if data.num_samples
                         else f"data.eval_samples {data.eval_samples} held out and one to train on")
                raise CompressError(f"{path}: stages.{i}.{name} trains on the calibration windows, "
                                    f"calibration.num_samples {windows}, but {asked} need {need}",
                                    "raise calibration.num_samples, lower data.num_samples or data.eval_samples, "
                                    "or give the stage its own text (data.dataset)")
        if getattr(cfg, "needs_calibration", False) and recipe.calibration is None:
            if hasattr(cfg, "train"):  # qat, distill: text to train on
                raise CompressError(f"{path}: stage '{name}' has no text to train on: neither its 'data' nor a 'calibration' section",
                                    "give the stage data: {dataset: FILE}, or the recipe a calibration: {dataset: FILE}")
            raise CompressError(
                f"{path}: stage '{name}' needs calibration data ({_why_calibration(cfg)}) but the recipe has no 'calibration' section",
                "add calibration: {dataset: ...}" + (" or use dynamic activations" if _static_only(cfg) else ""),
            )


def _static_only(cfg) -> bool:
    """A quantization stage that calibrates only for its static activation ranges."""
    from compress.stages.base import EngineOptions, QuantizationStage

    return isinstance(cfg, QuantizationStage) and not isinstance(cfg, EngineOptions)


def _why_calibration(cfg) -> str:
    if _static_only(cfg):
        return "static activation ranges"
    return "it measures activations layer by layer"


def load_recipe(path: Union[str, Path], default_calibration: dict | None = None) -> Recipe:
    p = Path(path)
    if not p.exists():
        from compress.modeling import bundled_file

        p = bundled_file(p) or p  # a bundled recipe by the name `compress recipes` lists, from any directory
    if p.is_dir():
        raise CompressError(f"recipe {p} is a directory", "give the path of a .yaml recipe file")
    if not p.exists():  # a pipe (`--recipe <(sed ... r.yaml)`) is read as a file is
        raise CompressError(f"recipe file not found: {p}", "check the path, or run `compress recipes` to list the bundled ones")
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise CompressError(f"{p}: cannot read recipe: {exc.strerror or exc}", "check the file's permissions") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise CompressError(f"{p}:{line}: recipe is not UTF-8 text (byte 0x{raw[exc.start]:02x})", "save the file as UTF-8") from None
    return parse_recipe(text, str(p), default_calibration)
