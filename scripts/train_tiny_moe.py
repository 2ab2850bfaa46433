"""Train the bundled tiny MoE language model on the Python standard library's sources.

The model is a Qwen1.5-MoE style network (``model_type = qwen2_moe``: routed experts plus a
sigmoid-gated shared expert) small enough to ship in the package (< 32 MB in bf16) but trained
long enough that its expert routing is real. Everything it needs exists offline: the corpus is the
``.py`` files of the running interpreter's standard library, the tokenizer is a byte-level BPE
trained here with ``tokenizers``.

transformers is used for training only (it is a test/training dependency, never a runtime one): its
``Qwen2MoeForCausalLM`` gives the reference forward pass and the load-balancing auxiliary loss, and
``save_pretrained`` writes the Hugging Face layout our runtime reads.

    python scripts/train_tiny_moe.py --out fate_edge/assets/tiny-moe --minutes 70
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shlex
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from fate_edge import corpus

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML, the template Qwen models use; rendered by fate_edge's sandboxed jinja2 environment.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass
class TrainConfig:
    architecture: str = "qwen2_moe"  # or "mixtral": no shared expert, experts of moe_intermediate_size
    vocab_size: int = 4096  # byte-level BPE; small so the embeddings stay a minor share of bytes
    hidden_size: int = 192
    num_hidden_layers: int = 8
    num_attention_heads: int = 4  # head_dim 48
    num_key_value_heads: int = 2  # GQA, so the runtime's grouped attention is exercised
    num_experts: int = 16
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 128
    shared_expert_intermediate_size: int = 256
    max_position_embeddings: int = 1024
    seq_len: int = 256
    batch_size: int = 16
    lr: float = 2e-3
    warmup_steps: int = 100
    router_aux_loss_coef: float = 0.01  # Switch-Transformer load-balancing loss weight
    heldout_fraction: float = 0.02  # files whose name hashes below this go to the held-out split (fate_edge.corpus)
    max_corpus_bytes: int = 32_000_000  # characters of stdlib source read, files in path order
    seed: int = 0


def config_with(cfg: TrainConfig, overrides: list[str]) -> TrainConfig:
    """``cfg`` with FIELD=VALUE overrides applied, each VALUE parsed as its field's type."""
    types = {f.name: f.type for f in fields(TrainConfig)}
    for item in overrides:
        name, sep, value = item.partition("=")
        if not sep or name not in types:
            raise SystemExit(f"--set {item!r}: expected FIELD=VALUE with FIELD one of {', '.join(types)}")
        kind = {"int": int, "float": float}.get(str(types[name]), str)
        try:
            setattr(cfg, name, kind(value))
        except ValueError:
            raise SystemExit(f"--set {item!r}: {value!r} is not a valid {kind.__name__}") from None
    return cfg


def read_corpus(cfg: TrainConfig) -> tuple[list[str], list[str]]:
    """(training, held-out) stdlib texts: the split of ``fate_edge.corpus`` under this config's settings."""
    return corpus.read_corpus(corpus.CorpusSplit(cfg.heldout_fraction, cfg.max_corpus_bytes))


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def encode_all(tok, texts: list[str]) -> torch.Tensor:
    eos = tok.token_to_id("<|endoftext|>")
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def build_model(cfg: TrainConfig, eos_id: int):
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM

    if cfg.architecture not in ("qwen2_moe", "mixtral"):
        raise SystemExit(f"--set architecture={cfg.architecture}: expected qwen2_moe or mixtral")
    common = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        num_experts_per_tok=cfg.num_experts_per_tok,
        output_router_logits=True,
        router_aux_loss_coef=cfg.router_aux_loss_coef,
        tie_word_embeddings=False,
        rope_theta=10000.0,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
    )
    torch.manual_seed(cfg.seed)
    if cfg.architecture == "mixtral":  # routed experts only, each of moe_intermediate_size
        return MixtralForCausalLM(
            MixtralConfig(
                **common,
                intermediate_size=cfg.moe_intermediate_size,
                num_local_experts=cfg.num_experts,
                sliding_window=None,
            )
        )
    return Qwen2MoeForCausalLM(
        Qwen2MoeConfig(
            **common,
            intermediate_size=cfg.shared_expert_intermediate_size,
            num_experts=cfg.num_experts,
            moe_intermediate_size=cfg.moe_intermediate_size,
            shared_expert_intermediate_size=cfg.shared_expert_intermediate_size,
            norm_topk_prob=False,
            decoder_sparse_step=1,
        )
    )


@torch.no_grad()
def evaluate(model, data: torch.Tensor, cfg: TrainConfig, max_batches: int = 20) -> float:
    model.eval()
    losses = []
    n = (len(data) - 1) // cfg.seq_len
    for b in range(min(n, max_batches * cfg.batch_size) // cfg.batch_size):
        starts = range(b * cfg.batch_size * cfg.seq_len, (b + 1) * cfg.batch_size * cfg.seq_len, cfg.seq_len)
        x = torch.stack([data[s : s + cfg.seq_len] for s in starts])
        out = model(input_ids=x, labels=x, output_router_logits=False)
        losses.append(out.loss.item())
    model.train()
    return sum(losses) / max(1, len(losses))


def save(model, tok, out: Path, cfg: TrainConfig, log: list[dict], meta: dict) -> None:
    from transformers import PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    model.config.output_router_logits = False
    # Ship bf16 (half the bytes); the fp32 training weights stay untouched.
    model.config.dtype = "bfloat16"
    model.save_pretrained(out, state_dict={k: v.to(torch.bfloat16) for k, v in model.state_dict().items()})
    model.config.output_router_logits = True
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        bos_token=None,
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    # transformers 5 writes the template to chat_template.jinja; older readers look in tokenizer_config.json.
    tc_path = out / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc["chat_template"] = CHAT_TEMPLATE
    tc_path.write_text(json.dumps(tc, indent=2))
    eos = tok.token_to_id("<|endoftext|>")
    im_end = tok.token_to_id("<|im_end|>")
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": eos, "eos_token_id": [eos, im_end], "do_sample": False}, indent=2)
    )
    (out / "training_log.json").write_text(json.dumps({"config": asdict(cfg), **meta, "log": log}, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("fate_edge/assets/tiny-moe"))
    ap.add_argument("--minutes", type=float, default=70.0, help="wall-clock training budget")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument(
        "--resume",
        type=Path,
        default=None,
        help="continue training the model saved in this directory (same tokenizer, a new LR schedule)",
    )
    ap.add_argument("--lr", type=float, default=None, help="peak learning rate (default: TrainConfig.lr)")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a TrainConfig field, e.g. --set num_experts=8 --set hidden_size=256 "
        "(a second trained model to measure predictors on; the bundled one uses the defaults)",
    )
    args = ap.parse_args()
    cfg = config_with(TrainConfig(), args.set)
    torch.set_num_threads(args.threads)
    random.seed(cfg.seed)

    t0 = time.time()
    train_texts, heldout_texts = read_corpus(cfg)
    if args.resume:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(args.resume / "tokenizer.json"))
    else:
        tok = train_tokenizer(train_texts, cfg.vocab_size)
    if args.lr:
        cfg.lr = args.lr
    train_ids, heldout_ids = encode_all(tok, train_texts), encode_all(tok, heldout_texts)
    print(
        f"corpus: {len(train_texts)} train files ({len(train_ids)} tokens), "
        f"{len(heldout_texts)} held-out files ({len(heldout_ids)} tokens), {time.time() - t0:.0f}s",
        flush=True,
    )

    log: list[dict] = []
    step, tokens, seconds_before = 0, 0, 0.0
    commands = [shlex.join(["python", *sys.argv])]  # how this model was made, for its model card's "Reproduce"
    if args.resume:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.resume, dtype=torch.float32)
        model.config.output_router_logits = True
        previous = json.loads((args.resume / "training_log.json").read_text())
        log = previous["log"]
        step, tokens = previous["steps"], previous["train_tokens"]
        seconds_before = previous["train_seconds"]
        commands = previous.get("commands", []) + commands
        log.append({"resumed_at_step": step, "lr": cfg.lr})
    else:
        model = build_model(cfg, tok.token_to_id("<|endoftext|>"))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.1)
    budget_s = args.minutes * 60
    start = time.time()
    gen = torch.Generator().manual_seed(cfg.seed + step)
    first_step = step
    while time.time() - start < budget_s:
        # Cosine schedule over the wall-clock budget, so the run ends annealed whatever its speed.
        frac = (time.time() - start) / budget_s
        warm = min(1.0, (step - first_step + 1) / cfg.warmup_steps)
        lr = cfg.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, len(train_ids) - cfg.seq_len - 1, (cfg.batch_size,), generator=gen)
        x = torch.stack([train_ids[s : s + cfg.seq_len] for s in starts.tolist()])
        out = model(input_ids=x, labels=x)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens += x.numel()
        if step % 20 == 0:
            elapsed = round(seconds_before + time.time() - start, 1)
            entry = {
                "step": step,
                "tokens": tokens,
                "seconds": elapsed,
                "lr": lr,
                "loss": round(out.loss.item(), 4),
                "aux_loss": round(out.aux_loss.item(), 4),
            }
            if step % args.eval_every == 0:
                entry["heldout_loss"] = round(evaluate(model, heldout_ids, cfg), 4)
            log.append(entry)
            print(json.dumps(entry), flush=True)
        if step % 1000 == 0:
            save(
                model,
                tok,
                args.out,
                cfg,
                log,
                {
                    "complete": False,
                    "steps": step,
                    "train_tokens": tokens,
                    "train_seconds": round(seconds_before + time.time() - start),
                    "commands": commands,
                },
            )
    final = evaluate(model, heldout_ids, cfg, max_batches=50)
    meta = {
        "complete": True,
        "steps": step,
        "train_tokens": tokens,
        "train_seconds": round(seconds_before + time.time() - start),
        "heldout_loss": final,
        "heldout_ppl": math.exp(final),
        "threads": args.threads,
        "corpus": f"Python {sysconfig.get_python_version()} standard library .py files",
        "commands": commands,
    }
    save(model, tok, args.out, cfg, log, meta)
    print(json.dumps({k: v for k, v in meta.items()}), flush=True)


if __name__ == "__main__":
    main()
