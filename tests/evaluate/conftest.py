"""A synthetic classifier whose prediction hinges on one known token ("great").

`KeyTokenClassifier` runs a tiny random BERT (so that it traces and randomises like a real
classifier) and feeds ``[mean-pooled hidden state, count of "great"]`` to a linear head whose
"great" weight dominates: with the word the model says positive, without it negative.
"""

from __future__ import annotations

import pytest

KEY_WORD = "great"
KEY_WEIGHT = 6.0


def _key_classifier(encoder, key_id: int):
    import torch
    from torch import nn
    from transformers.modeling_outputs import SequenceClassifierOutput

    class KeyTokenClassifier(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = encoder
            self.config = encoder.config
            self.config.id2label = {0: "negative", 1: "positive"}
            with torch.random.fork_rng():  # the same head whatever ran before in this process
                torch.manual_seed(0)
                self.head = nn.Linear(encoder.config.hidden_size + 1, 2)
            with torch.no_grad():
                self.head.weight.mul_(0.01)
                self.head.weight[:, -1] = torch.tensor([-KEY_WEIGHT / 2, KEY_WEIGHT / 2])
                self.head.bias.copy_(torch.tensor([KEY_WEIGHT / 4, -KEY_WEIGHT / 4]))

        def get_input_embeddings(self):
            return self.encoder.get_input_embeddings()

        def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None, **kwargs):
            outputs = self.encoder(
                input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds, **kwargs
            )
            hidden = outputs.last_hidden_state  # [batch, token, d_model]
            if attention_mask is None:
                attention_mask = torch.ones(hidden.shape[:2], dtype=torch.long)
            weights = attention_mask.to(hidden.dtype).unsqueeze(-1)  # [batch, token, 1]
            pooled = (hidden * weights).sum(1) / weights.sum(1)
            keys = ((input_ids == key_id) & attention_mask.bool()).sum(1, keepdim=True).to(hidden.dtype)  # [batch, 1]
            return SequenceClassifierOutput(
                logits=self.head(torch.cat([pooled, keys], dim=-1)), attentions=outputs.attentions
            )

    return KeyTokenClassifier()


@pytest.fixture(scope="session")
def key_model(tiny_model_path):
    """An `AttentionModel` around `KeyTokenClassifier` (tiny random BERT inside), on the CPU."""
    import attnflow
    from attnflow.model import AttentionModel

    encoder = attnflow.load(str(tiny_model_path("bert")), device="cpu")
    key_id = encoder.tokenizer.convert_tokens_to_ids(KEY_WORD)
    model = AttentionModel(
        _key_classifier(encoder.model, key_id),
        encoder.tokenizer,
        name="key-token",
        adapter=encoder.adapter,
        device="cpu",
    )
    model.default_row = encoder.default_row
    return model


KEY_TEXTS = [
    "the movie was great but the plot was bad",
    "a great film",
    "this story is not very good and the acting is great",
    "the cat sat on the mat and it was great",
    "great acting",
    "he ran to the dog and the ending was great",
    "the plot of this film is great",
    "i hello world great there",
]
