"""Export the toy two-branch MLP, reload the switchboard and check it against the model."""

from __future__ import annotations

import argparse

import torch

import hpcsplit
from hpcsplit.switchboard.models import build_toy, example_inputs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="/tmp/toy-switchboard", help="switchboard directory to write")
    ap.add_argument(
        "--stages", type=int, default=None, help="cut the heaviest component into this many stages"
    )
    args = ap.parse_args()

    model = build_toy()
    # the toy's components compute in microseconds: its split does not pay (export would keep it whole);
    # force it to show the nested diamond
    sb = hpcsplit.export(
        model, example_inputs("toy_mlp", 2, model=model), out=args.out, stages=args.stages, force=True
    )
    print(sb.table())

    sb = hpcsplit.Switchboard.load(args.out)
    for batch_size in (1, 4, 32):
        (x,) = example_inputs("toy_mlp", batch_size, model=model, seed=batch_size)
        with torch.no_grad():
            diff = (sb(x) - model(x)).abs().max().item()
        print(f"batch {batch_size:>3}: max |split - model| = {diff:.2e}")
    print(sb.verify(batch_size=8))


if __name__ == "__main__":
    main()
