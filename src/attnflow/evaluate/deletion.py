"""Perturbed inputs, rebuilt from token ids, as the faithfulness metrics build them: the functions of
`attnflow.methods.deletion` (they live below the methods that re-run the model, which perturb inputs
too; evaluate sits above the methods and imports them from there)."""

from attnflow.methods.deletion import REPLACE_MODES, only_top, perturb, without_top

__all__ = ["REPLACE_MODES", "only_top", "perturb", "without_top"]
