"""The stage registry: a recipe's stage name -> the class whose fields are that stage's keys.

A new algorithm is one new file in this package plus one line here.
"""

from compress.stages.gptq import GPTQ
from compress.stages.rtn import RoundToNearest

STAGES = {
    "rtn": RoundToNearest,
    "gptq": GPTQ,
}
