"""ABC's head alone on digits' pixels, with and without a common offset: does its kernel separate the classes?

Adam (lr 1e-3) trains :class:`pipeline.core.abc.ABCHead` (2 SABs, 4 heads, width 128, multiplicative, logits) with
the balanced BCE on random batches of 128 digits (64 pixels in [0, 1]) and prints, every 50 steps, the batch's loss
and its mean κ over same-class and over other pairs. ``--offset`` adds a constant to every pixel: rows that share a
large common part, as a freshly initialised backbone's do. ``--set-norm`` runs each offset twice, without and with
``ABCHead(set_norm=True)`` (each feature standardised over the batch before the pre-embedding, as ``pretrain`` does
by default with ``model.abc.set_norm``): the offset then no longer reaches the kernel.

    python benchmarks/bench_abc_offset.py --offset 0 3
    python benchmarks/bench_abc_offset.py --offset 0 3 --set-norm
"""

from __future__ import annotations

import argparse

import torch
from sklearn.datasets import load_digits

from pipeline.core.abc import ABCHead


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--offset", type=float, nargs="+", default=[0.0, 3.0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set-norm", action="store_true", help="also run each offset with ABCHead(set_norm=True)")
    args = ap.parse_args()
    digits = load_digits()
    x, y = torch.tensor(digits.data, dtype=torch.float32) / 16, torch.tensor(digits.target)  # (N, 64), (N,)
    for offset, set_norm in [(o, s) for o in args.offset for s in ((False, True) if args.set_norm else (False,))]:
        torch.manual_seed(args.seed)
        head = ABCHead(64, depth=2, set_norm=set_norm)
        label = f"offset {offset:g}" + (f" set_norm {set_norm}" if args.set_norm else "")
        opt = torch.optim.Adam(head.parameters(), 1e-3)
        for step in range(args.steps + 1):
            idx = torch.randint(0, len(y), (128,))
            out = head(x[idx] + offset)
            loss = out.loss(y[idx], pos_weight="balanced")
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step % 50 == 0:
                kappa, same = out.kernel.detach(), y[idx, None] == y[idx]
                print(f"{label} step {step}: loss {loss.item():.3f}, mean κ same class "
                      f"{kappa[same].mean().item():.3f}, other {kappa[~same].mean().item():.3f}")


if __name__ == "__main__":
    main()
