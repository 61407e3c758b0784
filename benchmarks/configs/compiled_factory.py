"""A model factory for the compiled-accuracy benchmark: batchlab's GPT built from the flags' shape (so the
formula's stand-in shape is the model's), returning logits as a factory's model does, blocks under ``blocks``."""
from batchlab.models import synthetic_tokens
from batchlab.models.gpt import GPT


class Logits(GPT):
    def forward(self, tokens):  # a factory's model maps tokens to logits; the harness takes the loss
        return self.head(self.features(tokens))


def gpt(cfg):
    return Logits(cfg.model), synthetic_tokens(cfg.model.vocab, cfg.data)
