"""Runs one llm-compressor `oneshot` for `compress bench --against llmcompressor`.

This file is a standalone script for *another* Python environment, the one where llm-compressor
is installed (its pins of torch, transformers and compressed-tensors differ from ours, so the two
never share an environment). It imports nothing from compress. The driver (compress/against.py)
runs it as

    OTHER_PYTHON -I compress/llmcompressor_runner.py spec.json

where spec.json holds: the model, the calibration token ids compress itself used (so both tools
see the same windows, in the same order), the modifiers to build (class name and keyword
arguments, translated from the compress recipe), and the output directory. The script writes
result.json beside the spec: wall seconds of the oneshot call, memory, and versions.
"""

from __future__ import annotations

import importlib
import json
import sys
import time
from pathlib import Path

# Where a modifier class lives has moved between llm-compressor releases; look in each.
MODIFIER_MODULES = (
    "llmcompressor.modifiers.quantization",
    "llmcompressor.modifiers.autoround",
    "llmcompressor.modifiers.transform.awq",
    "llmcompressor.modifiers.awq",
    "llmcompressor.modifiers.transform.smoothquant",
    "llmcompressor.modifiers.smoothquant",
    "llmcompressor.modifiers.pruning.sparsegpt",
    "llmcompressor.modifiers.obcq",
    "llmcompressor.modifiers.pruning.wanda",
    "llmcompressor.modifiers.pruning",
)


def rss_mib(field: str) -> float:
    """VmRSS (now) or VmHWM (peak) of this process, from /proc (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def modifier_class(name: str):
    for module in MODIFIER_MODULES:
        try:
            cls = getattr(importlib.import_module(module), name, None)
        except ImportError:
            continue
        if cls is not None:
            return cls
    raise SystemExit(f"error: llm-compressor has no modifier named {name} in {', '.join(MODIFIER_MODULES)}")


def cpu_only_patches() -> list[str]:
    """Workarounds that let llm-compressor run on a machine without a GPU, without changing what it
    computes; each is reported next to its figures."""
    done = []
    try:
        from llmcompressor.pipelines.cache import IntermediatesCache
    except ImportError:
        return done
    if hasattr(IntermediatesCache, "pin_memory"):
        # AWQ pins its cached block inputs for faster host-to-GPU copies, and torch refuses to pin
        # memory without an accelerator ("Cannot access accelerator device when none is available").
        IntermediatesCache.pin_memory = lambda self, *args, **kwargs: None
        done.append("IntermediatesCache.pin_memory made a no-op (pinning needs a GPU; it only speeds up copies to one)")
    return done


# What llm-compressor logs that changes how its figures read: a smoothing map it does not have
# for the architecture (its AWQ and SmoothQuant then fall back to Llama's names, which match
# nothing in, e.g., BERT, and the run is plain quantization).
NOTEWORTHY = ("not found in mappings", "No mappings", "skipping", "fallback", "fall back")


def capture_log() -> list[str]:
    """llm-compressor's log lines worth reporting beside its figures (it logs through loguru)."""
    said: list[str] = []
    try:
        from loguru import logger
    except ImportError:
        return said

    def sink(message) -> None:
        text = message.record["message"].split(". Using default mappings")[0].strip()
        if any(k.lower() in text.lower() for k in NOTEWORTHY) and text not in said:
            said.append(text[:300])

    logger.add(sink, level="INFO")
    return said


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    import torch
    import transformers
    from datasets import Dataset

    import llmcompressor
    from llmcompressor import oneshot

    patches = cpu_only_patches() if not torch.cuda.is_available() else []
    torch.manual_seed(spec.get("seed", 0))
    torch.set_num_threads(spec.get("threads", torch.get_num_threads()))
    said = capture_log()
    modifiers = [modifier_class(m["class"])(**m["args"]) for m in spec["modifiers"]]
    rss_before_load = rss_mib("VmRSS")

    auto = transformers.AutoModelForCausalLM if spec["causal"] else transformers.AutoModel
    model = auto.from_pretrained(spec["model"], dtype=spec.get("dtype", "auto"))
    tokenizer = transformers.AutoTokenizer.from_pretrained(spec["model"])
    t0 = time.perf_counter()
    if spec["calibration"] is None:  # data-free (round-to-nearest weights)
        oneshot(model=model, recipe=modifiers)
    else:
        ids = spec["calibration"]["input_ids"]
        dataset = Dataset.from_dict({"input_ids": ids, "attention_mask": spec["calibration"]["attention_mask"]})
        oneshot(model=model, dataset=dataset, recipe=modifiers, num_calibration_samples=len(ids),
                max_seq_length=max(len(x) for x in ids), shuffle_calibration_samples=False, batch_size=1)
    wall = time.perf_counter() - t0
    peak = rss_mib("VmHWM")

    out = Path(spec["output"])
    model.save_pretrained(out, save_compressed=True)
    tokenizer.save_pretrained(out)
    Path(spec_path).with_name("result.json").write_text(json.dumps({
        "wall_s": wall, "peak_rss_mib": peak, "rss_before_load_mib": rss_before_load,
        "versions": {"llmcompressor": llmcompressor.__version__, "torch": torch.__version__,
                     "transformers": transformers.__version__,
                     "compressed_tensors": importlib.import_module("compressed_tensors").__version__},
        "modifiers": [repr(m) for m in modifiers], "patches": patches, "said": said}, indent=1))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -I llmcompressor_runner.py spec.json")
    main(sys.argv[1])
