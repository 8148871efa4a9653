"""Causal information flow: which layers, positions and heads carry a prediction, by exact
activation patching through hooks on the Hugging Face model, and the approximations (AtP, AtP*,
RelP) reported beside the exact values they approximate; edge scores (EAP, EAP-IG) with circuit
faithfulness; attribution maps compared with the interventions; attention knockout (Geva et al.
2023) as one more site kind. Entry point: `attnflow.patch`."""

from attnflow.causal.api import METHODS, PatchResult, patch
from attnflow.causal.edges import EdgeScores, edge_scores
from attnflow.causal.sites import ALL_KINDS, SITE_KINDS, Site
from attnflow.causal.versus import LayerComparison, compare_with_patching

__all__ = [
    "ALL_KINDS",
    "METHODS",
    "SITE_KINDS",
    "EdgeScores",
    "LayerComparison",
    "PatchResult",
    "Site",
    "compare_with_patching",
    "edge_scores",
    "patch",
]
