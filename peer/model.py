"""A small byte-level GPT (nanoGPT-shaped) and the registry of model sizes peers can train.

Every peer builds its replica with `build_model(name, seed=...)`; the same (name, seed) gives bit-identical
parameters in any process, so a swarm agrees on the starting point without sending weights.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from murmur.peer.config import DEFAULT_MODEL  # noqa: F401  (the registry's default, as the run config names it)

MODEL_FILE, CONFIG_FILE = "model.safetensors", "config.json"  # what `murmur export` writes (peer.ops.export)
EXPORT_ID = "murmur.export"  # one export's id, in its model file's metadata and config.json's "murmur": a pair's check


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    vocab_size: int = 256  # bytes
    block_size: int = 64  # context length in bytes
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) <= 0:
                raise ValueError(f"GPTConfig.{name} must be positive, got {getattr(self, name)}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"GPTConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)  # q, k, v for all heads at once
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)  # 3 x (B, T, C)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        dropout_p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))  # (B, T, C) -> (B, T, 4C) -> (B, T, C)


class Block(nn.Module):
    """Pre-LayerNorm transformer block."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))  # (B, T, C)
        return x + self.mlp(self.ln_2(x))  # (B, T, C)


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: listed once, as wte.weight, in named_parameters()
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # scaled init of residual projections (GPT-2)
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @classmethod
    def from_pretrained(cls, folder: str | Path) -> GPT:
        """The model `murmur export` wrote to `folder`: config.json's GPTConfig fields, then model.safetensors,
        loaded strictly (every key and shape); MixedExport if the two are not of one export."""
        from safetensors.torch import load_file

        config = export_config(folder)
        model = cls(GPTConfig(**{k: v for k, v in config.items() if k in GPTConfig.__dataclass_fields__}))
        model.load_state_dict(load_file(Path(folder) / MODEL_FILE))
        return model.eval()

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        pos = torch.arange(T, device=idx.device)  # (T,)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)
        for block in self.blocks:
            x = block(x)  # (B, T, C)
        logits = self.lm_head(self.ln_f(x))  # (B, T, V)
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.view(B * T, -1), targets.reshape(B * T))
        return logits, loss


GPT2_VOCAB = 50257  # GPT-2's BPE vocabulary: the built-in byte data uses its first 256 ids

MODELS: dict[str, GPTConfig] = {
    "gpt-tiny": GPTConfig(n_layer=2, n_head=4, n_embd=128, block_size=64),  # 0.44M parameters
    "gpt-small": GPTConfig(n_layer=4, n_head=6, n_embd=192, block_size=128),  # 1.9M
    "gpt-20m": GPTConfig(n_layer=6, n_head=8, n_embd=512, block_size=256),  # 19.2M, a GPU volunteer's first run
    # GPT-2 small and medium, shape for shape (124,439,808 and 354,823,168 parameters, as released)
    "gpt2-small": GPTConfig(vocab_size=GPT2_VOCAB, n_layer=12, n_head=12, n_embd=768, block_size=1024),
    "gpt2-medium": GPTConfig(vocab_size=GPT2_VOCAB, n_layer=24, n_head=16, n_embd=1024, block_size=1024),
}


def build_model(name: str, *, seed: int) -> GPT:
    """Registry model `name`, its parameters determined by `seed` alone; the caller's RNG is untouched."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of: {', '.join(MODELS)}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return GPT(MODELS[name])


def loss_of(output: object) -> Tensor:
    """The loss a model's forward returned: the tensor itself, an output's `loss` (a dict's "loss", a Hugging Face
    `ModelOutput`'s, a named tuple's), or else the last element of a tuple (as `GPT`)."""
    if isinstance(output, Mapping) and "loss" in output:
        loss = output["loss"]
    elif not isinstance(output, Tensor) and isinstance(getattr(output, "loss", None), Tensor):
        loss = output.loss
    else:
        loss = output[-1] if isinstance(output, tuple | list) and output else output
    if not isinstance(loss, Tensor) or loss.dim() != 0:
        raise ValueError("the model's forward must return a scalar loss, a tuple ending with one, or an output "
                         "whose `loss` is one (a dict's \"loss\", a Hugging Face ModelOutput)")  # fmt: skip
    return loss


def buffer_names(model: nn.Module) -> list[str]:
    """The keys of `model.state_dict()` that are buffers, not parameters (BatchNorm's running statistics, an
    attention mask): their values are the model's own, and need not be finite (a mask of -inf)."""
    params = {id(p) for p in model.parameters()}
    return [key for key, value in model.state_dict(keep_vars=True).items() if id(value) not in params]


def count_parameters(model: nn.Module) -> int:
    """Number of distinct parameter elements (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters())


class MixedExport(ValueError):
    """An export folder whose two files are of two different exports; str(e) is one line."""


def export_config(folder: str | Path) -> dict:
    """An export's config.json (`murmur export`), after checking from its header alone that model.safetensors is of
    the same export: one cut short between its two files left one of each (MixedExport). Exports of an older
    murmur, which named none, pass."""
    import json

    from safetensors import safe_open

    folder = Path(folder)
    config = json.loads((folder / CONFIG_FILE).read_text())
    with safe_open(str(folder / MODEL_FILE), framework="pt") as f:
        model_id = (f.metadata() or {}).get(EXPORT_ID)
    about = config.get("murmur") if isinstance(config, dict) else None
    if model_id != (about.get("export") if isinstance(about, dict) else None):
        raise MixedExport(f"{folder}: {MODEL_FILE} and {CONFIG_FILE} are of two different exports (an export into it "
                          "was cut short between them): export again")  # fmt: skip
    return config
