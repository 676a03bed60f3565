"""How far train.py's validation estimate (data.val_batches batches of data.val_batch_size random windows) is from
the full split's loss, for several batchings of the same model: the mean and spread of estimate - full over seeds
(each seed draws other windows, as another run's seed would).  Why the GPU recipe validates 5 x 640 windows, not
fewer: the spread depends on how many windows there are, not how they are batched.

    python3 benchmarks/val_estimate.py --ckpt out/RUN --corpus tinyshakespeare.txt --shapes 50x64,5x640,8x64
"""

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere without installing

from benchmarks import common
from minigpt.core.config import GPTConfig
from minigpt.core.model import GPT
from minigpt.evaluation.loss import evaluate_tokens
from minigpt.loading import load_model
from minigpt.training.datamodule import VAL_STREAM, FixedWindows, TokenDataModule


def estimates(model: GPT, val: np.ndarray, batches: int, size: int, seeds: int) -> list[float]:
    """The validation estimate with each seed's windows: the mean of its batches' losses, as Lightning's epoch mean
    of equal-sized batches."""
    out = []
    for seed in range(seeds):
        windows = FixedWindows(val, model.config.block_size, size, seed, stream=VAL_STREAM, length=batches)
        losses = [model(w[:, :-1], w[:, 1:])[1].item() for w in (windows[i] for i in range(batches))]
        out.append(float(np.mean(losses)))
    return out


@torch.no_grad()
def main(argv: list[str] | None = None) -> dict:
    p = common.parser(__doc__, "val_estimate", device=False)  # on the CPU
    p.add_argument("--ckpt", help="a run directory (its best checkpoint) or .ckpt; --quick: an untrained tiny model")
    p.add_argument("--corpus", required=True, help="the text file the model was trained on")
    p.add_argument("--tokenizer", default="char", help="the run's data.tokenizer (default char)")
    p.add_argument("--data_root", default="data", help="where prepared token files are cached")
    p.add_argument("--shapes", default="50x64,5x640,8x64,16x64", help="BATCHESxBATCH_SIZE, comma-separated")
    p.add_argument("--seeds", type=common.at_least(2), default=12, help="window draws per shape (as many runs' seeds)")
    args = p.parse_args(argv)
    if not (args.ckpt or args.quick):
        p.error("--ckpt is required (a run directory or .ckpt), unless --quick")
    label = common.start(args)
    data = TokenDataModule(args.corpus, args.tokenizer, data_root=args.data_root)
    data.prepare_data()
    val = data.prepared.val
    if args.quick:
        torch.manual_seed(0)
        model, args.seeds = GPT(GPTConfig(vocab_size=data.vocab_size, n_layer=1, n_head=2, n_embd=32, block_size=32)), 2
        args.shapes = "4x8,1x32"
    else:
        model, tokenizer = load_model(args.ckpt)
        if tokenizer.to_dict() != data.prepared.tokenizer.to_dict():  # ids that mean other tokens: figures of nothing
            p.error(
                f"--ckpt {args.ckpt} was not trained on --corpus {args.corpus} with --tokenizer {args.tokenizer} "
                f"(its tokenizer: {tokenizer.name}, {tokenizer.vocab_size} tokens; the corpus's: "
                f"{data.prepared.tokenizer.name}, {data.prepared.tokenizer.vocab_size}); give the run's corpus and "
                "data.tokenizer"
            )
    model.eval()
    nats, n = evaluate_tokens(model, val, 64)
    full = nats / n
    print(f"full split {full:.4f} over {n:,} tokens, block_size {model.config.block_size}, {args.seeds} seeds")
    rows = []
    for shape in args.shapes.split(","):
        batches, size = (int(x) for x in shape.split("x"))
        found = estimates(model, val, batches, size, args.seeds)
        dev = np.array(found) - full
        rows.append(
            dict(batches=batches, batch_size=size, windows=batches * size, mean_dev=round(float(dev.mean()), 5))
            | dict(sd=round(float(np.std(found, ddof=1)), 5), max_abs_dev=round(float(np.abs(dev).max()), 5))
        )
        r = rows[-1]
        print(
            f"{batches:3d} x {size:4d} ({batches * size:5,d} windows): estimate - full {r['mean_dev']:+.4f} on "
            f"average, sd {r['sd']:.4f} over the seeds, at most {r['max_abs_dev']:.4f}"
        )
    return common.finish(dict(machine=label, full=full, tokens=n, seeds=args.seeds, rows=rows), args)


if __name__ == "__main__":
    main()
