"""Encoder-decoder rollout (placeholder until implemented)."""
def encoder_decoder_rollout(*args, **kwargs):
    raise NotImplementedError
