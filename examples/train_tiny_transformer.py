"""Train a tiny transformer for a few steps after ``safeops.replace_modules`` -- runs on a CPU.

The model is plain PyTorch: an embedding, a ``torch.nn.TransformerEncoder`` (its layers hold
``nn.MultiheadAttention``), attention pooling with a learned query (another ``nn.MultiheadAttention``,
called with its default ``need_weights=True``) and a ``LogSoftmax`` head, classifying sequences. Sequences
are padded at the end, and every batch holds one empty sequence (padding only), as real batches sometimes
do. Stock PyTorch gives that sample's pooled attention NaN (no key to attend to), and the NaN reaches the
loss and, through the optimizer, every weight. After ``replace_modules`` the same model trains with finite
losses (an empty sample pools to 0, contract section 4), and ``restore_modules`` gives back the originals.

    python examples/train_tiny_transformer.py [--steps 20] [--seed 0]
"""

from __future__ import annotations

import argparse
import copy

import torch
from torch import nn

import safeops


class TinyClassifier(nn.Module):
    """Sequence classification: embedding -> 2 encoder layers -> attention pooling -> linear -> LogSoftmax."""

    def __init__(self, vocab: int = 50, width: int = 32, heads: int = 4, classes: int = 5):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(width, heads, dim_feedforward=64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.query = nn.Parameter(torch.randn(1, 1, width))
        self.pool = nn.MultiheadAttention(width, heads, batch_first=True)
        self.head = nn.Linear(width, classes)
        self.log_probs = nn.LogSoftmax(dim=-1)

    def forward(self, tokens: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        h = self.encoder(self.embed(tokens), src_key_padding_mask=padding)
        query = self.query.expand(tokens.shape[0], 1, -1)
        pooled, _weights = self.pool(query, h, h, key_padding_mask=padding)  # need_weights=True (default)
        return self.log_probs(self.head(pooled[:, 0]))


def batch(gen: torch.Generator, size: int = 8, length: int = 12):
    tokens = torch.randint(1, 50, (size, length), generator=gen)
    lengths = torch.randint(3, length + 1, (size,), generator=gen)
    lengths[0] = 0  # one sequence that is padding only
    padding = torch.arange(length)[None, :] >= lengths[:, None]  # True = padded key
    labels = tokens[:, 0] % 5  # the class is the first token's, mod 5 (0 for the empty sequence's padding)
    labels[0] = 0
    return tokens, padding, labels


def train(model: nn.Module, steps: int, seed: int) -> list[float]:
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        tokens, padding, labels = batch(gen)
        log_probs = model(tokens, padding)
        loss = nn.functional.nll_loss(log_probs, labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    torch.manual_seed(args.seed)
    stock = TinyClassifier()
    safe = copy.deepcopy(stock)  # the same initial weights

    stock_losses = train(stock, args.steps, args.seed)
    print(f"stock PyTorch:   first loss {stock_losses[0]:.4f}, last {stock_losses[-1]:.4f}, "
          f"NaN losses: {sum(x != x for x in stock_losses)} of {args.steps}")

    safeops.replace_modules(safe)
    print(safe.safeops_report)
    safe_losses = train(safe, args.steps, args.seed)
    print(f"with safeops:    first loss {safe_losses[0]:.4f}, last {safe_losses[-1]:.4f}, "
          f"NaN losses: {sum(x != x for x in safe_losses)} of {args.steps}")
    assert all(x == x for x in safe_losses), "safeops training produced a NaN loss"

    safeops.restore_modules(safe)
    kinds = sorted({type(m).__module__.split(".")[0] for m in safe.modules()
                    if isinstance(m, (nn.MultiheadAttention, nn.LogSoftmax))})
    print(f"after restore_modules the attention and LogSoftmax modules come from: {', '.join(kinds)}")


if __name__ == "__main__":
    main()
