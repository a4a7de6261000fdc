"""GPT-2 small's shape with a short context: a 124M-parameter model whose steps a CPU can take.

`gpt2-small` in the registry is GPT-2 small whole (context 1024); this is the same 12 layers of 768
with GPT-2's vocabulary, on 64-byte windows of the built-in data, so that a check on a small machine
(`scripts/check_big_swarm.py`) trains a 124M model for real without taking minutes a step.

    murmur bootstrap --run big --model examples.gpt2_short:build_model --data examples.gpt2_short:build_batches
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import Tensor

from murmur.peer.data import DataConfig, batches, eval_batches, load_corpus
from murmur.peer.model import GPT, GPT2_VOCAB, GPTConfig

CONFIG = GPTConfig(vocab_size=GPT2_VOCAB, n_layer=12, n_head=12, n_embd=768, block_size=64)


def build_model() -> GPT:
    return GPT(CONFIG)  # 123,702,528 parameters


def build_batches(split: str, *, seed: int, batch_size: int) -> Iterator[tuple[Tensor, Tensor]]:
    corpus = load_corpus(DataConfig(max_bytes=2_000_000))
    if split == "train":
        yield from batches(corpus.train, batch_size=batch_size, block_size=CONFIG.block_size, seed=seed)
    else:
        yield from eval_batches(corpus.heldout, batch_size=batch_size, block_size=CONFIG.block_size, n_batches=4)
