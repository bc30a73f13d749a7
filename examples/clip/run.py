"""Export CLIP into a switchboard (vision tower | text tower | head) and check it against the model."""

from __future__ import annotations

import argparse
import time

import torch

import hpcsplit
from hpcsplit.switchboard.models import build_clip, example_inputs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--size", choices=["base", "tiny"], default="base")
    ap.add_argument("--checkpoint", default=None, help="local CLIPModel directory (optional)")
    ap.add_argument("--out", default="/tmp/clip-switchboard")
    ap.add_argument("--stages", type=int, default=None)
    args = ap.parse_args()

    model = build_clip(args.size, args.checkpoint)
    name = "clip_tiny" if args.size == "tiny" and not args.checkpoint else "clip"
    inputs = example_inputs(name, 2, model=model)
    t0 = time.perf_counter()
    # ViT-B/32 pays for its split; the tiny config does not (forced, to show the towers)
    sb = hpcsplit.export(model, inputs, out=args.out, stages=args.stages, force=name == "clip_tiny")
    print(f"export + verification: {time.perf_counter() - t0:.1f} s")
    print(sb.table())

    sb = hpcsplit.Switchboard.load(args.out)
    xs = example_inputs(name, 3, model=model, seed=1)
    with torch.no_grad():
        diff = (sb(*xs) - model(*xs)).abs().max().item()
    print(f"batch 3: max |split - model| = {diff:.2e}")


if __name__ == "__main__":
    main()
