"""The speculation core: what to verify (proposal, lookup, trees), one round of it (`rounds`),
and the acceptance rules that keep the output exactly the target's (`sampling`).

Imports point down only: generate.py runs rounds; nothing here knows about front-ends.
"""

from .config import SpeculationConfig, check_block_size
from .rounds import Round, path_round, tree_budget, tree_round, tree_unavailable
from .sampling import SamplingParams

__all__ = ["Round", "SamplingParams", "SpeculationConfig", "check_block_size", "path_round",
           "tree_budget", "tree_round", "tree_unavailable"]
