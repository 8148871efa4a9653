"""`ModelLike`: what the code above capture reads of a loaded model.

Methods that re-run the model, targets, faithfulness, patching, the corpus and audit engines take
"a model": in practice `attnflow.model.AttentionModel` (what `attnflow.load` returns), in tests
sometimes a small stand-in. This protocol names the attributes and calls they rely on, so they
are type-checked without importing capture (``attnflow.methods`` must not depend on it). It
imports nothing above `attnflow.trace`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Protocol, Sequence

if TYPE_CHECKING:
    import torch

    from attnflow.trace import Trace


class ModelLike(Protocol):
    """A loaded model that produces `Trace`s (`attnflow.model.AttentionModel` is one).

    ``hf_model`` is the Hugging Face module itself (its forward pass returns ``.logits`` or hidden
    states; ``model`` is its deprecated name); ``adapter`` the family's row of the adapter table
    (`attnflow.rows.Adapter`, not named here: capture sits below and this module must not import it).
    """

    @property
    def name(self) -> str:
        """The alias, folder or hub id it was loaded from."""
        ...

    @property
    def hf_model(self) -> torch.nn.Module:
        """The Hugging Face module (in ``dtype``, eval mode, eager attention)."""
        ...

    @property
    def model(self) -> torch.nn.Module:
        """Deprecated: ``hf_model``."""
        ...

    @property
    def tokenizer(self) -> Any:
        """Its tokenizer (None for vision models)."""
        ...

    @property
    def adapter(self) -> Any:
        """Its family's row of the adapter table (`attnflow.rows.Adapter`)."""
        ...

    @property
    def config(self) -> Any:
        """The Hugging Face config."""
        ...

    @property
    def device(self) -> torch.device:
        """Where it runs."""
        ...

    @property
    def dtype(self) -> torch.dtype:
        """The precision of its weights and passes (float32 unless loaded with ``dtype=``)."""
        ...

    def precision_meta(self) -> dict[str, str]:
        """What a `Trace` of this model records of its precision in ``meta``: ``{"dtype": name}``
        for a 16-bit model, nothing for float32."""
        ...

    @property
    def kind(self) -> str:
        """``"encoder"``, ``"decoder"``, ``"encoder-decoder"`` or ``"vision"`` (for messages: code
        outside capture asks what a model provides, not which kind it is)."""
        ...

    @property
    def fuses_heads(self) -> bool:
        """Whether a text trace can fuse the heads in the hooks (the memory-lean capture)."""
        ...

    @property
    def target_kind(self) -> str | None:
        """``"next_token"``, ``"class"``, ``"similarity"`` or None (no target)."""
        ...

    @property
    def is_classifier(self) -> bool:
        """A text classifier: its output is ``logits [batch, class]``."""
        ...

    @property
    def n_layers(self) -> int:
        """Attention layers."""
        ...

    @property
    def n_heads(self) -> int:
        """Attention heads per layer."""
        ...

    @property
    def d_head(self) -> int:
        """Width of one head."""
        ...

    @property
    def d_model(self) -> int:
        """Width of the residual stream."""
        ...

    @property
    def max_length(self) -> int:
        """Most tokens per text, special tokens included."""
        ...

    @property
    def default_row(self) -> str:
        """The saliency row that summarises the model's output (``"mean"``, ``"cls"``, ``"last"``)."""
        ...

    @property
    def layer_names(self) -> list[str]:
        """The attention modules' names, one per layer."""
        ...

    @property
    def probe(self) -> dict[str, Any] | None:
        """An embedded classifier's metadata (held-out accuracy, ...), else None."""
        ...

    def trace(
        self,
        texts: str | Sequence[str],
        *,
        needs: Iterable[str] | None = None,
        target: Any = None,
        batch_size: int = 8,
        max_length: int | None = None,
        head_outputs: bool = True,
        targets: str | Sequence[str] | None = None,
        target_text: str | None = None,
        contrast: int | str | None = None,
    ) -> list[Trace]:
        """One `Trace` per text with what ``needs`` names (see `attnflow.model.AttentionModel.trace`;
        ``target``: an `attnflow.targets.Target`, or a class or token for short; ``target_text`` and
        ``contrast``: its deprecated loose spellings)."""
        ...

    def trace_for(
        self,
        methods: Sequence[str],
        texts: str | Sequence[str],
        *,
        target: Any = None,
        batch_size: int = 8,
        max_length: int | None = None,
        target_text: str | None = None,
        contrast: int | str | None = None,
        fuse_heads: str | None = None,
    ) -> list[Trace]:
        """Traces with what all of ``methods`` need, in one pass (none when every method re-runs the
        model: the traces then hold the tokens and the target to resolve); ``fuse_heads="mean"``:
        only each layer's head mean (the memory-lean capture of `attnflow.model.AttentionModel.trace`)."""
        ...

    def trace_image_for(self, methods: Sequence[str], image: Any) -> Trace:
        """The `Trace` of one image with what all of ``methods`` need."""
        ...

    def explain(
        self,
        texts: str | Sequence[str],
        method: str = "rollout",
        *,
        target: Any = None,
        row: Any = None,
        batch_size: int = 8,
        max_length: int | None = None,
        target_text: str | None = None,
        contrast: int | str | None = None,
        **options: Any,
    ) -> Any:
        """An `Explanation` for a text, a list for a list of texts (the front door)."""
        ...

    def capture_batch(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, head_outputs: bool = True
    ) -> Any:
        """One forward pass over ``input_ids [batch, token]``: attentions and head outputs."""
        ...

    def capture_needs(
        self, needs: frozenset[str], objective: Any, separate_outputs: bool = False, **inputs: torch.Tensor
    ) -> dict[str, Any]:
        """One forward (and backward) pass over a padded batch: ``{trace field: [batch, ...] array}``."""
        ...

    def shared_fields(self, needs: frozenset[str]) -> dict[str, Any]:
        """Trace fields that come from the weights (output weights, layer norms)."""
        ...


def model_dtype(model: Any) -> str:
    """The precision ``model`` runs in, by name (``"float32"``, ``"bfloat16"``, ``"float16"``):
    what a dataset command's checkpoint records; float32 for a stand-in that names none."""
    return str(getattr(model, "dtype", "float32")).removeprefix("torch.")
