"""``fate-edge calibrate``: the command line of ``planning.calibrate`` (record routing on a corpus, train the learned
expert predictors, measure them)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from fate_edge.planning.calibrate import CalibrateOptions, calibrate, table_markdown


def cmd_calibrate(args: argparse.Namespace) -> int:
    from fate_edge.bundled import bundled_model_dir

    if args.threads:
        torch.set_num_threads(args.threads)
    opts = CalibrateOptions(
        corpus=args.corpus,
        lookahead=args.lookahead,
        tokens=args.tokens,
        heldout_fraction=args.heldout_fraction,
        rank=args.rank,
        seq_len=args.seq_len,
        batch=args.batch,
        epochs=args.epochs,
        lr=args.lr,
        expert_bytes=args.expert_bytes,
        out=args.out,
        predictors_dir=args.predictors_dir,
        onnx=not args.no_onnx,
        progress=not args.quiet,
        seed=args.seed,
        previous_input=args.previous_input,
        early_attention=args.early_attention,
    )
    report = calibrate(args.model or bundled_model_dir(), opts)
    print(table_markdown(report))
    where = Path(report["files"]["popularity"]).parent
    print(
        f"wrote {report['files']['calibration']}; predictors and popularity in {where}"
        + (" (the expert store the engine uses for this model)" if args.predictors_dir is None else "")
        + f" ({report['seconds']:.0f}s)"
    )
    return 0


def add_calibrate_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``calibrate`` on the CLI's subparsers (``fate_edge.apps.cli.build_parser``)."""
    p = subparsers.add_parser("calibrate", help="record routing on a corpus, train and measure expert predictors")
    p.add_argument("model", nargs="?", default=None, help="model directory (default: the bundled model)")
    p.add_argument(
        "--corpus",
        type=Path,
        default=None,
        help="UTF-8 text file or directory of .txt/.py/.md files (default, for the bundled model "
        "and models trained on the stdlib, per their training_log.json: that training / held-out "
        "split)",
    )
    p.add_argument(
        "--lookahead",
        type=int,
        default=CalibrateOptions.lookahead,
        choices=[1, 2, 3, 4],
        help="MoE layers ahead to predict",
    )
    p.add_argument(
        "--tokens",
        type=int,
        default=CalibrateOptions.tokens,
        help="tokens to run through the model (training + held-out). More text trains markedly better "
        "predictors; the trace keeps tokens x hidden size x 4 bytes per MoE layer in memory",
    )
    p.add_argument(
        "--heldout-fraction",
        type=float,
        default=CalibrateOptions.heldout_fraction,
        help="share of the tokens held out for the report",
    )
    p.add_argument("--rank", type=int, default=CalibrateOptions.rank, help="width of the low-rank predictor")
    p.add_argument("--seq-len", type=int, default=CalibrateOptions.seq_len, help="tokens per window")
    p.add_argument("--batch", type=int, default=CalibrateOptions.batch, help="windows per forward pass")
    p.add_argument(
        "--epochs",
        type=int,
        default=CalibrateOptions.epochs,
        help="training epochs: the one-cycle schedule's length (early stopping may end sooner)",
    )
    p.add_argument("--lr", type=float, default=CalibrateOptions.lr, help="peak AdamW learning rate of the predictors")
    p.add_argument("--expert-bytes", type=int, default=None, help="bytes one expert moves (default: bf16 size)")
    p.add_argument("--out", type=Path, default=None, help="directory for calibration.json (default: predictors dir)")
    p.add_argument(
        "--predictors-dir",
        type=Path,
        default=None,
        help="where predictors and popularity go (default: predictors/ of the expert store the "
        "engine uses for MODEL, converted into the fate-edge cache once; the model folder is not "
        "written)",
    )
    p.add_argument(
        "--previous-input",
        action="store_true",
        help="learned predictors also read the previous token's gate input of the layer they predict "
        "(causal in decode; most help on the first layer pair; the predictor's input doubles)",
    )
    p.add_argument(
        "--early-attention",
        action="store_true",
        help="learned predictors also read the layer they predict's attention run one layer early on the "
        "current residual (the earlier tokens' keys and values are cached; one more attention per "
        "layer and token in decode; GQA models)",
    )
    p.add_argument("--no-onnx", action="store_true", help="skip the ONNX export")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--seed", type=int, default=CalibrateOptions.seed)
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_calibrate)
    return p
