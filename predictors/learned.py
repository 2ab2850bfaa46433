"""Small learned expert predictors, trained on calibration traces and run by torch or onnxruntime.

Per source MoE layer i, a model reads layer i's gate input h_i [N, H] and scores the experts of the next
p MoE layers at once ([P·E] logits), in one of two kinds:

* ``linear``:  logits = W·h + b, with W [P·E, H] initialised from the next p stacked routers, i.e. it
  starts as exactly Fate's cross-layer gate (WWW'26, arXiv 2502.12224; stacked lookahead as in HOBBIT,
  arXiv 2411.01433) and training only corrects it;
* ``lowrank``: the same linear term plus a residual low-rank MLP, U·silu(D·h + c) with D [r, H], U [P·E, r];
  U starts at zero so the untrained model is again the cross-layer gate.

Training (``train_learned``) fits each source layer to the true top-k experts of its targets from a
:class:`~predictors.evaluate.Trace`: softmax cross-entropy against the k-hot target spread evenly over the
true experts (``loss="ce"``, scores are softmax probabilities like the router's) or multi-label BCE
(``loss="bce"``, scores are sigmoids), with AdamW under a one-cycle learning rate; the low-rank branch reads
standardised inputs while it trains (folded into D and c afterwards). Training stops once neither the
validation loss nor the validation exact top-k match has improved for ``patience`` epochs, and keeps the epoch
with the best validation exact match (the untrained gate, epoch 0, included), so on validation it never falls
below the cross-layer gate. What it reaches on the bundled model, with how much text: docs/predictors.md, "How well the
calibrated predictors predict".

A trained predictor is saved as ``learned-<kind>-p<p>.safetensors`` + ``learned-<kind>-p<p>.json`` (the
manifest: architecture, training data size, metrics) and exported to ONNX, one small graph per source
layer (h [N, H] → probabilities [P, N, E]); :class:`OnnxPredictor` runs those with onnxruntime's CPU provider.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import logging
import math
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from fate_edge.predictors.base import Prediction, Predictor, next_moe_layers
from fate_edge.predictors.cross_layer_gate import CrossLayerGate
from fate_edge.predictors.evaluate import Trace
from fate_edge.predictors.previous_input import PreviousInput, ReadsPreviousInput
from torch import nn

FORMAT = "fate-edge/learned-predictor"
VERSION = 3  # 2: "previous_input" (inputs [h, previous]); 3: "early_attention" ([h, early, previous]); the
# lowest version that describes a predictor is written
KINDS = ("linear", "lowrank")
LOSSES = ("ce", "bce")


def manifest_path(directory: str | Path, kind: str, lookahead: int) -> Path:
    """Where a predictor of ``kind`` and lookahead ``p`` lives in ``directory`` (its JSON manifest)."""
    return Path(directory) / f"learned-{kind}-p{lookahead}.json"


def find_learned(directory: str | Path, lookahead: int = 1, widest: bool = False) -> Path | None:
    """The calibrated predictor to load from ``directory``: low-rank before linear, trained for at least
    ``lookahead`` layers ahead; the nearest such lookahead, or with ``widest`` the largest. None if none."""
    for kind in ("lowrank", "linear"):
        found = {int(f.stem.rsplit("p", 1)[1]): f for f in Path(directory).glob(f"learned-{kind}-p*.json")}
        usable = sorted(p for p in found if p >= lookahead)
        if usable:
            return found[usable[-1] if widest else usable[0]]
    return None


class SourceModel(nn.Module):
    """Logits [N, P·E] for one source layer: W·h + b, plus U·silu(D·h + c) when ``rank`` > 0."""

    def __init__(self, weight: torch.Tensor, rank: int = 0, seed: int = 0):
        super().__init__()
        out, hidden = weight.shape
        self.weight = nn.Parameter(weight.detach().float().clone())  # [P·E, H]
        self.bias = nn.Parameter(torch.zeros(out))
        self.rank = rank
        # While training, the low-rank branch reads standardised inputs (h - mean) / std; fold_standardization
        # moves that into D and c, so a saved model is the plain formula above.
        self.standardization: tuple[torch.Tensor, torch.Tensor] | None = None
        if rank:
            gen = torch.Generator().manual_seed(seed)
            self.down = nn.Parameter(torch.randn(rank, hidden, generator=gen) / math.sqrt(hidden))  # [r, H]
            self.down_bias = nn.Parameter(torch.zeros(rank))
            self.up = nn.Parameter(torch.zeros(out, rank))  # [P·E, r], zero: starts as the linear init

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        logits = F.linear(h, self.weight, self.bias)
        if self.rank:
            z = h if self.standardization is None else (h - self.standardization[0]) * self.standardization[1]
            logits = logits + F.linear(F.silu(F.linear(z, self.down, self.down_bias)), self.up)
        return logits

    def standardize(self, h: torch.Tensor) -> None:
        """Let the low-rank branch read ``h``'s columns standardised (training only: the gate inputs' columns
        differ in scale by the norm weights, which slows the branch's fit)."""
        if self.rank:
            mean, std = h.mean(0), h.std(0)
            self.standardization = (mean, 1.0 / std.clamp_min(1e-6 * std.max().clamp_min(1e-12)))

    @torch.no_grad()
    def fold_standardization(self) -> None:
        """D·((h - m)·s) + c = (D·diag(s))·h + (c - D·diag(s)·m): the same function, without the buffers."""
        if self.standardization is not None:
            mean, inv = self.standardization
            self.down.mul_(inv)
            self.down_bias.sub_(self.down @ mean)
            self.standardization = None


class _ScoreGraph(nn.Module):
    """h [N, H] → scores [P, N, E]: what one source layer's ONNX graph computes."""

    def __init__(self, model: SourceModel, num_experts: int, loss: str):
        super().__init__()
        self.model, self.num_experts, self.loss = model, num_experts, loss

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.model(h)
        logits = logits.reshape(h.shape[0], -1, self.num_experts).transpose(0, 1)  # [P, N, E]
        return torch.softmax(logits, dim=-1) if self.loss == "ce" else torch.sigmoid(logits)


class LearnedPredictor(ReadsPreviousInput, Predictor):
    """Per source MoE layer, a :class:`SourceModel` scoring the next p MoE layers (see the module docstring).

    ``lookahead`` may be smaller than the trained p: the nearer targets are returned, the rest dropped.
    Layers without a model (dense layers, the last MoE layer) predict nothing. With ``previous`` every model
    reads [h_i, the previous token's next-layer gate input] (previous_input.py).
    """

    def __init__(
        self,
        models: dict[int, SourceModel],
        moe_layers: list[int],
        num_experts: int,
        trained_lookahead: int,
        kind: str = "linear",
        loss: str = "ce",
        lookahead: int | None = None,
        meta: dict[str, Any] | None = None,
        previous: bool = False,
        early: bool = False,
    ):
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, not {kind!r}")
        if loss not in LOSSES:
            raise ValueError(f"loss must be one of {LOSSES}, not {loss!r}")
        lookahead = trained_lookahead if lookahead is None else lookahead
        if lookahead > trained_lookahead:
            raise ValueError(f"lookahead {lookahead} exceeds the trained lookahead {trained_lookahead}")
        super().__init__(moe_layers, lookahead)
        self.models = {int(i): m.eval() for i, m in models.items()}
        self.num_experts = num_experts
        self.trained_lookahead = trained_lookahead
        self.kind, self.loss = kind, loss
        self.meta: dict[str, Any] = dict(meta or {})
        width = next(iter(self.models.values())).weight.shape[1] if self.models else 0
        self.hidden_size = width // (1 + previous + early)
        self.context = PreviousInput(self.moe_layers) if previous else None
        self.early_attention = early  # reads early_attention.EarlyInput's estimate once attach(model) is called

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_gate(
        cls,
        gate: CrossLayerGate,
        kind: str = "linear",
        rank: int = 64,
        seed: int = 0,
        previous: bool = False,
        early: bool = False,
    ) -> LearnedPredictor:
        """Untrained: every source layer starts from ``gate``'s stacked next-p routers (the norm variant's
        rescaled rows if ``gate`` has norms), so it scores exactly as the gate does (softmax routers). With
        ``previous`` (``early``) the weights of the previous token's input (of the early attention's estimate) start
        at zero: the same scores until trained."""
        rank = rank if kind == "lowrank" else 0
        models = {}
        for layer in gate.moe_layers:
            if gate.targets(layer):
                w = gate.stacked(layer)
                w = torch.cat([w] + [torch.zeros_like(w)] * (early + previous), 1)
                models[layer] = SourceModel(w, rank, seed + layer)
        init = "cross-layer-gate-norm" if gate.norms is not None else "cross-layer-gate"
        meta = {"init": init, "rank": rank}
        return cls(
            models,
            gate.moe_layers,
            gate.num_experts,
            gate.lookahead,
            kind,
            "ce",
            meta=meta,
            previous=previous,
            early=early,
        )

    def to(self, device: torch.device | str) -> LearnedPredictor:
        """Every source model's weights on ``device`` (where the model's gate inputs are)."""
        for m in self.models.values():
            m.to(device)
        return self

    # --------------------------------------------------------------------- inference
    def logits(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """Raw logits [P_trained, N, E] of ``layer``'s model (differentiable; for training)."""
        logits = self.models[layer](self.model_input(layer, h).float())
        return logits.view(h.shape[0], -1, self.num_experts).transpose(0, 1)

    def predict(self, layer: int, h: torch.Tensor) -> Prediction:
        targets = self.targets(layer)
        if not targets or layer not in self.models:
            return self.empty(h.shape[0], self.num_experts, h.device)
        with torch.no_grad():
            logits = self.logits(layer, h)[: len(targets)]
        scores = torch.softmax(logits, dim=-1) if self.loss == "ce" else torch.sigmoid(logits)
        return Prediction(targets, scores)

    # ------------------------------------------------------------------- persistence
    def manifest(self) -> dict[str, Any]:
        any_model = next(iter(self.models.values()))
        return {
            "format": FORMAT,
            "version": 3 if self.early_attention else 2 if self.context is not None else 1,
            "kind": self.kind,
            "loss": self.loss,
            "activation": "silu",
            "rank": any_model.rank,
            "lookahead": self.trained_lookahead,
            "hidden_size": self.hidden_size,
            "previous_input": self.context is not None,
            "early_attention": self.early_attention,
            "num_experts": self.num_experts,
            "moe_layers": self.moe_layers,
            "sources": {str(i): list(next_moe_layers(self.moe_layers, i, self.trained_lookahead)) for i in self.models},
            **{k: v for k, v in self.meta.items() if k not in ("rank",)},
        }

    def save(self, directory: str | Path, onnx: bool = True) -> Path:
        """Write ``learned-<kind>-p<p>.safetensors``, the JSON manifest and (``onnx``) one ONNX graph per
        source layer into ``directory``; returns the manifest's path."""
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        path = manifest_path(directory, self.kind, self.trained_lookahead)
        tensors = {
            f"{i}.{name}": p.detach().contiguous() for i, m in self.models.items() for name, p in m.named_parameters()
        }
        save_file(tensors, str(path.with_suffix(".safetensors")))
        manifest = self.manifest()
        manifest["weights"] = path.with_suffix(".safetensors").name
        manifest.pop("onnx", None)
        if onnx:
            manifest["onnx"] = {
                str(i): self.export_onnx(i, path.with_name(f"{path.stem}.layer{i}.onnx")).name for i in self.models
            }
        path.write_text(json.dumps(manifest, indent=1))
        return path

    @classmethod
    def load(cls, path: str | Path, lookahead: int | None = None) -> LearnedPredictor:
        """Load from a manifest written by :meth:`save`."""
        from safetensors.torch import load_file

        path = Path(path)
        manifest = read_manifest(path)
        tensors = load_file(str(path.with_name(manifest["weights"])))
        models = {}
        for src in manifest["sources"]:
            w = tensors[f"{src}.weight"]
            model = SourceModel(w, manifest["rank"])
            model.load_state_dict({k.split(".", 1)[1]: v for k, v in tensors.items() if k.split(".", 1)[0] == src})
            models[int(src)] = model
        meta: dict[str, Any] = {k: manifest[k] for k in ("init", "training", "metrics") if k in manifest}
        return cls(
            models,
            manifest["moe_layers"],
            manifest["num_experts"],
            manifest["lookahead"],
            manifest["kind"],
            manifest["loss"],
            lookahead,
            meta,
            manifest.get("previous_input", False),
            manifest.get("early_attention", False),
        )

    def export_onnx(self, layer: int, path: str | Path) -> Path:
        """One graph for ``layer``: input ``h`` [N, H] float32 (N dynamic; wider with the early attention's estimate
        and/or the previous input, widened by the caller) → output ``scores`` [P, N, E]."""
        path = Path(path)
        graph = _ScoreGraph(self.models[layer], self.num_experts, self.loss).eval()
        example = torch.zeros(2, self.models[layer].weight.shape[1])
        dynamo = importlib.util.find_spec("onnxscript") is not None  # the torch.export-based exporter needs it
        kw: dict[str, Any] = {"dynamic_axes": {"h": {0: "n"}, "scores": {1: "n"}}}
        if dynamo:
            kw = {"dynamic_shapes": {"h": {0: torch.export.Dim("n", min=1)}}, "verbose": False, "external_data": False}
        with _quiet_export():
            torch.onnx.export(
                graph, (example,), str(path), input_names=["h"], output_names=["scores"], dynamo=dynamo, **kw
            )
        return path


def read_manifest(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{path}: not a learned-predictor manifest (format {manifest.get('format')!r})")
    if manifest.get("version", 0) > VERSION:
        raise ValueError(f"{path}: manifest version {manifest['version']} is newer than this code ({VERSION})")
    return manifest


@contextlib.contextmanager
def _quiet_export():
    """The exporters log progress and deprecation noise that says nothing about our graphs."""
    loggers = [logging.getLogger(n) for n in ("torch.onnx", "torch.export", "onnxscript")]
    levels = [lg.level for lg in loggers]
    try:
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


class OnnxPredictor(ReadsPreviousInput, Predictor):
    """A saved :class:`LearnedPredictor` run by onnxruntime (CPU provider), one session per source layer."""

    def __init__(self, path: str | Path, lookahead: int | None = None, threads: int = 1):
        import onnxruntime as ort

        path = Path(path)
        manifest = read_manifest(path)
        if "onnx" not in manifest:
            raise ValueError(f"{path}: no ONNX graphs were exported (save with onnx=True)")
        lookahead = manifest["lookahead"] if lookahead is None else lookahead
        if lookahead > manifest["lookahead"]:
            raise ValueError(f"lookahead {lookahead} exceeds the trained lookahead {manifest['lookahead']}")
        super().__init__(manifest["moe_layers"], lookahead)
        self.num_experts = manifest["num_experts"]
        self.kind = manifest["kind"]
        self.hidden_size = manifest["hidden_size"]
        self.context = PreviousInput(self.moe_layers) if manifest.get("previous_input", False) else None
        self.early_attention = manifest.get("early_attention", False)
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        opts.log_severity_level = 3
        self.sessions = {
            int(src): ort.InferenceSession(str(path.with_name(name)), opts, providers=["CPUExecutionProvider"])
            for src, name in manifest["onnx"].items()
        }

    def predict(self, layer: int, h: torch.Tensor) -> Prediction:
        targets = self.targets(layer)
        if not targets or layer not in self.sessions:
            return self.empty(h.shape[0], self.num_experts, h.device)
        # onnxruntime runs on the CPU: the gate input comes over (one [N, H] copy), the scores go back to its device.
        x = self.model_input(layer, h.detach()).to("cpu", torch.float32).contiguous().numpy()
        (scores,) = self.sessions[layer].run(None, {"h": x})
        return Prediction(targets, torch.from_numpy(scores[: len(targets)]).to(h.device))


# ---------------------------------------------------------------------------------------------- training
@dataclass
class TrainConfig:
    kind: str = "linear"  # linear | lowrank
    rank: int = 256  # low-rank width r (lowrank only)
    loss: str = "ce"  # ce: softmax cross-entropy on the k-hot target / k; bce: multi-label sigmoid
    epochs: int = 12  # the schedule's length; early stopping may end sooner
    patience: int = 4  # epochs improving neither validation loss nor exact match before stopping
    lr: float = 2e-3  # AdamW's peak learning rate
    schedule: str = "onecycle"  # onecycle: warm up over 30% of the epochs, anneal to ~0; constant: lr throughout
    weight_decay: float = 1e-4
    batch_size: int = 512
    standardize: bool = True  # the low-rank branch trains on standardised inputs (folded away afterwards)
    val_fraction: float = 0.1  # contiguous tail of the training trace, when no validation trace is given
    seed: int = 0
    previous_input: bool = False  # read [h_i, previous token's h_{i+1}]: traces widened by previous_input.widen_trace
    previous_dropout: float = 0.1  # share of training rows whose previous input is zeroed (as a prompt's rows read)
    early_attention: bool = False  # read [h_i, s_{i+1}(, previous)]: widen_trace(..., early=True), early_attention.py


SCHEDULES = ("onecycle", "constant")


def _khot(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[N, k] expert ids → [N, E] float 0/1."""
    return torch.zeros(ids.shape[0], num_experts).scatter_(1, ids, 1.0)


def _loss(logits: torch.Tensor, y: torch.Tensor, loss: str) -> torch.Tensor:
    """logits, y [P, N, E] (y k-hot) → mean loss per token and target layer."""
    if loss == "ce":
        return -(y / y.sum(-1, keepdim=True) * F.log_softmax(logits, dim=-1)).sum(-1).mean()
    return F.binary_cross_entropy_with_logits(logits, y, reduction="none").sum(-1).mean()


@torch.no_grad()
def _score(
    pred: LearnedPredictor, layer: int, h: torch.Tensor, ids: torch.Tensor, y: torch.Tensor, loss: str
) -> tuple[float, float, float]:
    """(exact top-k, recall@k, loss) on validation rows; ids [P, N, k], y [P, N, E]."""
    logits = pred.logits(layer, h)
    k = ids.shape[-1]
    top = logits.topk(k, dim=-1).indices  # [P, N, k]
    hits = (top[..., :, None] == ids[..., None, :]).any(-2)  # [P, N, k]
    return hits.all(-1).float().mean().item(), hits.float().mean().item(), _loss(logits, y, loss).item()


def train_learned(
    gate: CrossLayerGate,
    train: Trace,
    val: Trace | None = None,
    config: TrainConfig | None = None,
    progress: bool = True,
) -> LearnedPredictor:
    """Initialise from ``gate`` (its lookahead is the trained p) and fit every source layer on ``train``;
    early-stop on ``val`` (default: the last ``val_fraction`` of ``train``'s rows). With ``previous_input`` and/or
    ``early_attention`` the traces must hold widened inputs [h_i, s_{i+1}, previous token's h_{i+1}]
    (previous_input.widen_trace)."""
    from tqdm.auto import tqdm

    cfg = config or TrainConfig()
    if cfg.kind not in KINDS or cfg.loss not in LOSSES or cfg.schedule not in SCHEDULES:
        raise ValueError(f"kind must be one of {KINDS}, loss one of {LOSSES} and schedule one of {SCHEDULES}")
    if val is None:
        cut = train.tokens - max(1, round(cfg.val_fraction * train.tokens))
        train, val = train.rows(0, cut), train.rows(cut)
    pred = LearnedPredictor.from_gate(
        gate, cfg.kind, cfg.rank, cfg.seed, previous=cfg.previous_input, early=cfg.early_attention
    )
    pred.loss = cfg.loss
    width = pred.hidden_size * (1 + cfg.previous_input + cfg.early_attention)
    first_row = train.rows(0, 1).gate_inputs  # widths from one row: a widened trace builds a layer when read
    narrow = {i: h.shape[1] for i, h in first_row.items() if i in pred.models and h.shape[1] != width}
    if narrow:
        raise ValueError(
            f"source layers {sorted(narrow)} have inputs {sorted(set(narrow.values()))} wide, the "
            f"predictor reads {width}"
            + (" (widen the trace: previous_input.widen_trace)" if cfg.previous_input or cfg.early_attention else "")
        )
    e = gate.num_experts
    sources = [i for i in pred.models if i in train.gate_inputs and all(t in train.expert_ids for t in pred.targets(i))]
    pred.models = {i: pred.models[i] for i in sources}
    t0 = time.time()
    per_layer: dict[str, Any] = {}
    gen = torch.Generator().manual_seed(cfg.seed)
    bar = tqdm(
        total=len(sources) * cfg.epochs,
        desc=f"learned {cfg.kind} p{gate.lookahead}",
        disable=not progress,
        unit="epoch",
        leave=False,
    )
    for layer in sources:
        targets = pred.targets(layer)
        h = train.gate_inputs[layer].float()
        y = torch.stack([_khot(train.expert_ids[t], e) for t in targets])  # [P, N, E]
        vh = val.gate_inputs[layer].float()
        vids = torch.stack([val.expert_ids[t] for t in targets])  # [P, Nv, k]
        vy = torch.stack([_khot(val.expert_ids[t], e) for t in targets])
        model = pred.models[layer].train()
        if cfg.standardize:
            model.standardize(h)
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        steps = cfg.epochs * math.ceil(h.shape[0] / cfg.batch_size)
        sched = (
            torch.optim.lr_scheduler.OneCycleLR(opt, cfg.lr, total_steps=steps, pct_start=0.3)
            if cfg.schedule == "onecycle"
            else None
        )
        first = _score(pred, layer, vh, vids, vy, cfg.loss)
        best, best_epoch = first, 0
        best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        best_loss, last_gain = first[2], 0  # patience counts epochs improving neither exact match nor loss
        epoch = 0
        for epoch in range(1, cfg.epochs + 1):
            order = torch.randperm(h.shape[0], generator=gen)
            for s in range(0, h.shape[0], cfg.batch_size):
                idx = order[s : s + cfg.batch_size]
                x = h[idx]
                if cfg.previous_input and cfg.previous_dropout > 0:
                    drop = torch.rand(len(idx), generator=gen) < cfg.previous_dropout
                    keep = width - pred.hidden_size  # the previous input is the last block
                    x = torch.cat([x[:, :keep], x[:, keep:] * ~drop[:, None]], 1)
                logits = model(x).view(len(idx), len(targets), e).transpose(0, 1)
                loss = _loss(logits, y[:, idx], cfg.loss)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                if sched is not None:
                    sched.step()
            score = _score(pred, layer, vh, vids, vy, cfg.loss)
            bar.update(1)
            bar.set_postfix(layer=layer, val_exact=f"{score[0]:.3f}", best=f"{best[0]:.3f}")
            if (score[0], score[1], -score[2]) > (best[0], best[1], -best[2]):
                best, best_epoch, last_gain = score, epoch, epoch
                best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            if score[2] < best_loss - 1e-4:
                best_loss, last_gain = score[2], epoch
            if epoch - last_gain >= cfg.patience:
                break
        bar.update(cfg.epochs - epoch)
        model.load_state_dict(best_state)
        model.fold_standardization()
        model.eval()
        del h, y, vh, vids, vy  # before the next layer's inputs are built: one layer's rows resident at a time
        per_layer[str(layer)] = {
            "targets": list(targets),
            "epochs": epoch,
            "best_epoch": best_epoch,
            "val_exact_init": first[0],
            "val_exact": best[0],
            "val_recall_init": first[1],
            "val_recall": best[1],
            "val_loss_init": first[2],
            "val_loss": best[2],
        }
    bar.close()
    pred.meta["training"] = {
        "config": asdict(cfg) | {"rank": pred.meta.get("rank", 0)},
        "train_tokens": train.tokens,
        "val_tokens": val.tokens,
        "seconds": round(time.time() - t0, 2),
    }
    pred.meta["metrics"] = {"validation": per_layer}
    return pred
