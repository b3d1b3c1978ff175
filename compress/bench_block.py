"""What a block of a 7B model costs: each calibrating stage on two random-init blocks at Llama-2-7B's
layer shapes (hidden 4096, MLP 11008, 32 heads) in bfloat16, calibrated on 128 windows of 512
tokens, with the stage's wall time per block and its peak GPU memory. A solve's cost depends on the
shapes, not the weights' values, so random weights time it faithfully (the losses are not those
of a trained model). A whole model's time is about its block count times this, plus loading and
saving. Meant for a GPU; `--small` runs the same at toy shapes to check it anywhere.

    python -m compress.bench_block --shared ../shared --device cuda
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

# Each row is one recipe stage; RTN first, the round-to-nearest time the others add to.
ROWS = [("rtn W4 g128", "rtn: {scheme: W4A16}"), ("gptq W4 g128", "gptq: {scheme: W4A16}"),
        ("gptq MXFP6", "gptq: {scheme: MXFP6A16}"), ("gptq FP8_BLOCK", "gptq: {scheme: FP8_BLOCK}"),
        ("sparsegpt 2:4", "sparsegpt: {pattern: '2:4'}"), ("gptq NVFP4", "gptq: {scheme: NVFP4A16}")]
BLOCKS = 2
SHAPES = {"7b": dict(hidden_size=4096, intermediate_size=11008, num_attention_heads=32, num_key_value_heads=32),
          "small": dict(hidden_size=256, intermediate_size=768, num_attention_heads=4, num_key_value_heads=4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shared", default="../shared", help="holds models/ref-llama (its tokenizer) and the data")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="toy shapes, to check the script on a CPU")
    args = parser.parse_args()
    shared = Path(args.shared)
    ref = shared / "models" / "ref-llama"
    shape = SHAPES["small" if args.small else "7b"]
    work = Path(tempfile.mkdtemp(prefix="bench-block-"))  # the model and each row's output (GBs at 7B shapes)
    try:
        run_rows(shared, ref, shape, work, args.device)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run_rows(shared: Path, ref: Path, shape: dict, work: Path, device: str) -> None:
    from compress import parse_recipe, run_recipe
    from compress.bench import write_synthetic_llama

    write_synthetic_llama(ref, {**shape, "num_hidden_layers": BLOCKS}, work / "model", "bfloat16")
    calibration = f"{{dataset: {shared}/data/tinyshakespeare/train.txt, num_samples: 128, seq_len: 512}}"
    for label, stage in ROWS:
        recipe = parse_recipe(f"calibration: {calibration}\nstages:\n  - {stage}\n", "bench_block")
        report = run_recipe(recipe, model=str(work / "model"), output=str(work / label.replace(" ", "_")),
                            device=device, dtype="bfloat16")
        ran = report["stages"][-1]
        losses = [(r["gptq_loss"], r["rtn_loss"]) for r in report["layers"].values() if r.get("gptq_loss") is not None]
        ratio = sum(g for g, _ in losses) / sum(q for _, q in losses) if losses else None
        print(json.dumps({"row": label, "stage_wall_s": round(ran["wall_s"], 2), "per_block_s": round(ran["wall_s"] / BLOCKS, 2),
                          "peak_cuda_mib": ran.get("peak_cuda_mib"), "loss_gptq_over_rtn": ratio and round(ratio, 4),
                          "format": report["format"]["format"]}), flush=True)


if __name__ == "__main__":
    main()
