"""What the parity tests against transformers share (tests/test_parity.py, test_parity_recurrent.py and the families
that import from them): the per-expert checkpoint rewritten into transformers 5's fused layout, transformers'
reference run, our greedy decode (in prompt chunks), a sequence served alone, and batched steps against it."""

from __future__ import annotations

import re
import shutil
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

NEW_TOKENS = 16
FP32_ATOL = 1e-4

_EXPERT_KEY = re.compile(r"^(.*)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_ROLE = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


def fuse_checkpoint(src: Path, dst: Path) -> None:
    """Rewrite a per-expert checkpoint into transformers 5's fused expert layout (Mixtral: under ``mlp.``)."""
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix == ".json":
            shutil.copy(f, dst / f.name)
    tensors = load_file(src / "model.safetensors")
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = defaultdict(lambda: defaultdict(dict))
    for name, t in tensors.items():
        m = _EXPERT_KEY.match(name)
        if m:
            experts[m.group(1)][int(m.group(2))][_ROLE[m.group(3)]] = t
        else:
            out[name.replace(".block_sparse_moe.", ".mlp.")] = t
    assert experts, "save_pretrained wrote no per-expert tensors"
    for prefix, by_index in experts.items():
        prefix = prefix.replace(".block_sparse_moe", ".mlp")
        order = sorted(by_index)
        assert order == list(range(len(order)))
        out[f"{prefix}.experts.gate_up_proj"] = torch.stack(
            [torch.cat([by_index[j]["gate"], by_index[j]["up"]], dim=0) for j in order]
        )
        out[f"{prefix}.experts.down_proj"] = torch.stack([by_index[j]["down"] for j in order])
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})


@contextmanager
def one_quiet_thread() -> Iterator[None]:
    """Tiny matrices: one thread is ~50x faster than several fighting over loaded cores. No progress bars."""
    import transformers

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()
    try:
        yield
    finally:
        transformers.utils.logging.enable_progress_bar()
        torch.set_num_threads(n)


@dataclass
class Reference:
    prefill: torch.Tensor  # transformers' logits over the prompt [1, T, V]
    tokens: list[int]  # its NEW_TOKENS greedy tokens
    step_logits: list[torch.Tensor]  # the logits each greedy token was picked from [V]


def hf_reference(hf, prompt: torch.Tensor, fresh: Callable[[], None] = lambda: None) -> Reference:
    """transformers' logits over ``prompt`` and its greedy decode (``fresh``: called before each, to reset state
    transformers keeps between calls)."""
    fresh()
    with torch.no_grad():
        prefill = hf(prompt).logits
    fresh()
    with torch.no_grad():
        out = hf.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            eos_token_id=None,  # the config has none either: every token is generated
            pad_token_id=0,
            return_dict_in_generate=True,
            output_logits=True,
        )
    tokens = out.sequences[0, prompt.shape[1] :].tolist()
    assert len(tokens) == NEW_TOKENS
    return Reference(prefill, tokens, [lg[0] for lg in out.logits])


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def record_routing(model) -> list[tuple[int, torch.Tensor]]:
    """(layer, expert ids [N, k]) of every MoE layer the model runs from now on."""
    seen: list[tuple[int, torch.Tensor]] = []
    model.observers.append(lambda layer, h, idx, w: seen.append((layer, idx.clone())))
    return seen


def our_greedy(model, prompt: torch.Tensor, chunks: list[int] | None = None) -> tuple[list[int], list[torch.Tensor]]:
    """The prompt (in chunks of the given sizes, the cache carried between them; default whole), then
    NEW_TOKENS one-token greedy decode steps on the cache → the tokens and the logits each was picked from."""
    cache = model.new_cache()
    at = 0
    for n in chunks or [prompt.shape[1]]:
        logits = model(prompt[:, at : at + n], cache, last_only=True)[0, -1]
        at += n
    assert at == prompt.shape[1]
    tokens, steps = [], []
    for _ in range(NEW_TOKENS):
        steps.append(logits)
        tokens.append(int(logits.argmax()))
        logits = model(torch.tensor([[tokens[-1]]]), cache)[0, -1]
    return tokens, steps


def _alone(model, prompt: list[int], n: int) -> list[torch.Tensor]:
    """A sequence served by itself: its prompt's last logits, then ``n`` greedy decode steps' logits."""
    cache = model.new_cache()
    steps = [model(torch.tensor([prompt]), cache, last_only=True)[0, -1]]
    for _ in range(n):
        steps.append(model(torch.tensor([[int(steps[-1].argmax())]]), cache)[0, -1])
    return steps


def batched_with_a_joiner(model, slab, prompts: list[list[int]], n: int, capacity: int) -> tuple[list, list]:
    """Greedy steps of ``prompts[0]`` and ``prompts[1]`` on ranges of ``slab`` (``capacity`` positions each), the
    third joining with its whole prompt in the step of the others' first decode tokens → each sequence's logits
    rows, its prompt's last and ``n`` decode steps', and the three segments (their caches)."""
    from fate_edge.model.batch_step import Segment, forward_segments

    segs = [Segment(p, slab.allocate(capacity)) for p in prompts[:2]]
    got: list[list[torch.Tensor]] = [[], [], []]
    for step in range(n + 2):
        live = [j for j in range(len(segs)) if len(got[j]) <= n]
        for j, row in zip(live, forward_segments(model, [segs[j] for j in live])):
            got[j].append(row)
            segs[j].ids = [int(row.argmax())]
        if step == 0:
            segs.append(Segment(prompts[2], slab.allocate(capacity)))
    return got, segs


def check_batched_steps_match_alone(model, prompt: torch.Tensor) -> None:
    """Two prompts of different lengths in one step (``batch_step.forward_segments``), a third joining beside their
    decode tokens, then decode steps of all three, on caches that are ranges of one KV slab: every step's logits
    are each sequence's alone (fp32), its greedy tokens the same."""
    from fate_edge.model.kv_slab import KVSlab

    full = prompt[0].tolist()
    prompts, n = [full, full[:5], full[3:10]], 6
    expected = [_alone(model, p, n) for p in prompts]
    slab = KVSlab(model, 3 * 32)
    # layers that keep a recurrent state hold no rows of the slab (each sequence's own state)
    assert all(slab.buffers[i] == [] for i, t in enumerate(model.config.layer_types) if t != "attention")
    got, segs = batched_with_a_joiner(model, slab, prompts, n, 32)
    for j, (ours, alone) in enumerate(zip(got, expected)):
        assert len(ours) == n + 1
        diff = max(max_diff(a, b) for a, b in zip(ours, alone))
        assert diff <= FP32_ATOL, f"sequence {j}: batched logits differ from alone by {diff:.3g}"
        assert [int(a.argmax()) for a in ours] == [int(b.argmax()) for b in alone]
        assert segs[j].cache.length == len(prompts[j]) + n
