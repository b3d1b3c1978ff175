"""The stage registry: a recipe's stage name -> the class whose fields are that stage's keys.

A new algorithm is one new file in this package plus one line here.
"""

from compress.stages.autoround import AutoRound
from compress.stages.awq import AWQ
from compress.stages.distill import Distill
from compress.stages.gptq import GPTQ
from compress.stages.kv_cache import KVCache
from compress.stages.magnitude import Magnitude
from compress.stages.qat import QAT
from compress.stages.rtn import RoundToNearest
from compress.stages.smoothquant import SmoothQuant
from compress.stages.sparsegpt import SparseGPT
from compress.stages.wanda import Wanda
from compress.stages.structured import Structured

STAGES = {
    "rtn": RoundToNearest,
    "gptq": GPTQ,
    "awq": AWQ,
    "autoround": AutoRound,
    "smoothquant": SmoothQuant,
    "magnitude": Magnitude,
    "wanda": Wanda,
    "sparsegpt": SparseGPT,
    "structured": Structured,
    "distill": Distill,
    "qat": QAT,
    "kv_cache": KVCache,
}
