"""`CaptureModel`: a Hugging Face model wrapped so that one call returns `Trace`s.

Capture happens in hooks listed by the adapter table (attention modules' weights, output
projections' inputs); the forward pass runs with eager attention and ``output_attentions=True``
(some families only compute weights when asked). No method math lives here, and nothing about
methods or targets: the user-facing `attnflow.model.AttentionModel` (``trace(target=...)``,
``explain``) builds on this class and hands capture a `TargetFunction`.
"""

from __future__ import annotations

import math
import warnings
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Protocol, Sequence

import numpy as np
import torch
from torch import nn

from attnflow.capture import progress
from attnflow.capture.hooks import (
    MissingWeights,
    StopForward,
    find_layers,
    float_weights,
    record_stack,
    record_tensors,
    stack_recorded,
)
from attnflow.capture.images import ImagePreprocessing, crop_note, read_image, small_image_note, to_rgb
from attnflow.capture.texts import check_texts, truncation_notes, unknown_notes
from attnflow.errors import CaptureError, InputError, ModelLoadError
from attnflow.rows.adapters import Adapter, Values, head_factor
from attnflow.rows.infer import row_for
from attnflow.trace import GRADIENT_NEEDS, NEEDS, TARGET_NEEDS, Trace, crop_field


@dataclass
class BatchCapture:
    """Tensors of one batched forward pass (no padding removed: the caller's windows are full).

    layer_attentions: one ``[batch, head, query, key]`` tensor per layer, as the model made them
    (no copy); head_outputs: ``[batch, layer, token, head, d_head]`` or None.
    """

    layer_attentions: list[torch.Tensor]
    head_outputs: torch.Tensor | None

    @property
    def attentions(self) -> torch.Tensor:
        """``[batch, layer, head, query, key]`` (a stacked copy: prefer `layer_attentions` in hot loops)."""
        return torch.stack(self.layer_attentions, dim=1)


class TargetFunction(Protocol):
    """The scalar y a target-dependent capture differentiates (`attnflow.targets.Objective` is one)."""

    def __call__(
        self, attention_mask: torch.Tensor, **inputs: Any
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Run the whole model on ``inputs``: ``(y [output], index [output] or None, probability [output] or None)``."""
        ...

    def describe(self, y: Any, index: int | None, probability: Any) -> Any:
        """What one output's target was (a `attnflow.targets.ResolvedTarget`), from its numbers."""
        ...


def resolve_device(device: str | torch.device | None = "auto") -> torch.device:
    """``auto`` picks CUDA when present, else the CPU."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("{device} cuda was asked for, but no CUDA device is available", parameter="device")
    return resolved


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # `loading.DTYPES`


def resolve_dtype(dtype: str | torch.dtype | None = "float32") -> torch.dtype:
    """A precision by name (``float32``, ``bfloat16``, ``float16``) or as a torch dtype; None is float32."""
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in DTYPES:
        return DTYPES[dtype.removeprefix("torch.")]
    raise ModelLoadError(f"{{dtype}} must be one of {', '.join(DTYPES)}, got {dtype!r}", parameter="dtype")


def dtype_name(dtype: torch.dtype) -> str:
    """``"bfloat16"`` for ``torch.bfloat16``: how `DTYPES` names it."""
    return str(dtype).removeprefix("torch.")


BFLOAT16_CPU_HINT = (
    "bfloat16 on this CPU: it has no bfloat16 arithmetic (AVX-512 BF16 or AMX), so torch emulates it and it can "
    "run slower than float32; it still halves the memory (docs/precision.md)"
)


def native_bfloat16() -> bool:
    """Whether this CPU computes in bfloat16 natively (AVX-512 BF16 or AMX tiles, as torch reports
    them); without either, torch converts every operation and bfloat16 can run slower than float32.
    True when torch cannot tell (no hint rather than a wrong one)."""
    queries = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    try:
        return any(query is None or bool(query()) for query in queries)
    except RuntimeError:  # pragma: no cover - a torch build without the query
        return True


def _notes_meta(notes: list[str]) -> dict[str, Any]:
    """A Trace's ``meta`` entries for what capture warned about (truncation, unknown tokens) and the
    notebook cell that said it (`attnflow.notebook.current_cell`): none when empty."""
    from attnflow.notebook import current_cell

    return {"notes": notes, "notes_cell": current_cell()} if notes else {}


class CaptureModel:
    """A model plus its tokenizer (or image processor) that produces `Trace`s (text, encoder-decoder
    and image capture; `attnflow.model.AttentionModel` adds targets and the ``explain`` front door).

    Attributes: ``name``, ``hf_model`` (the Hugging Face module; ``model`` is its deprecated name),
    ``adapter`` (its table row), ``n_layers``, ``n_heads``, ``d_head``, ``d_model``, ``max_length``
    (tokens, special tokens included), ``default_row``, ``device``, ``dtype`` (the precision of the
    weights and passes: float32 unless loaded with ``dtype=``; `Trace` arrays are float32 either
    way, and a trace of a 16-bit model says so in ``meta["dtype"]``).
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any = None,
        *,
        name: str | None = None,
        adapter: Adapter | None = None,
        device: str | torch.device | None = "auto",
        image_processor: ImagePreprocessing | None = None,
        dtype: str | torch.dtype | None = "float32",
    ) -> None:
        config = model.config
        self.adapter = adapter or row_for(model)
        if getattr(config, "_attn_implementation", "eager") != "eager":
            if not hasattr(model, "set_attn_implementation"):
                raise CaptureError(f"{type(model).__name__} cannot switch to eager attention")
            model.set_attn_implementation("eager")
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype)
        if self.dtype == torch.bfloat16 and self.device.type == "cpu" and not native_bfloat16():
            progress.say(BFLOAT16_CPU_HINT)
        self.hf_model = model.to(device=self.device, dtype=self.dtype).eval()
        self.tokenizer = tokenizer
        if image_processor is None and self.adapter.kind == "vision":
            image_processor = ImagePreprocessing.from_folder(getattr(config, "_name_or_path", "") or ".", config)
        self.image_processor = image_processor
        self.name: str = name or getattr(config, "_name_or_path", None) or type(model).__name__
        self.config = config
        stack = self.adapter.stack
        self.layer_names = [layer for layer, _ in find_layers(self.hf_model, stack.attention, gaps=stack.gaps)]
        if not self.layer_names:
            raise CaptureError(f"{type(model).__name__}: no attention layers match {stack.attention!r}")
        # The layers of the stack: a hybrid's blocks, some of which mix tokens without attention
        # (`Adapter.mixers`; its trace's attentions hold the attention layers, `layer_names`).
        sites = self.adapter.sites
        blocks = find_layers(self.hf_model, sites.block) if stack.gaps and sites is not None else self.layer_names
        self.n_layers = len(blocks)
        self.n_heads = self.adapter.heads(config)
        projection = find_layers(self.hf_model, stack.output_projection, gaps=stack.gaps)[0][1]
        in_by_out = self.adapter.in_by_out(projection)  # [head * d_head, d_model]
        self.d_head = in_by_out.shape[0] // self.n_heads
        self.d_model = in_by_out.shape[1]
        self.max_length = self._max_length()
        self._output_weights_cache: tuple[np.ndarray, np.ndarray] | None = None
        # The family's attention modules return weights only when the pass asks for them (MPNet):
        # learnt on the first head-fused capture (`capture_needs`).
        self._weights_only_when_asked = False
        self.probe: dict[str, Any] | None = None  # an embedded classifier's metadata (held-out accuracy, ...)
        # The saliency row that summarises the model's output: "mean" for mean-pooled encoders.
        self.default_row = self.adapter.default_row
        if tokenizer is not None:
            if tokenizer.pad_token is None:  # decoders (GPT-2, Llama) ship without one
                tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
            tokenizer.padding_side = "right"

    @property
    def model(self) -> nn.Module:
        """Deprecated: the Hugging Face module is ``hf_model`` (``model.model`` read as the model itself)."""
        warnings.warn("AttentionModel.model is deprecated: use .hf_model", DeprecationWarning, stacklevel=2)
        return self.hf_model

    @property
    def kind(self) -> str:
        return self.adapter.kind

    @property
    def fuses_heads(self) -> bool:
        """Whether a text trace can fuse the heads in the hooks (``fuse_heads="mean"``, the
        memory-lean capture): every text model but the encoder-decoders."""
        return self.kind in ("encoder", "decoder")

    def precision_meta(self) -> dict[str, str]:
        """A `Trace`'s ``meta`` entry for a model loaded in 16 bits (``{"dtype": "bfloat16"}``): the
        explanations of methods flagged as untrustworthy in low precision warn from it; none for float32."""
        return {} if self.dtype == torch.float32 else {"dtype": dtype_name(self.dtype)}

    @property
    def is_classifier(self) -> bool:
        """A text classifier: its output is ``logits [batch, class]``."""
        name = type(self.hf_model).__name__
        classifier = name.endswith("ForSequenceClassification") or name == "PooledClassifier"
        return self.adapter.target_kind == "class" and classifier

    @property
    def target_kind(self) -> str | None:
        """What this model's targets are: ``"next_token"`` (causal LMs), ``"class"`` (classifiers),
        ``"similarity"`` (sentence encoders without a head: the cosine to a target text) or None
        (no target: images, encoder-decoders)."""
        kind = self.adapter.target_kind
        return "similarity" if kind == "class" and not self.is_classifier else kind

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.name!r}, family={self.adapter.family}, layers={self.n_layers}, "
            f"heads={self.n_heads}, d_head={self.d_head}, device={self.device}"
            f"{'' if self.dtype == torch.float32 else ', dtype=' + dtype_name(self.dtype)})"
        )

    # -- capture -----------------------------------------------------------------------------

    def capture_batch(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, head_outputs: bool = True
    ) -> BatchCapture:
        """One forward pass over ``input_ids [batch, token]`` (encoders and decoders).

        Returns attentions ``[batch, layer, head, query, key]`` and head outputs ``[batch,
        layer, token, head, d_head]`` as float32 tensors on the model's device.
        """
        if self.kind not in ("encoder", "decoder"):
            raise CaptureError(f"capture_batch takes token ids; {self.name} is a {self.kind} model")
        input_ids = input_ids.to(self.device)
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(self.device)
        with torch.no_grad():
            recording = self._forward_until_last_layer(head_outputs, input_ids=input_ids, attention_mask=mask)
        return BatchCapture(
            layer_attentions=[float_weights(weights) for weights in recording.layer_weights()],
            head_outputs=recording.stacked_head_outputs(self.n_heads).float() if head_outputs else None,
        )

    def output_weights(self) -> torch.Tensor:
        """Each head's slice of every layer's output projection W_O: ``[layer, head, d_head, d_model]``;
        for LayerScale families (DINOv2) W_O diag(λ), what a head adds to the residual stream."""
        slices = []
        projections = find_layers(self.hf_model, self.adapter.stack.output_projection, gaps=self.adapter.stack.gaps)
        for (_, projection), scale in zip(projections, self._output_scales(), strict=True):
            in_by_out = self.adapter.in_by_out(projection).detach()  # [head * d_head, d_model]
            slices.append(in_by_out.reshape(self.n_heads, self.d_head, self.d_model) * scale)
        return torch.stack(slices).float()

    def _output_scales(self) -> list[torch.Tensor]:
        """Per attention layer, the LayerScale ``λ [d_model]`` applied after the output projection
        (ones without; a hybrid stack's attention layers are `layer_names`, fewer than its blocks)."""
        values = self.adapter.values
        if values is None or values.output_scale is None:
            return [torch.ones(self.d_model, device=self.device)] * len(self.layer_names)
        scales = [module.lambda1.detach() for _, module in find_layers(self.hf_model, values.output_scale)]
        if len(scales) != self.n_layers:
            raise CaptureError(
                f"found {len(scales)} LayerScale modules for {self.n_layers} layers ({values.output_scale!r})"
            )
        return scales

    def capture_texts(
        self,
        texts: str | Sequence[str],
        *,
        needs: Iterable[str] | None = None,
        target_function: Callable[[], TargetFunction] | None = None,
        batch_size: int = 8,
        max_length: int | None = None,
        head_outputs: bool = True,
        targets: str | Sequence[str] | None = None,
        unresolved: Any = None,
        fuse_heads: str | None = None,
    ) -> list[Trace]:
        """Trace each text; returns one `Trace` per text with padding removed.

        The arguments are those of `attnflow.model.AttentionModel.trace` (which is this with a
        target given as a `attnflow.targets.Target`), with ``target_function`` in place of
        ``target``: it makes the `TargetFunction` (y) once the texts and needs are checked, and is
        required when ``needs`` include a target or gradients. ``unresolved`` (a target, opaque
        here): run no forward pass at all; the traces hold the tokens, no attentions (``[0, 0, n,
        n]``) and ``unresolved`` as their ``request``, for methods that re-run the model and resolve
        the target in their own passes. ``fuse_heads="mean"``: the memory-lean capture of head-fused
        methods (`capture_needs`): each trace's ``attentions`` are the heads' mean ``[layer, 1, n,
        n]`` and its ``meta["fused_heads"]`` says so.
        """
        if self.tokenizer is None:
            raise InputError(
                f"{self.name} is a vision model: it explains images, not text "
                "({image} on the command line, trace_image(path) in Python)",
                parameter="image",
            )
        texts = check_texts(texts)  # None, bytes, non-strings, empty or undecodable texts: InputError
        wanted = self._needs(needs, head_outputs)
        limit = self._check_max_length(max_length)
        if self.kind == "encoder-decoder":
            if fuse_heads is not None:
                raise CaptureError(f"{self.name} is an encoder-decoder model: its heads are not fused in the hooks")
            if wanted - {"attentions", "head_outputs", "output_weights"}:
                raise CaptureError(
                    f"{self.name} is an encoder-decoder model: only attentions and head outputs are captured"
                )
            goals = (
                [None] * len(texts) if targets is None else ([targets] if isinstance(targets, str) else list(targets))
            )
            if len(goals) != len(texts):
                raise InputError(f"{len(texts)} texts but {len(goals)} targets")
            return [
                self._trace_seq2seq(text, goal, limit, "head_outputs" in wanted)
                for text, goal in zip(texts, goals, strict=True)
            ]
        objective = None
        if unresolved is not None:
            wanted = frozenset({"attentions"})
        elif wanted & TARGET_NEEDS:
            if target_function is None:
                raise CaptureError(
                    f"needs {sorted(wanted & TARGET_NEEDS)} depend on a target: give a target_function, or trace "
                    "with the model attnflow.load returns (model.trace(texts, needs=..., target=...))"
                )
            objective = target_function()
        traces: list[Trace] = []
        for start in range(0, len(texts), max(1, batch_size)):
            batch = texts[start : start + batch_size]
            traces.extend(self._trace_batch(batch, limit, wanted, objective, unresolved, fuse_heads))
        return traces

    def _needs(self, needs: Iterable[str] | None, head_outputs: bool) -> frozenset[str]:
        if needs is None:
            return frozenset({"attentions", "head_outputs", "output_weights"} if head_outputs else {"attentions"})
        wanted = frozenset(needs) | {"attentions"}
        unknown = wanted - set(NEEDS) - {"model"}
        if unknown:
            raise ValueError(f"unknown needs {sorted(unknown)}; known: {', '.join(NEEDS)}")
        if "layer_norms" in wanted and not self._values_table().post_norm:
            raise CaptureError(
                f"the {self.adapter.family} family is pre-LN: it has no layer norm after the attention block"
            )
        if wanted & {"values", "layer_inputs"}:
            self._values_table()
        if "values" in wanted:
            self._value_projection()
        return wanted

    def _values_table(self) -> Values:
        """The adapter row's value-aware module names; a CaptureError for families without them."""
        if self.adapter.values is None:
            raise CaptureError(f"value vectors and layer inputs are not mapped for the {self.adapter.family} family")
        return self.adapter.values

    def _value_projection(self) -> str:
        """The regex of the modules whose output holds the values (`Adapter.projection`)."""
        where = self.adapter.projection("value")
        if where is None:
            raise CaptureError(f"value vectors are not mapped for the {self.adapter.family} family")
        return where[0]

    def _trace_batch(
        self,
        texts: list[str],
        limit: int,
        needs: frozenset[str],
        objective: TargetFunction | None,
        unresolved: Any = None,
        fuse_heads: str | None = None,
    ) -> list[Trace]:
        notes = truncation_notes(self.tokenizer, texts, limit)
        encoded = self.tokenizer(
            texts,
            padding=True,
            truncation=True,
            max_length=limit,
            return_offsets_mapping=True,
            return_special_tokens_mask=True,
            return_tensors="pt",
        )
        special = (encoded["special_tokens_mask"].bool() | ~encoded["attention_mask"].bool()).all(dim=1)  # [batch]
        if special.any():
            added = int(encoded["special_tokens_mask"][int(special.nonzero()[0, 0])].sum())
            raise InputError(
                f"{{max_length}} {limit} leaves no token of the text, only the {added} special token(s) the model "
                f"adds: give at least {added + 1}",
                parameter="max_length",
            )
        input_ids = encoded["input_ids"].to(self.device)
        mask = encoded["attention_mask"].to(self.device)
        if unresolved is not None:  # tokens only: no forward pass
            width = input_ids.shape[1]
            batch: dict[str, Any] = {"attentions": np.zeros((len(texts), 0, 0, width, width), np.float32)}
        else:  # name -> [batch, ...] numpy
            batch = self.capture_needs(
                needs, objective, fuse_heads=fuse_heads, input_ids=input_ids, attention_mask=mask
            )
        lengths = encoded["attention_mask"].sum(dim=1).tolist()
        unknown = unknown_notes(self.tokenizer, self.name, texts, encoded, lengths)
        for text_notes, unknown_note in zip(notes, unknown, strict=True):
            text_notes.extend(unknown_note)
        shared = self.shared_fields(needs)
        traces = []
        for index, (text, n) in enumerate(zip(texts, lengths, strict=True)):
            ids = encoded["input_ids"][index, :n]
            per_sample: dict[str, Any] = {  # one text: its arrays are the batch's, not copied again
                name: crop_field(name, array[index], n, copy=len(texts) > 1)
                for name, array in batch.items()
                if name != "target"
            }
            traces.append(
                Trace(
                    tokens=self.tokenizer.convert_ids_to_tokens(ids.tolist()),
                    token_ids=ids.numpy().astype(np.int64),
                    offsets=encoded["offset_mapping"][index, :n].numpy().astype(np.int64),
                    special_mask=encoded["special_tokens_mask"][index, :n].numpy().astype(bool),
                    text=text,
                    model_name=self.name,
                    layer_names=list(self.layer_names),
                    meta={
                        "default_row": self.default_row,
                        **self.precision_meta(),
                        **({"sinks": True} if self.adapter.stack.sinks else {}),  # rows sum to < 1
                        **({"fused_heads": fuse_heads} if fuse_heads and unresolved is None else {}),
                        **_notes_meta(notes[index]),
                    },
                    target=batch["target"][index] if "target" in batch else None,
                    request=unresolved,
                    **per_sample,
                    **shared,
                )
            )
        return traces

    def shared_fields(self, needs: frozenset[str]) -> dict[str, Any]:
        """Trace fields that come from the weights, shared by every Trace of this model."""
        shared: dict[str, Any] = {}
        if "output_weights" in needs:
            shared["output_weights"], shared["output_bias"] = self._output_weights_numpy()
            shared["output_norms"] = self._output_norms()
        if "layer_norms" in needs:
            shared["layer_norms"] = self._layer_norms()
        return shared

    def capture_needs(
        self,
        needs: frozenset[str],
        objective: TargetFunction | None,
        separate_outputs: bool = False,
        fuse_heads: str | None = None,
        **inputs: torch.Tensor,
    ) -> dict[str, Any]:
        """One forward pass (and one backward pass when gradients are needed) over a padded batch
        of ``inputs`` (``input_ids`` and ``attention_mask``, or ``pixel_values`` without a target);
        returns ``{trace field: [batch, ...] numpy array}`` plus ``"target"``: one `ResolvedTarget` per sample.

        ``separate_outputs``: the objective gives several y for one sample (``[output]``), each
        with its own backward pass (batched over the outputs); then the gradient fields
        (`attnflow.trace.GRADIENT_NEEDS`) and ``"target"`` are per output, ``[output, ...]``, the rest ``[1, ...]``.

        ``fuse_heads="mean"``: the memory-lean capture of what head-fused methods read (rollout,
        raw, flow with ``head_fusion="mean"``): each layer's weights are reduced to the heads' mean
        inside its hook (``attentions [batch, layer, 1, query, key]``), so that no layer's
        ``[head, query, key]`` outlives the layer; gradients cannot be taken through it."""
        if fuse_heads is not None and needs & GRADIENT_NEEDS:
            raise CaptureError(
                f"gradients ({sorted(needs & GRADIENT_NEEDS)}) need every head: capture without fuse_heads"
            )
        try:
            return self._capture_needs(needs, objective, separate_outputs, fuse_heads, inputs)
        except MissingWeights:
            if fuse_heads is None or self._weights_only_when_asked:
                raise
            self._weights_only_when_asked = True  # this family computes its weights only when asked
            return self._capture_needs(needs, objective, separate_outputs, fuse_heads, inputs)

    def _capture_needs(
        self,
        needs: frozenset[str],
        objective: TargetFunction | None,
        separate_outputs: bool,
        fuse_heads: str | None,
        inputs: dict[str, torch.Tensor],
    ) -> dict[str, Any]:
        """`capture_needs`: ``inputs`` as a dict (left unchanged)."""
        inputs = dict(inputs)
        gradients = needs & GRADIENT_NEEDS
        run_whole_model = objective is not None
        # With output_attentions, transformers keeps every layer's weights until the pass ends; a
        # head-fused capture asks for them only where the family computes them only when asked.
        ask = fuse_heads is None or self._weights_only_when_asked
        captured: dict[str, Any] = {}
        with ExitStack() as hooks:
            recording = hooks.enter_context(
                record_stack(
                    self.hf_model,
                    self.adapter.stack,
                    head_outputs="head_outputs" in needs or ("values" in needs and self._factored),
                    stop_after_last_layer=not run_whole_model,
                    fuse_heads=fuse_heads,
                )
            )
            value_layers = find_layers(self.hf_model, self._value_projection()) if "values" in needs else []
            values = hooks.enter_context(record_tensors(value_layers))
            block_layers = find_layers(self.hf_model, self._values_table().block) if "layer_inputs" in needs else []
            layer_inputs = hooks.enter_context(record_tensors(block_layers, inputs=True))
            embedding_module = self.hf_model.get_input_embeddings()
            embedding_layer = [("embeddings", embedding_module)] if "embedding_grads" in needs else []
            embeddings = hooks.enter_context(record_tensors(embedding_layer))
            with torch.set_grad_enabled(bool(gradients)):
                if objective is not None:
                    mask = inputs.pop("attention_mask")
                    y, index, probability = objective(mask, **inputs, output_attentions=ask)
                else:
                    try:
                        self.hf_model(**inputs, output_attentions=ask)
                    except StopForward:
                        pass
            weights = recording.layer_weights()  # per layer [batch, head, query, key], by layer name
            if gradients:
                embedding = embeddings["embeddings"] if embedding_layer else None
                captured.update(_gradient_fields(y, weights, embedding, gradients, separate_outputs))
        captured["attentions"] = _consume_weights(weights, recording.weights)  # [batch, layer, head, query, key]
        if "head_outputs" in needs:
            captured["head_outputs"] = _numpy(recording.stacked_head_outputs(self.n_heads))
        if value_layers:
            # per layer, before stacking: layers may have different key/value head counts (MiMo-V2's local layers)
            heads = {name: self._value_heads(tensor) for name, tensor in values.items()}  # [batch, token, head, d_head]
            shared = stack_recorded(heads, value_layers)  # [batch, layer, token, head, d_head]
            captured["values"] = _numpy(shared)
            if self._factored:
                captured["head_factors"] = _numpy(
                    self._head_factors(captured["attentions"], shared, recording.stacked_head_outputs(self.n_heads))
                )
        if block_layers:
            captured["layer_inputs"] = _numpy(
                stack_recorded(layer_inputs, block_layers)
            )  # [batch, layer, token, d_model]
        if objective is not None:
            y_numbers = y.detach().double().cpu().numpy()
            p_numbers = None if probability is None else probability.detach().double().cpu().numpy()
            captured["target"] = [
                objective.describe(
                    y_numbers[i], None if index is None else int(index[i]), None if p_numbers is None else p_numbers[i]
                )
                for i in range(len(y_numbers))
            ]
        return captured

    def _trace_seq2seq(self, text: str, target: str | None, limit: int, head_outputs: bool) -> Trace:
        notes = truncation_notes(self.tokenizer, [text], limit)[0]
        encoded = self.tokenizer(
            text,
            truncation=True,
            max_length=limit,
            return_offsets_mapping=True,
            return_special_tokens_mask=True,
            return_tensors="pt",
        )
        input_ids = encoded["input_ids"].to(self.device)
        start = torch.tensor([[self.config.decoder_start_token_id]], device=self.device)
        if target is not None:
            target_ids = self.tokenizer(text_target=target, return_tensors="pt")["input_ids"].to(self.device)
            decoder_ids = torch.cat([start, target_ids], dim=1)
        else:
            with torch.no_grad():
                decoder_ids = self.hf_model.generate(input_ids=input_ids, max_new_tokens=16, do_sample=False)
        adapter = self.adapter
        if adapter.decoder is None or adapter.cross is None:
            raise CaptureError(f"the {adapter.family} adapter names no decoder or cross-attention stack")
        with ExitStack() as hooks, torch.no_grad():
            encoder = hooks.enter_context(record_stack(self.hf_model, adapter.stack, head_outputs=head_outputs))
            decoder = hooks.enter_context(record_stack(self.hf_model, adapter.decoder, head_outputs=False))
            cross = hooks.enter_context(record_stack(self.hf_model, adapter.cross, head_outputs=False))
            self.hf_model(input_ids=input_ids, decoder_input_ids=decoder_ids, output_attentions=True)
        return Trace(
            tokens=self.tokenizer.convert_ids_to_tokens(encoded["input_ids"][0].tolist()),
            token_ids=encoded["input_ids"][0].numpy().astype(np.int64),
            offsets=encoded["offset_mapping"][0].numpy().astype(np.int64),
            special_mask=encoded["special_tokens_mask"][0].numpy().astype(bool),
            attentions=_first(float_weights(encoder.stacked_weights())),
            head_outputs=_first(encoder.stacked_head_outputs(self.n_heads)) if head_outputs else None,
            text=text,
            model_name=self.name,
            layer_names=list(encoder.layer_names),
            output_weights=self._output_weights_numpy()[0] if head_outputs else None,
            decoder_tokens=self.tokenizer.convert_ids_to_tokens(decoder_ids[0].tolist()),
            decoder_attentions=_first(float_weights(decoder.stacked_weights())),
            cross_attentions=_first(float_weights(cross.stacked_weights())),
            meta={"default_row": self.default_row, **self.precision_meta(), **_notes_meta(notes)},
        )

    def trace_image(self, image: Any, head_outputs: bool = True, needs: Iterable[str] | None = None) -> Trace:
        """Trace one image (a path or a PIL image); the Trace knows its patch ``grid``.

        The image is converted to RGB (with a warning when it was not) and preprocessed as the
        model folder states (`ImagePreprocessing`); ``meta["image_box"]`` is the region of the
        original image the patch grid covers, ``(left, top, right, bottom)`` in pixels.
        ``needs`` as in `capture_texts` (values, layer inputs and output weights for the value-aware
        methods); targets and gradients are not defined for images.
        """
        if self.kind != "vision":
            raise InputError(
                f"{self.name} is a text model ({self.kind}), not a vision model: explain images with a "
                "vision model such as dinov2-s"
            )
        wanted = self._needs(needs, head_outputs)
        if wanted & TARGET_NEEDS:
            unsupported = sorted(wanted & TARGET_NEEDS)
            raise CaptureError(f"{self.name}: targets and gradients are not defined for images (needs {unsupported})")
        source = str(image) if isinstance(image, (str, Path)) else ""
        picture, note = to_rgb(read_image(image) if source else image, source or "the image")
        assert self.image_processor is not None  # every vision model gets one in __init__
        pixels, box = self.image_processor(picture)
        patch = _as_pair(self.config.patch_size)
        grid = (pixels.shape[-2] // patch[0], pixels.shape[-1] // patch[1])
        where = source or "the image"
        notes = [
            text
            for text in (note, small_image_note(picture.size, grid, where), crop_note(picture.size, box, where))
            if text
        ]
        captured = self.capture_needs(wanted, None, pixel_values=pixels.to(self.device))  # name -> [1, ...] numpy
        n = captured["attentions"].shape[-1]
        prefix = self.adapter.n_prefix_tokens
        if n != prefix + grid[0] * grid[1]:
            raise CaptureError(f"{n} tokens do not match {prefix} prefix tokens + a {grid[0]}x{grid[1]} patch grid")
        tokens = ["[CLS]", "[DIST]"][:prefix] + [f"patch({r},{c})" for r in range(grid[0]) for c in range(grid[1])]
        return Trace(
            tokens=tokens,
            token_ids=np.full(n, -1, dtype=np.int64),
            offsets=np.zeros((n, 2), dtype=np.int64),
            special_mask=np.arange(n) < prefix,
            model_name=self.name,
            layer_names=list(self.layer_names),
            grid=grid,
            n_prefix_tokens=prefix,
            meta={
                "image": source,
                "image_box": box,
                "default_row": self.default_row,
                **self.precision_meta(),
                **_notes_meta(notes),
            },
            **{name: array[0] for name, array in captured.items()},
            **self.shared_fields(wanted),
        )

    # -- helpers -----------------------------------------------------------------------------

    def _forward_until_last_layer(self, head_outputs: bool, **inputs: torch.Tensor):
        """Run the model with the stack's hooks and stop once its last layer is recorded: the last
        output projection, feed-forward block, pooler and head compute nothing attnflow reads."""
        stack = self.adapter.stack
        with record_stack(self.hf_model, stack, head_outputs=head_outputs, stop_after_last_layer=True) as recording:
            try:
                self.hf_model(**inputs, output_attentions=True)
            except StopForward:
                pass
        return recording

    def _max_length(self) -> int:
        limit = math.inf
        model_max = getattr(self.tokenizer, "model_max_length", None)
        if model_max and model_max < 1_000_000:
            limit = model_max
        positions = getattr(self.config, "max_position_embeddings", None) or getattr(self.config, "n_positions", None)
        if positions:
            limit = min(limit, positions - self.adapter.position_offset)
        return int(limit) if limit != math.inf else 512

    def _check_max_length(self, max_length: int | None) -> int:
        if max_length is None:
            return self.max_length
        if int(max_length) != max_length or max_length < 2:
            raise InputError(f"{{max_length}} must be an integer >= 2, got {max_length}", parameter="max_length")
        if max_length > self.max_length:
            raise InputError(
                f"{{max_length}} {max_length} exceeds the model's maximum of {self.max_length} tokens",
                parameter="max_length",
            )
        return int(max_length)

    @property
    def _factored(self) -> bool:
        """Whether the row's heads are A·V times a per-position factor (`Values.head_factor`)."""
        return self.adapter.values is not None and self.adapter.values.head_factor

    def _value_heads(self, output: torch.Tensor) -> torch.Tensor:
        """``[batch, token, head, d_head]`` one layer's value vectors from its value module's output
        (its value columns; grouped-query attention: query head h reads value head h // (heads per
        value head))."""
        rows = self.adapter.value_rows(output)  # [batch, token, projection width]
        values = rows[..., self.adapter.part_columns("value", rows.shape[-1], self.config).to(rows.device)]
        batch, tokens, width = values.shape  # width: kv_head * d_head
        per_kv_head = values.reshape(batch, tokens, width // self.d_head, self.d_head)
        return per_kv_head.repeat_interleave(self.n_heads * self.d_head // width, dim=2)

    @staticmethod
    def _head_factors(attentions: np.ndarray, values: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
        """``[batch, layer, token, head, d_head]`` D per layer (`head_factor`): the output
        projection's input ``heads`` over A·V, from the weights ``[batch, layer, head, query, key]``
        and the values ``[batch, layer, token, head, d_head]``."""
        weights = torch.from_numpy(attentions).to(values)
        products = torch.einsum("blhqk,blkhd->blqhd", weights, values)
        heads = heads.to(values)
        return torch.stack([head_factor(heads[:, i], products[:, i]) for i in range(products.shape[1])], dim=1)

    def _output_weights_numpy(self) -> tuple[np.ndarray, np.ndarray]:
        """``output_weights`` ``[layer, head, d_head, d_model]`` and the projections' biases
        ``[layer, d_model]`` as numpy, computed once and shared by every Trace of this model."""
        if self._output_weights_cache is None:
            biases = []
            projections = find_layers(self.hf_model, self.adapter.stack.output_projection, gaps=self.adapter.stack.gaps)
            for (_, projection), scale in zip(projections, self._output_scales(), strict=True):
                bias = projection.bias
                biases.append(torch.zeros(self.d_model) if bias is None else (bias.detach() * scale).float().cpu())
            self._output_weights_cache = (self.output_weights().cpu().numpy(), torch.stack(biases).numpy())
        return self._output_weights_cache

    def _output_norms(self) -> dict[str, Any] | None:
        """Families with a norm between the output projection and the residual addition
        (`Values.output_norm`): its form (the row's `Norms`), gain and shift ``[layer, d_model]``
        (`Norms.gain_and_shift`) and eps; None for the others."""
        values, norms = self.adapter.values, self.adapter.norms
        if values is None or values.output_norm is None:
            return None
        if norms is None:
            raise CaptureError(f"the {self.adapter.family} row names an output norm but declares no norm form")
        modules = [module for _, module in find_layers(self.hf_model, values.output_norm)]
        gains, shifts = zip(*(norms.gain_and_shift(module, self.d_model) for module in modules), strict=True)
        eps = norms.epsilon(modules[0])
        return {
            "kind": norms.form,
            "gain": torch.stack(list(gains)).float().cpu().numpy(),
            "shift": torch.stack(list(shifts)).float().cpu().numpy(),
            "eps": 1e-6 if eps is None else eps,
        }

    def _layer_norms(self) -> dict[str, Any]:
        """Post-LN models: the layer norm after each attention block, ``weight``/``bias``
        ``[layer, d_model]`` and ``eps``."""
        norms = [module for _, module in find_layers(self.hf_model, self._values_table().norm or "")]
        return {
            "weight": torch.stack([norm.weight.detach() for norm in norms]).float().cpu().numpy(),
            "bias": torch.stack([norm.bias.detach() for norm in norms]).float().cpu().numpy(),
            "eps": float(norms[0].eps),
        }


def _gradient_fields(
    y: torch.Tensor,
    weights: list[torch.Tensor],
    embedding: torch.Tensor | None,
    gradients: frozenset[str],
    separate_outputs: bool,
) -> dict[str, Any]:
    """The ``gradients`` fields of one capture: ∂y/∂(attention weights) ``[batch, layer, head, query,
    key]`` and ∂y/∂(input embeddings) ``[batch, token, d_model]`` with the embeddings themselves;
    ``[output, ...]`` with one vector-Jacobian product per output when ``separate_outputs``."""
    sources = (weights if "attention_grads" in gradients else []) + ([] if embedding is None else [embedding])
    if separate_outputs and len(y) > 1:  # one vector-Jacobian product per output, batched (vmap)
        cotangents = torch.eye(len(y), dtype=y.dtype, device=y.device)
        grads = torch.autograd.grad(y, sources, grad_outputs=cotangents, is_grads_batched=True, allow_unused=True)
        grads = tuple(None if grad is None else grad[:, 0] for grad in grads)  # [output, ...]
    else:
        grads = torch.autograd.grad(y.sum(), sources, allow_unused=True)
    fields: dict[str, Any] = {}
    if "attention_grads" in gradients:
        fields["attention_grads"] = _numpy(_stack_grads(grads[: len(weights)], weights, len(y)))
    if "embedding_grads" in gradients and embedding is not None:
        fields["embedding_grads"] = _numpy(grads[-1])  # [batch, token, d_model]
        fields["embeddings"] = _numpy(embedding)
    return fields


def _consume_weights(weights: list[Any], recorded: dict[str, torch.Tensor]) -> np.ndarray:
    """``[batch, layer, head, query, key]`` float32 numpy of the per-layer ``weights``, filled one layer
    at a time, each layer's tensor let go (in ``weights`` and in the recording's ``recorded``) once
    copied: the layers are never held twice at once, as stacking them would."""
    first = weights[0]
    stacked = np.empty((first.shape[0], len(weights), *first.shape[1:]), dtype=np.float32)
    recorded.clear()
    for layer in range(len(weights)):
        if weights[layer].shape != first.shape:
            raise CaptureError(
                f"layer {layer}'s attention weights are {list(weights[layer].shape)}, layer 0's {list(first.shape)}: "
                "a layer that attends over keys beside the input's tokens (compressed or memory keys) has no place "
                "in a [layer, head, query, key] map"
            )
        stacked[:, layer] = _numpy(float_weights(weights[layer]))
        weights[layer] = None
    return stacked


def _numpy(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().float().cpu().numpy()


def _stack_grads(grads: Sequence[torch.Tensor | None], weights: Sequence[torch.Tensor], n_outputs: int) -> torch.Tensor:
    """``[output, layer, head, query, key]`` (an output per sample, or per y of one sample); a layer
    the target does not depend on gets zeros."""
    return torch.stack(
        [w.new_zeros((n_outputs, *w.shape[1:])) if g is None else g for g, w in zip(grads, weights, strict=True)],
        dim=1,
    )


def _first(batched: torch.Tensor) -> np.ndarray:
    return batched[0].float().cpu().numpy()


def _as_pair(value: Any) -> tuple[int, int]:
    return (int(value), int(value)) if isinstance(value, int) else (int(value[0]), int(value[1]))
