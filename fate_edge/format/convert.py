"""``fate-edge convert``: a Hugging Face MoE checkpoint → an expert store (see ``fate_edge.format.store``).

Atomic: everything is written into a hidden sibling directory, flushed, and renamed into place as the
last step, so an interrupted convert never leaves a directory that looks like a valid store. A hidden
directory left by a convert that was killed is removed by the next convert into the same directory.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import itertools
import json
import logging
import os
import shutil
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import cast

import torch
from tqdm import tqdm

from fate_edge.errors import ConvertStopped, FateEdgeError
from fate_edge.format.background import Background
from fate_edge.format.blob_writer import BlobWriter
from fate_edge.format.checkpoint import CheckpointReader, save_streaming
from fate_edge.format.checkpoint_experts import ExpertLayout, layouts_of
from fate_edge.format.checkpoint_layout import layer_names, resident_weight_names
from fate_edge.format.checksum import crc32
from fate_edge.format.direct_write import DirectFile
from fate_edge.format.store import FORMAT, FORMAT_VERSION, STORE_FILE, Precision, as_mxfp4, encode_expert, plan_parts
from fate_edge.format.work_dirs import make_work_dir, remove_dead_work_dirs, replace_dir
from fate_edge.model.arch import ModelConfig, load_config
from fate_edge.model.transformer import LayerNames
from fate_edge.quant import QuantSpec
from fate_edge.quant.linear import default_kernel, host_int4_block_rows, int4_supported
from fate_edge.quant.rtn import BLOCK_BYTES
from fate_edge.sizes import format_bytes

AUX_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


# The default store's resident precisions, chosen on measured quality and memory (docs/quantization.md#the-default-
# store): linears int4 (lm_head included: int8 would add its whole size to every run's peak); the embedding table
# int8, which costs disk only (a run reads the rows it gathers from the file and holds none: memory_account) and
# measured better than int4 (bundled model: perplexity 6.518 against 6.537). A table tied to the head is the head
# too, read whole every token: it takes the head's precision (write_store).
RESIDENT_BITS = 4
EMBEDDING_BITS = 8


@dataclass
class ConvertOptions:
    bits: int | None = 4  # precision of the expert copies the engine streams (None: 4, or a GGUF's own width)
    group_size: int | None = None  # None: the largest of GROUP_SIZES that divides the expert dimensions
    cold_bits: int | None = None  # optional low-precision copy for cold experts (Fate: int2 tail)
    cold_group_size: int | None = None  # None: the smallest of GROUP_SIZES that divides (int2 wants small groups)
    # also store bf16 experts: the full-precision / load-on-demand baselines read them, the default policy never does
    keep_bf16: bool = False
    force: bool = False  # replace an existing store at the destination
    method: str = "rtn"  # "rtn" (Fate's round-to-nearest) or "hqq" (half-quadratic refinement): same format
    layout: str = "auto"  # streamed copy: portable | cpu-int4 (torch's kernel layout) | auto (portable where
    # fate-edge's native int4 kernel is the default here, else cpu-int4 where torch's kernel takes the shapes)
    threads: int | None = None  # experts encoded in parallel (None: the CPU count, at most 8)
    # 8 or 4: resident linears quantized here, read as they are at load; None: as in the checkpoint. The default, 4,
    # is what eval-quality measured beside the float copy (docs/quantization.md#the-default-store)
    resident_bits: int | None = RESIDENT_BITS
    embedding_bits: int | None = EMBEDDING_BITS  # 8 or 4: the embedding table quantized here (model/embedding.py)
    # lm_head's own precision (8 or 4); None: resident_bits. A GGUF's tensors keep their own width where it is
    # 4 or 8 bits (gguf_convert.resident_widths)
    head_bits: int | None = None

    @classmethod
    def full(cls, **kw) -> ConvertOptions:
        """The store the baselines read (the bench, the demo): bf16 experts kept and the resident weights as in the
        checkpoint, so a run may quantize them at load as it asks."""
        return cls(**{"keep_bf16": True, "resident_bits": None, "embedding_bits": None} | kw)


GROUP_SIZES = (128, 64, 32)  # quantization groups convert offers, largest (fewest scales) first


def pick_group(dims: tuple[int, ...], requested: int | None, option: str = "--group", smallest: bool = False) -> int:
    """``requested`` if it divides every dimension, else an error naming the groups that do; without a request,
    the largest of GROUP_SIZES that divides them all (``smallest``: the smallest)."""
    fits = [g for g in GROUP_SIZES if all(d % g == 0 for d in dims)]
    shape = "x".join(map(str, dims))
    if requested is None and fits:
        return fits[-1] if smallest else fits[0]
    if requested is not None and requested in fits:
        return requested
    if not fits:
        raise FateEdgeError(
            f"expert dimensions {shape} are not multiples of {GROUP_SIZES[-1]}, the smallest "
            f"quantization group fate-edge supports ({', '.join(map(str, GROUP_SIZES))})"
        )
    raise FateEdgeError(
        f"{option} {requested} does not divide the expert dimensions {shape}; use {option} "
        + " or ".join(map(str, fits))
    )


def with_groups(opts: ConvertOptions, dims: tuple[int, ...]) -> ConvertOptions:
    """``opts`` with its quantization groups settled for experts of ``dims``: the streamed copy's (asked for, or
    the largest that divides) and the cold copy's (asked for, or the smallest that divides: int2 wants small
    groups); an error names the groups that fit when one asked for does not."""
    group = pick_group(dims, opts.group_size)
    cold = opts.cold_group_size
    if opts.cold_bits is not None:
        cold = pick_group(dims, cold, "--cold-group", smallest=True)
    return replace(opts, group_size=group, cold_group_size=cold)


def _precisions(cfg, opts: ConvertOptions) -> list[Precision]:
    h, inter = cfg.hidden_size, cfg.moe_intermediate_size
    wanted: list[tuple[int, QuantSpec | None]] = []
    if opts.keep_bf16:
        wanted.append((16, None))
    hot_bits = opts.bits
    assert hot_bits is not None  # convert() resolves None first
    hot = QuantSpec(hot_bits, opts.group_size)
    wanted.append((hot_bits, hot))
    if opts.cold_bits is not None and opts.cold_bits != opts.bits:
        wanted.append((opts.cold_bits, QuantSpec(opts.cold_bits, opts.cold_group_size)))
    cpu = torch.device("cpu")
    shapes = ((inter, h), (h, inter))
    native = all(int4_supported(shape, hot, cpu) for shape in shapes)
    # auto: portable where fate-edge's own kernel is the default here (it computes on those bytes directly)
    portable_wins = all(default_kernel(shape, hot, cpu) == "native-int4" for shape in shapes)
    if opts.layout == "cpu-int4" and not native:
        raise FateEdgeError(
            f"--layout cpu-int4 needs int2-4 bits and shapes torch's CPU int4 kernel takes; "
            f"int{opts.bits} with expert {inter}x{h} does not fit: use --layout portable"
        )
    out = []
    for bits, spec in wanted:
        # Only the streamed (hot) copy takes the kernel layout; cold copies stay small on the link.
        wants_kernel_layout = opts.layout == "cpu-int4" or (opts.layout == "auto" and not portable_wins)
        layout = "cpu-int4" if bits == opts.bits and wants_kernel_layout and native else "portable"
        parts, nbytes = plan_parts(bits, spec, h, inter, layout, bias=cfg.expert_bias)
        rows = host_int4_block_rows() if layout == "cpu-int4" else 0  # the order this CPU's packer writes
        if layout == "cpu-int4" and not rows:  # neither known order: no other CPU could tell how to read it
            raise FateEdgeError(
                "torch's CPU int4 packer here writes neither block order fate-edge knows (64 or 32 rows); "
                "use --layout portable"
            )
        out.append(Precision(bits, f"experts-{bits}.bin", nbytes, parts, spec, layout, block_rows=rows))
    return out


def convert(
    model_dir: str | Path,
    out_dir: str | Path,
    opts: ConvertOptions | None = None,
    progress: bool = True,
    on_progress: Callable[[int, int], None] | None = None,
) -> Path:
    """Write the expert store of ``model_dir`` into ``out_dir``, streaming: one tensor block or a few experts
    are in memory at a time. ``progress`` shows a bar on a terminal; ``on_progress(done, total)`` gets the
    checkpoint bytes converted so far after every resident tensor and every expert."""
    opts = opts or ConvertOptions()
    if opts.bits is None:
        opts = replace(opts, bits=4)
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if out_dir.exists() and not opts.force:
        raise FateEdgeError(f"{out_dir}: already exists; choose another directory or pass --force to replace it")
    cfg = load_config(model_dir)
    reader = CheckpointReader(model_dir, drop_cache=True)  # each byte is read once: keep no page cache of it
    names = layer_names(cfg, reader)
    dims = (cfg.hidden_size, cfg.moe_intermediate_size)
    asked = opts.group_size
    opts = with_groups(opts, dims)
    if asked is None and progress:
        print(
            f"quantization group {opts.group_size}: the largest of {', '.join(map(str, GROUP_SIZES))} that "
            f"divides the expert dimensions {dims[0]}x{dims[1]}",
            file=sys.stderr,
        )
    layouts = layouts_of(cfg, reader, names)
    for layout in layouts.values():
        layout.check_shapes(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
    expert_src = sum(reader.nbytes(n) for n in layouts[cfg.moe_layers[0]].tensor_names(0)) if cfg.moe_layers else 0
    if cfg.moe_layers and layouts[cfg.moe_layers[0]].fused:  # a fused tensor holds every expert of the layer
        expert_src //= cfg.num_experts
    aux = [model_dir / f for f in AUX_FILES if (model_dir / f).exists()]
    predictors = model_dir / "predictors"
    aux_bytes = sum(f.stat().st_size for f in aux)
    if predictors.is_dir():
        aux_bytes += sum(f.stat().st_size for f in predictors.rglob("*") if f.is_file())

    def write_aux(tmp: Path) -> None:
        for f in aux:
            shutil.copy2(f, tmp / f.name)
        if predictors.is_dir():  # calibrated predictors travel with the model
            shutil.copytree(predictors, tmp / "predictors")

    def encode(layer: int, expert: int, precisions: list[Precision], method: str):
        return _encode_job(layouts[layer], expert, precisions, method)

    source = StoreSource(model_dir, cfg, reader, names, expert_src, encode, write_aux, aux_bytes)
    precisions = _precisions(cfg, opts)
    if opts.layout == "auto" and any(lay.mxfp4 for lay in layouts.values()):  # gpt-oss's MXFP4: kept as published
        precisions = [as_mxfp4(p, *dims) if p.bits == 4 and p.spec is not None else p for p in precisions]
    return write_store(source, out_dir, opts, precisions, progress, on_progress)


@dataclass
class StoreSource:
    """What writing a store needs of a model, whatever its file format (a Hugging Face directory, a GGUF)."""

    path: Path  # recorded in store.json
    cfg: ModelConfig
    reader: CheckpointReader  # or anything answering its calls: the resident tensors by Hugging Face name
    names: list[LayerNames]
    expert_bytes: int  # source bytes of one routed expert (progress)
    encode: Callable[[int, int, list[Precision], str], list[tuple[memoryview, int]]]  # (layer, expert, ...) -> blobs
    write_aux: Callable[[Path], None]  # config, tokenizer and other files, into the new store
    aux_bytes: int
    # a resident group's own width where the source fixes one (a GGUF tensor's), else None: ConvertOptions decides
    widths: Callable[[list[str]], int | None] | None = None


def write_store(
    src: StoreSource,
    out_dir: Path,
    opts: ConvertOptions,
    precisions: list[Precision],
    progress: bool = True,
    on_progress: Callable[[int, int], None] | None = None,
) -> Path:
    """Write ``src`` as a store at ``out_dir``: into a hidden sibling first, renamed into place as the last step;
    on any failure nothing is left at ``out_dir`` (an existing store there is kept)."""
    cfg, reader = src.cfg, src.reader
    remove_dead_work_dirs(out_dir.parent)
    names_resident = resident_weight_names(cfg, reader)
    if tied_head(cfg, names_resident) and opts.embedding_bits is not None:
        head = opts.head_bits or opts.resident_bits  # the table is the head too: the head's precision
        if head is not None:
            opts = replace(opts, embedding_bits=head)
    experts_bytes = len(cfg.moe_layers) * cfg.num_experts * sum(p.slot_bytes for p in precisions)
    need = experts_bytes + sum(reader.nbytes(n) for n in names_resident) + src.aux_bytes
    free = _check_free_space(out_dir.parent, need)
    disk = f"writing {out_dir}: needs about {format_bytes(need)} of disk, {format_bytes(free)} free there"
    if progress:
        print(f"[convert] {disk}", file=sys.stderr, flush=True)
    else:
        logging.getLogger("fate_edge.convert").info(disk)

    tmp = make_work_dir(out_dir)
    try:
        src.write_aux(tmp)
        jobs = [(layer, e) for layer in cfg.moe_layers for e in range(cfg.num_experts)]
        meter = _Progress(
            sum(reader.nbytes(n) for n in names_resident) + src.expert_bytes * len(jobs), progress, on_progress
        )
        # The resident part and the experts are written at once, the resident part on its own thread: each alone
        # leaves the disk (or the cores) half idle. One torch thread each while both run: the parallelism is across
        # experts and between the two parts, torch's own threads on top would oversubscribe the cores; the resident
        # part takes the process's torch threads back if it is still running once the experts are done.
        experts_done = threading.Event()
        threads = torch.get_num_threads()
        try:
            with _one_torch_thread():
                resident = Background(
                    lambda stop: _write_resident(
                        src, names_resident, tmp / "resident.safetensors", opts, meter, stop, (experts_done, threads)
                    ),
                    "convert-resident",
                )
                try:
                    entries = _write_experts(
                        tmp, jobs, src.encode, precisions, opts, lambda: meter.advance(src.expert_bytes), resident
                    )
                    experts_done.set()
                    resident.result()
                except BaseException:
                    resident.cancel()  # it writes nothing more into tmp, removed below
                    raise
        finally:
            meter.close()

        # store.json is written last: a directory without it is never taken for a store.
        (tmp / STORE_FILE).write_text(json.dumps(store_index(src, opts, precisions, entries), indent=1))
        _set_file_modes(tmp)
        replace_dir(tmp, out_dir)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if _is_disk_full(exc):
            raise FateEdgeError(
                f"{out_dir.parent}: no space left on the device while writing the store (it needs "
                f"about {format_bytes(need)}); free space or convert into another directory"
            ) from exc
        raise
    return out_dir


def tied_head(cfg: ModelConfig, names: list[str]) -> bool:
    """Whether the model's head multiplies by its embedding table (no lm_head of its own)."""
    return cfg.tie_word_embeddings or "lm_head.weight" not in names


def _write_resident(
    src: StoreSource,
    names: list[str],
    path: Path,
    opts: ConvertOptions,
    meter: _Progress,
    stop: threading.Event,
    widen: tuple[threading.Event, int],
) -> None:
    """resident.safetensors: streamed tensor by tensor as stored, or quantized once here (prequantized.py)."""
    reader = cast(CheckpointReader, _ResidentReader(src.reader, stop, *widen))  # answers the same calls
    if opts.resident_bits is None and opts.embedding_bits is None and opts.head_bits is None:
        save_streaming(reader, names, path, {"format": "pt"}, lambda _name, nbytes: meter.advance(nbytes))
    else:
        from fate_edge.format.resident_writer import resident_items, write_resident

        head = opts.head_bits

        def widths(group: list[str]) -> int | None:
            if group == ["lm_head"] and head is not None:
                return head
            if opts.resident_bits is None or src.widths is None:  # asked for float: float (lm_head aside)
                return None
            return src.widths(group)

        items = resident_items(src.cfg, reader, src.names, names, opts.resident_bits, opts.embedding_bits, widths)
        write_resident(path, items, reader)  # a group at a time: convert's memory stays small
        meter.advance(sum(src.reader.nbytes(n) for n in names))


class _ResidentReader:
    """``reader`` as the resident part's thread reads it. Before each tensor read: raise :class:`ConvertStopped` once
    ``stop`` is set (the experts' part failed: the resident part ends at once), and take ``threads`` torch threads
    once ``widen`` is set (the experts are done: the cores are the resident part's alone)."""

    def __init__(self, reader, stop: threading.Event, widen: threading.Event, threads: int):
        self._reader, self._stop, self._widen, self._threads = reader, stop, widen, threads

    def __getattr__(self, name: str):
        return getattr(self._reader, name)

    def __contains__(self, name: str) -> bool:
        return name in self._reader

    def _before_read(self) -> None:
        if self._stop.is_set():
            raise ConvertStopped("convert stopped")
        if self._widen.is_set() and torch.get_num_threads() != self._threads:
            torch.set_num_threads(self._threads)  # this thread's own count (torch keeps one per thread)

    def get(self, *args, **kwargs) -> torch.Tensor:
        self._before_read()
        return self._reader.get(*args, **kwargs)

    def get_rows(self, *args, **kwargs) -> torch.Tensor:
        self._before_read()
        return self._reader.get_rows(*args, **kwargs)

    def get_row(self, *args, **kwargs) -> torch.Tensor:
        self._before_read()
        return self._reader.get_row(*args, **kwargs)


def store_index(src: StoreSource, opts: ConvertOptions, precisions: list[Precision], entries: dict) -> dict:
    """The store's ``store.json``: the model's shape, the options it was written with, every blob's place."""
    cfg = src.cfg
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "source": str(src.path.resolve()),
        "model_type": cfg.model_type,
        "num_layers": cfg.num_hidden_layers,
        "moe_layers": cfg.moe_layers,
        "num_experts": cfg.num_experts,
        "hidden_size": cfg.hidden_size,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "quant_method": opts.method,
        "resident_bits": opts.resident_bits,
        "embedding_bits": opts.embedding_bits,
        "head_bits": opts.head_bits,
        "precisions": {str(p.bits): p.to_json() for p in precisions},
        "experts": entries,
    } | ({} if cfg.swiglu_limit is None else {"swiglu_limit": cfg.swiglu_limit, "swiglu_alpha": cfg.swiglu_alpha})


@contextlib.contextmanager
def _one_torch_thread():
    """Convert parallelises across experts; torch's own threads on top would oversubscribe the cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _encode_job(
    layout: ExpertLayout, expert: int, precisions: list[Precision], method: str
) -> list[tuple[memoryview, int]]:
    """One expert read from the checkpoint in its own dtype and encoded at every precision, with each blob's
    CRC32 (a worker's job: the checksum releases the GIL, so checksums run in parallel too)."""
    work = _encode_scratch()
    w = layout.read(expert, None)
    blobs = [encode_expert(w, p, method, work) for p in precisions]
    return [(b, crc32(b)) for b in blobs]


_scratch = threading.local()  # each worker's fp32 block buffer for the RTN encoder


def _encode_scratch() -> torch.Tensor:
    work = getattr(_scratch, "work", None)
    if work is None:
        work = _scratch.work = torch.empty(BLOCK_BYTES // 4, dtype=torch.float32)
    return work


def _write_experts(
    tmp: Path,
    jobs: list[tuple[int, int]],
    encode,
    precisions: list[Precision],
    opts: ConvertOptions,
    done,
    beside: Background | None = None,
) -> dict[str, list[dict]]:
    """Encode the experts on ``opts.threads`` workers and hand their blobs in slot order to the writer threads
    (``blob_writer``). At most 2 x threads experts are in flight and a few blobs queued, so memory stays a few
    experts' worth whatever the model's size. ``beside``: work running meanwhile; its failure stops this one."""
    threads = opts.threads or min(os.cpu_count() or 1, 8)
    entries: dict[str, list[dict]] = {str(p.bits): [] for p in precisions}
    files = {p.bits: DirectFile(tmp / p.file, p.slot_bytes) for p in precisions}  # closed below
    pool = ThreadPoolExecutor(threads, thread_name_prefix="convert")
    writer = BlobWriter()
    try:

        def submit(item: tuple[int, tuple[int, int]]):
            slot, (layer, e) = item
            return slot, layer, e, pool.submit(encode, layer, e, precisions, opts.method)

        ahead = iter(enumerate(jobs))
        pending = collections.deque(map(submit, itertools.islice(ahead, 2 * threads)))
        while pending:
            slot, layer, e, fut = pending.popleft()
            blobs = fut.result()
            if beside is not None:
                beside.check()
            pending.extend(map(submit, itertools.islice(ahead, 1)))  # keep the workers fed
            for p, (blob, crc) in zip(precisions, blobs):
                offset = slot * p.slot_bytes
                writer.put(files[p.bits], blob, offset)
                entries[str(p.bits)].append(
                    {"layer": layer, "expert": e, "offset": offset, "length": len(blob), "crc32": crc}
                )
            del blobs
            done()
        writer.close()
        for p in precisions:  # pad to a whole slot so the last O_DIRECT read is in bounds
            files[p.bits].truncate(len(jobs) * p.slot_bytes)
    finally:
        writer.abort()  # no writer touches the files below (a no-op after close())
        pool.shutdown(wait=True, cancel_futures=True)
        for f in files.values():
            f.close()
    return entries


class _Progress:
    """Bytes of the checkpoint converted so far: a tqdm bar with rate and ETA on a terminal, and the caller's
    ``on_progress(done, total)``."""

    def __init__(self, total: int, bar: bool, callback=None):
        self.total, self.done, self.callback = total, 0, callback
        self.lock = threading.Lock()
        self.bar = tqdm(
            total=total,
            desc="converting",
            unit="B",
            unit_scale=True,
            file=sys.stderr,
            disable=None if bar else True,
            mininterval=0.5,
        )

    def advance(self, nbytes: int) -> None:
        with self.lock:  # the resident part and the experts' advance from their own threads
            self.done += nbytes
            self.bar.update(nbytes)
            if self.callback is not None:
                self.callback(self.done, self.total)

    def close(self) -> None:
        self.bar.close()


def _set_file_modes(directory: Path) -> None:
    """One mode for every file of the store, as a plain open() would create it under this umask (safetensors
    writes 0600 and copy2 keeps the source's mode)."""
    mask = os.umask(0o022)
    os.umask(mask)
    for f in directory.rglob("*"):
        if f.is_file():
            f.chmod(0o666 & ~mask)


def _is_disk_full(exc: BaseException) -> bool:
    """ENOSPC as an OSError, or as safetensors reports it (its own error type, "... (os error 28)")."""
    if isinstance(exc, OSError):
        return exc.errno == errno.ENOSPC
    return isinstance(exc, Exception) and f"os error {errno.ENOSPC})" in str(exc)


def _check_free_space(directory: Path, need: int) -> int:
    """The bytes free where ``directory`` will be; a refusal when ``need`` does not fit."""
    existing = directory
    while not existing.exists():  # the output's parents are created later
        existing = existing.parent
    free = shutil.disk_usage(existing).free
    if need > free:
        raise FateEdgeError(
            f"{directory}: the store needs about {format_bytes(need)} but only {format_bytes(free)} "
            "is free there; free space or convert into another directory"
        )
    return free
