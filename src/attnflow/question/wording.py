"""The reading of `attnflow.why`: one short paragraph per question, from the templates below filled
with the results, each sentence hedged by the evidence behind it. No language model writes any of it.

Every number a paragraph states comes from ``shown`` (name -> ``{"text": as displayed, "value":
the number it displays}``), which why.json holds, so each one can be found there as written."""

from __future__ import annotations

from typing import Any

import numpy as np

from attnflow.tokens import display_token

AGREE = 0.5  # Spearman ρ from which two rankings are read as agreeing "much the same way"
WORDS = 2  # words named per list in the reading

T = {
    "answer": "{model} {verb} {answer} (p = {p}).",
    "other_answer": "{model}'s own answer is {prediction} (p = {p_prediction}); the question is about {answer} "
    "(p = {p}).",
    "contrast": " Asked why {answer} rather than {contrast}: its score (logit) is higher by {difference}.",
    "words": "The attribution ({method}, chosen as the most faithful on this input) says the words that weigh "
    "most for {answer} are {top_words}.",
    "words_untested": "The attribution ({method}, auto's first candidate: no candidate could be tested on this "
    "input) says the words that weigh most for {answer} are {top_words}.",
    "unmeasured": " Its faithfulness could not be measured on this input, so it is unchecked.",
    "clear": " Deleting its top words first hurts the answer more than deleting words at random "
    "({comprehensiveness} against {comprehensiveness_random})",
    "marginal": " But deleting its top words first hurts the answer only a little more than random deletions "
    "({comprehensiveness} against {comprehensiveness_random}), so this is a weak hint",
    "weak": " But deleting its top words first hurts the answer no more than random deletions "
    "({comprehensiveness} against {comprehensiveness_random}): on this input the ranking is no better than chance",
    "indistinct": " But on an input this short deleting almost any word hurts the answer about as much "
    "({comprehensiveness} against {comprehensiveness_random} for random deletions), so deletion can neither "
    "confirm nor refute this ranking here",
    "loo": "; leave-one-out, which deletes one word at a time, scores {comprehensiveness_loo}.",
    "agree": "{who} ranks the words much the same way ({rho_and_shared}).",
    "partly": "{who} ranks the words only partly the same way ({rho_and_shared}).",
    "disagree": "{who} disagrees about which words matter ({rho_and_shared}).",
    "unranked": "{who} cannot be ranked against it: one of them scores every word the same ({shared}).",
    "lens": "Reading the stream at {at} layer by layer (the logit lens), {answer} is the top token {lens_where}.",
    "handover": " {lead} that the answer has reached {at} {patching_where}: restoring that stream alone restores "
    "at least half of it.",
    "no_handover": " {lead} that no stream at {at} before the last layer restores half of the answer on its own.",
    "move": " The route's strongest move of information into {at} is at layer {route_layer}, from {route_source}, "
    "mostly through head {head}.",
    "knockout": " Blocking that attention edge there costs {knockout_percent} % of what the counterfactual costs.",
    "knockout_gain": " Blocking that attention edge there costs nothing: the answer even gains "
    "{knockout_gain_percent} % of what the counterfactual costs.",
    "same": " These {count} readings name the same layer.",
    "apart": " They do not name the same layer ({said}): up to {layer_spread} layers apart, so the answer forms "
    "over several layers, or one reading is off.",
    "few": " Too few of them name a layer to compare.",
    "sides": "Words for {answer}: {for_words}; words against it: {against_words}.",
    "unsigned": "This attribution is not signed: it ranks the words, it does not say which pull against {answer}.",
    "rollout": " Value-aware rollout, which follows attention weighed by what each word carries, puts most weight "
    "on {rollout_words}.",
}
_READINGS = {"lens": "the lens", "patching": "patching", "route": "the route"}
_OTHERS = {
    "routes": "The route through the network (how much each word's own stream feeds the answer)",
    "value-aware rollout": "Value-aware rollout (attention weighed by what each word carries)",
}


class _Shown:
    """The numbers and names a reading states, each stored as it is displayed."""

    def __init__(self) -> None:
        self.entries: dict[str, dict[str, Any]] = {}

    def __call__(self, name: str, text: str, value: Any = None) -> str:
        """Store ``text`` (and the ``value`` it displays) as ``name``; return the text."""
        self.entries[name] = {"text": text, "value": value}
        return text

    def number(self, name: str, value: float, digits: int = 2) -> str:
        """``value`` shown with ``digits`` decimals."""
        return self(name, f"{value:.{digits}f}", float(value))

    def compared(self, first: tuple[str, float], second: tuple[str, float], digits: int = 2) -> None:
        """Two ``(name, value)`` shown side by side ("0.571 against 0.575"): with one more decimal
        when ``digits`` would show different values as the same text."""
        (a_name, a), (b_name, b) = first, second
        if a != b and f"{a:.{digits}f}" == f"{b:.{digits}f}":
            digits += 1
        self.number(a_name, a, digits)
        self.number(b_name, b, digits)

    def integer(self, name: str, value: int) -> str:
        """``value`` shown as a whole number."""
        return self(name, str(int(value)), int(value))

    def fill(self, template: str, **more: str) -> str:
        """``T[template]`` with every shown text and ``more`` (texts built from shown ones)."""
        return T[template].format(**{name: entry["text"] for name, entry in self.entries.items()}, **more)


def quoted(token: str) -> str:
    """A token as the reading quotes it: ``'France'`` (no leading space marker)."""
    return f"'{display_token(token).strip() or display_token(token)}'"


def reading(found: Any) -> tuple[dict[str, dict[str, Any]], list[dict[str, str]]]:
    """``(shown, paragraphs)`` of a finished `attnflow.question.result.Why`."""
    shown = _Shown()
    shown("model", found.model)
    paragraphs = [{"question": "What does the model answer?", "text": _answer(found, shown)}]
    if found.attribution:
        paragraphs.append({"question": "Which words matter?", "text": _words(found, shown)})
    if found.routes is not None:
        paragraphs.append({"question": "Where, in which layer, does the answer form?", "text": _layers(found, shown)})
    elif found.attribution:
        question = "Which words push the decision, and which pull against it?"
        paragraphs.append({"question": question, "text": _sides(found, shown)})
    return shown.entries, paragraphs


def answer_of(found: Any) -> dict[str, Any]:
    """What the attribution explained (`attnflow.Explanation.target`): class or next token, its
    probability, its contrast."""
    return found.attribution[0].target if found.attribution else {}


def _named(label: Any, kind: str | None) -> str:
    return quoted(label) if kind == "next_token" else f"'{label}'"


def _answer(found: Any, shown: _Shown) -> str:
    target = answer_of(found)
    kind = target.get("kind")
    shown("answer", _named(target["label"], kind))
    shown.number("p", target["probability"])
    prediction = found.attribution[0].prediction or {}
    if prediction.get("index") is not None and prediction.get("index") != target.get("index"):
        shown("prediction", _named(prediction["label"], prediction.get("kind")))
        shown.number("p_prediction", prediction["probability"])
        text = shown.fill("other_answer")
    else:
        text = shown.fill("answer", verb="answers" if kind == "next_token" else "says")
    if target.get("contrast_label") is not None:
        shown("contrast", _named(target["contrast_label"], kind))
        shown.number("difference", target["value"])
        text += shown.fill("contrast")
    return text


def _top_words(scores: np.ndarray, keep: np.ndarray, count: int = WORDS) -> list[int]:
    return [int(i) for i in np.argsort(-np.asarray(scores), kind="stable") if keep[i]][:count]


def whole_words(found: Any) -> list[str]:
    """Each token of ``found`` as the reading quotes it: the whole word of the text it belongs to
    ('Eiffel' for the piece 'iffel'), grouped as `attnflow.methods.summary.words` groups them (the
    attribution's offsets into the text); a special token, or any token without offsets, as itself."""
    from attnflow.methods.summary import words

    labels = list(found.tokens)
    explanation = found.attribution[0] if found.attribution else None
    if explanation is None or explanation.offsets is None or len(explanation.tokens) != len(labels):
        return labels
    for word, indices in words(found.tokens, explanation.special_mask, found.text, explanation.offsets):
        for i in indices:
            labels[i] = word
    return labels


def _listed(tokens: list[str], indices: list[int]) -> str:
    words = list(dict.fromkeys(quoted(tokens[i]) for i in indices))  # two pieces of one word: named once
    return " and ".join(words) if len(words) <= 2 else ", ".join(words[:-1]) + " and " + words[-1]


def _keep(found: Any) -> np.ndarray:
    mask = found.attribution[0].special_mask if found.attribution else None
    return np.ones(len(found.tokens), dtype=bool) if mask is None else ~np.asarray(mask)


def _words(found: Any, shown: _Shown) -> str:
    from attnflow.explanation import faithfulness_level

    explanation = found.attribution[0]
    shown("method", explanation.method)
    shown("top_words", _listed(whole_words(found), _top_words(explanation.scores, _keep(found))))
    faithful = explanation.faithfulness
    text = shown.fill("words" if faithful is not None else "words_untested")
    if faithful is None:
        text += shown.fill("unmeasured")
    else:
        ours, random = faithful["aopc_comprehensiveness"], faithful["random"]["aopc_comprehensiveness"]
        shown.compared(("comprehensiveness", ours), ("comprehensiveness_random", random))
        text += shown.fill(faithfulness_level(faithful))
        loo = found.attribution[-1].faithfulness if len(found.attribution) > 1 else None
        if loo is not None:
            shown.number("comprehensiveness_loo", loo["aopc_comprehensiveness"])
            text += shown.fill("loo")
        else:
            text += "."
    for pair in found.agreement["tokens"]:
        if pair["first"] == "attribution" and pair["second"] in (*_OTHERS, "patching"):
            text += " " + _pair_sentence(found, pair, shown)
    return text


def _pair_sentence(found: Any, pair: dict[str, Any], shown: _Shown) -> str:
    """How another kind of evidence ranks the words against the attribution: agree, partly, disagree."""
    name = pair["second"].replace(" ", "_").replace("-", "_")
    who = _OTHERS.get(pair["second"], "")
    if pair["second"] == "patching":
        estimate = ", an estimate by AtP" if next(iter(found.patching.effects)) != "exact" else ""
        how = f"noise on {shown('noise', repr(found.noise))}" if found.noise else "the counterfactual text"
        who = f"Patching ({how}{estimate})"
    rho, overlap, k = pair["spearman"], pair["top_k_overlap"], pair["k"]
    shared = f"{shown.integer(f'{name}_shared', round(overlap * k))} of the top {shown.integer('k', k)} words in common"
    if pair["second"] == "patching" and found.noise:
        shared += "; patching only sees the noised word and the words after it, so most words tie at zero"
    if rho is None:
        return shown.fill("unranked", who=who, shared=shared)
    both = f"rank correlation {shown.number(f'{name}_spearman', rho)}; {shared}"
    verdict = "agree" if rho >= AGREE else "partly" if rho > 0 else "disagree"
    return shown.fill(verdict, who=who, rho_and_shared=both)


def _where(layer: int | None, last: int, name: str, shown: _Shown) -> str:
    if layer is None:
        return "at no layer"
    if layer < 0:
        return "from the embeddings on"
    number = shown.integer(name, layer)
    return f"only after the last layer ({number})" if layer == last else f"from layer {number} on"


def _layers(found: Any, shown: _Shown) -> str:
    """Where the answer forms: the lens, patching's handover, the route's move and its knockout."""
    routes, layers = found.routes, found.agreement["layers"]["layers"]
    last = routes.n_layers - 1
    shown("at", quoted(whole_words(found)[routes.position]))
    text = shown.fill("lens", lens_where=_where(layers.get("lens"), last, "lens_layer", shown))
    if "patching" in layers:
        estimate = next(iter(found.patching.effects)) != "exact"
        lead = "AtP estimates (an estimate, not exact patching)" if estimate else "Patching shows"
        if layers["patching"] is None:
            text += shown.fill("no_handover", lead=lead)
        else:
            where = _where(layers["patching"], last, "patching_layer", shown)
            text += shown.fill("handover", lead=lead, patching_where=where)
    edge = found.strongest_move()
    if edge is not None:
        shown("head", f"L{edge.layer}.H{int(np.argmax(np.asarray(edge.heads or [0.0])))}")
        shown.integer("route_layer", edge.layer)
        shown("route_source", quoted(whole_words(found)[edge.source[2]]))
        text += shown.fill("move")
        effect = found.knockout_effect()
        if effect is not None and round(100 * effect) >= 0:
            shown.number("knockout_percent", 100 * effect, 0)
            text += shown.fill("knockout")
        elif effect is not None:
            shown.number("knockout_gain_percent", -100 * effect, 0)
            text += shown.fill("knockout_gain")
    return text + _layer_verdict(found.agreement["layers"], shown)


def _layer_verdict(agreement: dict[str, Any], shown: _Shown) -> str:
    named = {name: layer for name, layer in agreement["layers"].items() if layer is not None}
    if agreement["same"] is None:
        return shown.fill("few")
    if agreement["same"]:
        return shown.fill("same", count=shown.integer("layer_count", len(named)))
    shown.integer("layer_spread", agreement["spread"])
    groups: dict[int, list[str]] = {}
    for name, layer in named.items():
        groups.setdefault(layer, []).append(_READINGS[name])
    said = "; ".join(
        f"{' and '.join(names)} {'say' if len(names) > 1 else 'says'} "
        f"{'the embeddings' if layer < 0 else f'layer {layer}'}"
        for layer, names in groups.items()
    )
    return shown.fill("apart", said=said)


def _sides(found: Any, shown: _Shown) -> str:
    """A classifier's evidence for and against its class, and value-aware rollout's words."""
    explanation = found.attribution[0]
    if explanation.signed:
        support = [i for i, _token, score in explanation.top(WORDS) if score > 0]
        against = [i for i, _token, _score in explanation.against(WORDS)]
        shown("for_words", _listed(whole_words(found), support) or "none")
        shown("against_words", _listed(whole_words(found), against) or "none")
        text = shown.fill("sides")
    else:
        text = shown.fill("unsigned")
    if found.value_rollout is not None:
        shown("rollout_words", _listed(whole_words(found), _top_words(found.value_rollout, _keep(found))))
        text += shown.fill("rollout")
    return text
