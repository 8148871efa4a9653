"""`AttentionModel`, what `attnflow.load` returns: a `CaptureModel` plus targets and the front door.

Capture (`attnflow.capture`) knows models and hooks, nothing about methods or targets; this module
sits above it and above the method registry: ``trace(target=...)`` turns a `attnflow.targets.Target`
into its `attnflow.targets.Objective`, and ``explain`` captures exactly what a method needs, runs it
and wraps the result in an `Explanation`. Torch is imported with this module (load it on first use).
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch

from attnflow.capture.loading import load_as
from attnflow.capture.model import CaptureModel
from attnflow.errors import InputError
from attnflow.methods.registry import AUTO, MethodSpec, check_family, get_method, method_names, method_options
from attnflow.targets import Target, legacy_target
from attnflow.trace import Trace


class AttentionModel(CaptureModel):
    """A model plus its tokenizer (or image processor) that produces `Trace`s for a target and
    explains texts with any registered method (``model.explain(text, method="alti")``).

    Attributes as `CaptureModel`: ``name``, ``adapter`` (its table row), ``n_layers``, ``n_heads``,
    ``d_head``, ``d_model``, ``max_length``, ``default_row``, ``device``, ``target_kind``.

    What a target-dependent method explains is one ``target=`` argument: a `attnflow.targets.Target`
    (``Target(" Paris", contrast=" Rome")``, ``Target(text="a kitten")``), or a class index or name or
    a token string or id for short, or None (the prediction). ``target_text=`` and ``contrast=`` are
    deprecated spellings of ``Target(text=...)`` and ``Target(contrast=...)``.
    """

    def trace(
        self,
        texts: str | Sequence[str],
        *,
        needs: Iterable[str] | None = None,
        target: Target | int | str | None = None,
        batch_size: int = 8,
        max_length: int | None = None,
        head_outputs: bool = True,
        targets: str | Sequence[str] | None = None,
        target_text: str | None = None,
        contrast: int | str | None = None,
        fuse_heads: str | None = None,
    ) -> list[Trace]:
        """Trace each text; returns one `Trace` per text with padding removed.

        Args:
            texts: one text or a list.
            needs: what to capture (names of `attnflow.trace.NEEDS`); default: attentions plus,
                with ``head_outputs``, head outputs and output weights. Without gradients and
                targets the forward pass stops after the last attention layer and runs without
                autograd; ``attention_grads``/``embedding_grads`` run the whole model and one
                backward pass from the target, ``target`` one forward pass of the whole model.
            target: what the target is (`attnflow.targets.Target`, or a class index or label name,
                a next token; see `attnflow.targets`).
            batch_size: texts per forward pass.
            max_length: truncate longer texts (default: the model's maximum), with a warning
                (a text that becomes mostly unknown tokens, [UNK], is warned about too).
            head_outputs: the default needs include head outputs (ignored when ``needs`` is given).
            targets: encoder-decoder models: decoder texts (teacher-forced); without them the
                decoder side is the model's own greedy continuation (at most 16 tokens).
            fuse_heads: ``"mean"``: the memory-lean capture for methods that read only the heads'
                mean (rollout, raw, flow with ``head_fusion="mean"``): each layer is reduced to
                ``[1, n, n]`` inside its hook, so that no layer's ``[head, n, n]`` weights outlive it
                (``attentions [layer, 1, n, n]``, ``meta["fused_heads"]``; no gradients).
        """
        wanted = legacy_target(target, target_text, contrast, "trace")
        return self.capture_texts(
            texts,
            needs=needs,
            target_function=lambda: wanted.objective(self),
            batch_size=batch_size,
            max_length=max_length,
            head_outputs=head_outputs,
            targets=targets,
            fuse_heads=fuse_heads,
        )

    def explain(
        self,
        texts: str | Sequence[str],
        method: str = "rollout",
        *,
        target: Target | int | str | None = None,
        row: Any = None,
        batch_size: int = 8,
        max_length: int | None = None,
        target_text: str | None = None,
        contrast: int | str | None = None,
        **options: Any,
    ) -> Any:
        """Capture what ``method`` needs, run it and wrap the result: the front door.

        Returns one `Explanation` for a text, a list for a list of texts. ``method``: a registered
        method, or ``"auto"`` (as `attnflow explain --method auto`): per text, the one-pass target
        method whose map is the most comprehensive on it, its ``chosen_by`` saying why (needs a
        target: a classifier, a causal LM, or a sentence encoder given ``Target(text=...)``).
        ``target`` chooses what a target-dependent method explains (a `attnflow.targets.Target`, or a
        class or token for short; default: the predicted class or the argmax next token), ``row`` the
        saliency row of matrix methods; ``options`` go to the method (``attnflow explain --help``
        lists them). A method that re-runs the model and explains a target (leave-one-out, the LRP
        rules, ...) is given the target to resolve in its own passes: no forward pass runs before it.
        A method that reads only the heads' mean of each layer (rollout, raw and flow with the
        default ``head_fusion="mean"``) gets the memory-lean capture (``trace(fuse_heads="mean")``):
        the same map, without every layer's ``[head, n, n]`` weights held at once.

            model = attnflow.load("minilm-sentiment")
            model.explain("The movie was terrible, but the acting was great.", method="alti").top(3)
            model.explain("The movie was terrible, but the acting was great.", method="auto").chosen_by
        """
        from attnflow.explanation import _AUTO, explain_traces

        single = isinstance(texts, str)
        wanted = legacy_target(target, target_text, contrast, "explain")
        method_names([method], also=(AUTO,))  # an unknown name fails naming what there is, auto included
        # bad options fail before any forward pass; auto plans its candidates (each gets its options)
        plan = _AUTO["plan"](self, [AUTO], options, wanted) if method == AUTO else None
        if plan is None:
            method_options(get_method(method), options)
        lean = plan is None and self.fuses_heads and reads_head_mean(get_method(method), options)
        traces = self.trace_for(
            [method] if plan is None else list(plan.per_method),
            texts,
            target=wanted,
            batch_size=batch_size,
            max_length=max_length,
            fuse_heads="mean" if lean else None,
        )
        if plan is not None:
            explanations = [_AUTO["explain"](self, trace, plan, row)[0] for trace in traces]
        else:
            row = self.default_row if row is None else row
            explanations = explain_traces(traces, method=method, row=row, model=self, **options)
        return explanations[0] if single else explanations

    def trace_for(
        self,
        methods: Sequence[str],
        texts: str | Sequence[str],
        *,
        target: Target | int | str | None = None,
        batch_size: int = 8,
        max_length: int | None = None,
        target_text: str | None = None,
        contrast: int | str | None = None,
        fuse_heads: str | None = None,
    ) -> list[Trace]:
        """Trace ``texts`` capturing what all of ``methods`` need (one pass for all of them), after
        checking that each method supports this model's family and that a target is only given
        to methods that use one. When every method re-runs the model and explains a target, no
        pass runs: the traces hold the tokens and the target to resolve (``Trace.request``).
        ``fuse_heads``: as in `trace` (for methods that read only the heads' mean)."""
        wanted = legacy_target(target, target_text, contrast, "trace_for")
        specs = self._supported(methods)
        if wanted.given and not any(spec.uses_target for spec in specs):
            names = ", ".join(spec.name for spec in specs)
            raise InputError(f"{names} does not depend on a target; drop {{target}}", parameter="target")
        if specs and self.kind in ("encoder", "decoder") and all(spec.takes == "model" for spec in specs):
            if all(spec.uses_target for spec in specs):
                return self.capture_texts(texts, batch_size=batch_size, max_length=max_length, unresolved=wanted)
        needs = frozenset().union(*(spec.needs for spec in specs))
        if self.is_classifier:
            needs |= {"target"}  # one whole forward pass more: every explanation shows the prediction
        return self.trace(
            texts, needs=needs, target=wanted, batch_size=batch_size, max_length=max_length, fuse_heads=fuse_heads
        )

    def _supported(self, methods: Sequence[str]) -> list[MethodSpec]:
        """The methods' registry entries, after checking that each supports this model's family."""
        specs = [get_method(name) for name in methods]
        for spec in specs:
            check_family(spec, self.adapter)
        return specs

    def trace_image_for(self, methods: Sequence[str], image: Any) -> Trace:
        """Trace ``image`` capturing what all of ``methods`` need (one pass), after checking that
        each method supports this model's family."""
        return self.trace_image(image, needs=frozenset().union(*(spec.needs for spec in self._supported(methods))))


def reads_head_mean(spec: MethodSpec, options: dict[str, Any]) -> bool:
    """Whether ``spec`` run with ``options`` reads nothing of the attention weights but each layer's
    mean over the heads: a method on the weights alone whose ``head_fusion`` is ``"mean"`` without
    per-head ``weights`` (rollout, raw, flow by default), so the head-fused capture gives its map."""
    if spec.takes != "attentions" or "head_fusion" not in spec.option_names:
        return False
    chosen = {**spec.defaults, **{name: value for name, value in options.items() if value is not None}}
    return (
        isinstance(chosen.get("head_fusion"), str) and chosen["head_fusion"] == "mean" and chosen.get("weights") is None
    )


def load(
    name: str = "minilm",
    device: str | torch.device | None = "auto",
    trust_remote_code: bool = False,
    progress: bool = True,
    dtype: str | torch.dtype = "float32",
) -> AttentionModel:
    """Load a model by alias (``minilm`` default, ``mpnet``, ``smollm2``, ``gemma3-270m``,
    ``qwen2.5-0.5b``, ...), local folder or hub id, as an `AttentionModel`: `attnflow.capture.load`
    (eager attention forced, unknown families refused before anything loads, weight caches for
    slow sources; ``progress=False`` hides the progress bar of slow first loads) with targets and
    ``explain`` on top. ``dtype``: ``float32`` (default), ``bfloat16`` or ``float16``, the precision
    of the weights and of every pass (docs/precision.md: how far each method's maps move; methods
    flagged as untrustworthy in 16 bits warn).
    """
    return load_as(
        AttentionModel, name, device=device, trust_remote_code=trust_remote_code, progress=progress, dtype=dtype
    )
