"""Causal information flow: which layers, positions and heads carry a prediction, by exact
activation patching through hooks on the Hugging Face model, and the approximations (AtP, AtP*,
RelP) reported beside the exact values they approximate. Entry point: `attnflow.patch`."""

from attnflow.causal.api import METHODS, PatchResult, patch
from attnflow.causal.sites import SITE_KINDS, Site

__all__ = ["METHODS", "SITE_KINDS", "PatchResult", "Site", "patch"]
