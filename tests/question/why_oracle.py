"""An independent recomputation of `attnflow why`'s agreement from the JSON files that `attnflow
explain`, `attnflow routes` and `attnflow patch` write (scipy's Spearman, sets for the top-k overlap,
loops over routes.json and patch.json for the layers), and the numbers of a reading."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
from scipy.stats import spearmanr

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def separate_commands(text: str, model: str, why: dict, folder: Path, extra: list[str]) -> list[list[str]]:
    """The three commands whose JSON files hold the same evidence as ``why`` (its counterfactual,
    its knockout edge), with the target options ``extra``."""
    patching = why["evidence"]["patching"]
    corruption = (
        ["--corrupt", patching["corrupt_text"]]
        if patching["corrupt_text"] is not None
        else ["--noise", ",".join(patching["noise_words"]), "--samples", str(patching["samples"]), "--seed", "0"]
    )
    knockout = patching["knockout"]
    sites = ["--sites", "residual"]
    if knockout is not None:
        sites = ["--sites", "residual,knockout", "--knockout-target", str(knockout["target"])]
        sites += ["--knockout-sources", str(knockout["source"])]
    extra = [option for option in extra if option != "--corrupt" and option != patching["corrupt_text"]]
    target = ["--target-token" if option == "--target" else option for option in extra]
    return [
        ["explain", text, "--model", model, "--method", "auto,leave_one_out", "--out", str(folder / "e"), *target],
        ["routes", text, "--model", model, "--out", str(folder / "r"), *extra],
        ["patch", text, *corruption, "--model", model, "--method", "exact", *sites, "--out", str(folder / "p"), *extra],
    ]


def read_separate(folder: Path) -> dict:
    """explanation.json of auto's choice and of leave-one-out, routes.json, patch.json."""
    explanations = [json.loads(path.read_text()) for path in sorted((folder / "e").glob("*/explanation.json"))]
    auto = next(data for data in explanations if data["chosen_by"])
    loo = next(data for data in explanations if data["method"] == "leave_one_out")
    return {
        "auto": auto,
        "loo": loo,
        "routes": json.loads((folder / "r" / "routes.json").read_text()),
        "patch": json.loads((folder / "p" / "patch.json").read_text()),
    }


def recomputed(files: dict) -> dict:
    """The token agreement (pair -> (ρ or None, overlap, k)) and each reading's layer."""
    keep = ~np.asarray(files["auto"]["special_mask"], dtype=bool)
    residual = np.asarray(files["patch"]["effects"]["exact"]["residual"], dtype=float)
    scores = {
        "attribution": _magnitude(files["auto"]),
        "leave-one-out": _magnitude(files["loo"]),
        "routes": np.asarray(files["routes"]["importance_full"]["inputs"][0]),
        "patching": residual[:-1].max(axis=0),
    }
    k = min(3, int(keep.sum()))
    pairs = {}
    names = list(scores)
    for i, first in enumerate(names):
        for second in names[i + 1 :]:
            a, b = scores[first][keep], scores[second][keep]
            rho = None if np.ptp(a) == 0 or np.ptp(b) == 0 else float(spearmanr(a, b).statistic)
            top_a = set(np.argsort(-a, kind="stable")[:k].tolist())
            top_b = set(np.argsort(-b, kind="stable")[:k].tolist())
            pairs[(first, second)] = (rho, len(top_a & top_b) / k, k)
    return {"pairs": pairs, "layers": _layers(files["routes"], residual)}


def _magnitude(explanation: dict) -> np.ndarray:
    scores = np.asarray(explanation["scores"], dtype=float)
    return np.abs(scores) if explanation["signed"] else scores


def _layers(routes: dict, residual: np.ndarray) -> dict:
    position, n_layers = routes["position"], len(routes["graph"]["layers"])
    ranks = {
        entry["node"][1]: entry["target"]["rank"]
        for entry in routes["lens"]
        if entry["node"][0] == "in" and entry["node"][2] == position
    }
    lens = None
    for stream in range(n_layers, -1, -1):  # down from the top while the answer is the top token
        if ranks.get(stream) != 0:
            break
        lens = stream - 1
    handover = None
    for row in range(residual.shape[0] - 1):
        if residual[row, position] >= 0.5:
            handover = row - 1
            break
    moves = [
        edge
        for edge in routes["route"]["edges"]
        if edge["kind"] == "attention" and edge["target"][2] == position and edge["source"][2] != position
    ]
    route = max(moves, key=lambda edge: edge["importance"])["layer"] if moves else None
    return {"lens": lens, "patching": handover, "route": route}


def numbers_of(text: str) -> list[str]:
    return NUMBER.findall(text)


def check_reading(why):
    """Every number of every paragraph is one of why.json's shown texts' numbers, and every shown
    number is its value as displayed (the reading states nothing the results do not hold)."""
    allowed = {number for entry in why["shown"].values() for number in numbers_of(entry["text"])}
    for paragraph in why["paragraphs"]:
        for number in numbers_of(paragraph["text"]):
            assert number in allowed, (number, paragraph["text"])
    for name, entry in why["shown"].items():
        if isinstance(entry["value"], float):
            digits = len(entry["text"].partition(".")[2])
            assert entry["text"] == f"{entry['value']:.{digits}f}", name
        elif isinstance(entry["value"], int):
            assert entry["text"] == str(entry["value"]), name
    return allowed
