"""GGUF files of a Hugging Face checkpoint for the llama.cpp peer: f32 and bf16 by llama.cpp's own converter
(``convert_hf_to_gguf.py`` from the llama-cpp-python sdist), q4_0 by ``llama_cpp.llama_model_quantize``; mxfp4 (a
gpt-oss checkpoint with MXFP4 experts) by the converter, which keeps the experts' blocks and writes the rest bf16.

Nothing of llama.cpp lives in this repository: the sdist is unpacked into the peers cache
(``~/.cache/fate-edge-peers``, or ``$FATE_EDGE_PEERS_CACHE``), and the GGUFs are cached there too, keyed by
the model's fingerprint, so a second run converts nothing.

    python -m fate_edge_lab.bench.gguf MODEL_DIR                    # prints the paths of the three GGUFs
    python -m fate_edge_lab.bench.gguf MODEL_DIR --types bf16,q4_0  # real-size checkpoints: no f32 file
    python -m fate_edge_lab.bench.gguf GPT_OSS_DIR --types mxfp4    # gpt-oss as published
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

from fate_edge.errors import FateEdgeError, PeerUnavailableError
from fate_edge.format.checkpoint import CheckpointReader
from fate_edge_lab.bench.prepare import _fingerprint

GGUF_TYPES = ("f32", "bf16", "q4_0", "mxfp4")
DEFAULT_TYPES = ("f32", "bf16", "q4_0")  # what any checkpoint converts to (mxfp4: gpt-oss's MXFP4 ones only)
CONVERTED = ("f32", "bf16", "mxfp4")  # written by the converter; q4_0 is quantized from one of them (quantize_source)
# the converter's --outtype per type: mxfp4 is gpt-oss's MXFP4 checkpoint, whose experts the converter keeps as they
# are (GptOssModel.repack_mxfp4) whatever --outtype the other tensors get
OUTTYPE = {"f32": "f32", "bf16": "bf16", "mxfp4": "bf16"}
FALLBACK_PRE_TOKENIZER = "gpt-2"  # byte-level BPE with GPT-2's split regex, as our tokenizers use
_VENDOR = "vendor/llama.cpp"
Q4_0_MIX = "q4_0-mix"  # our --outtype: see patch_q4_0_mix
# not made Q4_0 here: routers, output, and the recurrent layers' conv kernels (ggml's ssm_conv asserts F32 ones)
Q4_0_MIX_KEPT = (
    "FFN_GATE_INP",
    "FFN_GATE_INP_SHEXP",
    "POS_EMBD",
    "TOKEN_TYPES",
    "OUTPUT",
    "SSM_CONV1D",
    "SHORTCONV_CONV",
)


def peers_cache() -> Path:
    return Path(os.environ.get("FATE_EDGE_PEERS_CACHE") or Path.home() / ".cache" / "fate-edge-peers")


# How the measured peer was built: this CPU's instruction sets named one by one, AMX off. GGML_NATIVE=ON turns AMX on
# through -march=native whatever GGML_AMX_* say, and on VMs that report AMX but fault on its tile instructions that
# llama.cpp dies with SIGILL on its first q4_0 matmul.
PEER_CMAKE_HINT = (
    "-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON "
    "-DGGML_AVX512_VNNI=ON (and the other GGML_AVX* this CPU has) -DGGML_AMX_TILE=OFF "
    "-DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
)


def llama_cpp_missing() -> str | None:
    """Why the llama.cpp peer cannot run here, or None when llama-cpp-python imports."""
    if importlib.util.find_spec("llama_cpp") is None:
        return (
            "llama-cpp-python is not installed: pip install llama-cpp-python (builds llama.cpp, ~20 min; "
            f'the figures here used CMAKE_ARGS="{PEER_CMAKE_HINT}")'
        )
    return None


def sdist_candidates() -> list[Path]:
    """Where a llama-cpp-python sdist may be: $FATE_EDGE_LLAMACPP_SDIST, the peers cache, /tmp/llsrc."""
    env = os.environ.get("FATE_EDGE_LLAMACPP_SDIST")
    pats = [str(peers_cache() / "wheels" / "llama_cpp_python-*.tar.gz"), "/tmp/llsrc/llama_cpp_python-*.tar.gz"]
    found = [Path(p) for pat in pats for p in sorted(glob.glob(pat))]
    return ([Path(env)] if env else []) + found


def converter_dir(extract: bool = True) -> Path:
    """llama.cpp's source directory holding ``convert_hf_to_gguf.py``, unpacked from the sdist once."""
    for script in sorted(peers_cache().glob(f"src/*/{_VENDOR}/convert_hf_to_gguf.py")):
        if (script.parent / "conversion").is_dir() and (script.parent / "gguf-py").is_dir():
            return script.parent
    sdists = [p for p in sdist_candidates() if p.is_file()]
    if not sdists or not extract:
        raise PeerUnavailableError(
            "llama.cpp's converter (convert_hf_to_gguf.py) is not unpacked and no llama-cpp-python sdist was "
            f"found (looked in {', '.join(str(p) for p in sdist_candidates()) or peers_cache() / 'wheels'}); "
            "run `pip download --no-binary :all: --no-deps llama-cpp-python -d ~/.cache/fate-edge-peers/wheels` "
            "or set FATE_EDGE_LLAMACPP_SDIST to the .tar.gz"
        )
    dest = peers_cache() / "src"
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(sdists[0]) as tar:
        wanted = [m for m in tar.getmembers() if _is_converter_member(m.name)]
        tar.extractall(dest, members=wanted, filter="data")
    return converter_dir(extract=False)


def _is_converter_member(name: str) -> bool:
    parts = name.split("/", 1)
    rest = parts[1] if len(parts) == 2 else ""
    return rest == f"{_VENDOR}/convert_hf_to_gguf.py" or any(
        rest.startswith(f"{_VENDOR}/{d}/") for d in ("conversion", "gguf-py")
    )


def gguf_dir(model_dir: str | Path) -> Path:
    """Cache directory of one checkpoint's GGUFs: its name and fingerprint (files, sizes, mtimes, config)."""
    model_dir = Path(model_dir)
    cfg = (model_dir / "config.json").read_text() if (model_dir / "config.json").exists() else ""
    return peers_cache() / "gguf" / f"{model_dir.name}-{_fingerprint(model_dir, 'gguf' + cfg)}"


def gguf_path(model_dir: str | Path, kind: str) -> Path:
    if kind not in GGUF_TYPES:
        raise FateEdgeError(f"GGUF type {kind!r} is not one of {', '.join(GGUF_TYPES)}")
    return gguf_dir(model_dir) / f"model-{kind}.gguf"


def convert_command(model_dir: str | Path, outtype: str, outfile: str | Path, llama_dir: str | Path) -> list[str]:
    """The command converting ``model_dir`` to ``outfile``: this module's wrapper around the converter."""
    return [
        sys.executable,
        "-m",
        "fate_edge_lab.bench.gguf",
        "--convert",
        str(llama_dir),
        str(model_dir),
        "--outtype",
        outtype,
        "--outfile",
        str(outfile),
        *mtp_flags(model_dir),
    ]


# Families whose converter class expects MTP tensors (Qwen3-Next's config does not say how many) unless told not to
_MTP_EXPECTED = ("qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text")


def mtp_flags(model_dir: str | Path) -> list[str]:
    """``--no-mtp`` for a Qwen3-Next-family checkpoint that holds no ``mtp.*`` tensors (transformers' saves, the
    synthetic ones): llama.cpp's converter asserts on them otherwise. Other checkpoints: no flag."""
    model_dir = Path(model_dir)
    try:
        model_type = json.loads((model_dir / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return []
    if model_type not in _MTP_EXPECTED:
        return []
    names = CheckpointReader(model_dir).keys()
    return [] if any(n.startswith(("mtp.", "model.mtp.")) for n in names) else ["--no-mtp"]


def patch_pre_tokenizer(model_class: Any, fallback: str = FALLBACK_PRE_TOKENIZER) -> None:
    """Make ``model_class.get_vocab_base_pre`` answer ``fallback`` for a tokenizer whose hash it does not know.

    The converter identifies a BPE pre-tokenizer by the hash of a test string's token ids and refuses any
    other; our custom byte-level BPEs split text like GPT-2, so llama.cpp's ``gpt-2`` pre-tokenizer is the
    one that reproduces their token ids (``check_tokens`` in the bench verifies it)."""
    original = model_class.get_vocab_base_pre
    if getattr(original, "_fate_edge_fallback", None) == fallback:
        return

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return original(self, tokenizer)
        except NotImplementedError:
            return fallback

    get_vocab_base_pre._fate_edge_fallback = fallback  # type: ignore[attr-defined]
    model_class.get_vocab_base_pre = get_vocab_base_pre


def patch_sentencepiece_probe(model_class: Any) -> None:
    """Make ``model_class._create_vocab_sentencepiece`` raise FileNotFoundError without a ``tokenizer.model``
    before it imports sentencepiece.

    The Llama family's converter (Mixtral) tries a SentencePiece vocabulary first and falls back to the
    Hugging Face BPE on FileNotFoundError; the import comes before that check, so without the optional
    sentencepiece package a checkpoint that has only a ``tokenizer.json`` (ours) fails on ImportError."""
    original = model_class._create_vocab_sentencepiece
    if getattr(original, "_fate_edge_probe", False):
        return

    def _create_vocab_sentencepiece(self):
        path = Path(self.dir_model) / "tokenizer.model"
        if not path.is_file():
            raise FileNotFoundError(f"File not found: {path}")
        return original(self)

    _create_vocab_sentencepiece._fate_edge_probe = True  # type: ignore[attr-defined]
    model_class._create_vocab_sentencepiece = _create_vocab_sentencepiece


def patch_bpe_vocab_fallback(model_class: Any) -> None:
    """Make ``model_class.set_vocab`` (ERNIE-4.5's: SentencePiece only) write the Hugging Face byte-level BPE
    when the checkpoint has no ``tokenizer.model``, as the Llama family's converter falls back by itself.

    The published ERNIE-4.5 ships a SentencePiece model; synthetic copies (``fate-edge synth``) carry the byte-level
    BPE every synthetic checkpoint has, which llama.cpp runs as ``gpt2`` with the ``gpt-2`` pre-tokenizer."""
    original = model_class.set_vocab
    if getattr(original, "_fate_edge_bpe", False):
        return

    def set_vocab(self) -> None:
        if (Path(self.dir_model) / "tokenizer.model").is_file():
            return original(self)
        return self._set_vocab_gpt2()

    set_vocab._fate_edge_bpe = True  # type: ignore[attr-defined]
    model_class.set_vocab = set_vocab


def patch_mla_without_q_lora(model_class: Any) -> None:
    """Write ``attention.q_lora_rank = 0`` for a DeepSeek-V2 checkpoint whose ``q_lora_rank`` is null.

    The converter writes the key only when the rank is set; llama.cpp then recognises the q-LoRA-free "lite"
    variant by its layer count (27 or 26) and otherwise demands the key. A checkpoint trimmed to fewer layers
    (``fate-edge synth --like deepseek-v2-lite --layers N``) would fail to load; 0 is the value
    llama.cpp itself assumes for the lite variant (a plain ``wq`` instead of ``wq_a``/``wq_b``)."""
    original = model_class.set_gguf_parameters
    if getattr(original, "_fate_edge_q_lora", False):
        return

    def set_gguf_parameters(self) -> None:
        original(self)
        if self.hparams.get("q_lora_rank") is None:
            self.gguf_writer.add_q_lora_rank(0)

    set_gguf_parameters._fate_edge_q_lora = True  # type: ignore[attr-defined]
    model_class.set_gguf_parameters = set_gguf_parameters


def patch_q4_0_mix(model_class: Any, gguf_mod: Any) -> None:
    """Make the converter write llama.cpp's Q4_0 mix straight from the checkpoint, but for the output matrix.

    Every matrix the converter would quantize becomes Q4_0 (gguf-py's numpy quantizer, the same rounding as
    ggml's reference ``quantize_row_q4_0``); routers stay F32 by the converter's own rule and the output matrix
    stays in the ``--outtype`` (bf16), because gguf-py cannot write the Q6_K that llama.cpp gives it:
    :func:`quantize_q4_0` then makes that one Q6_K and copies the Q4_0 tensors as they are. So a real-size
    checkpoint reaches q4_0 without a full bf16 or q8_0 GGUF on disk (28.6 / 15 GB for Qwen1.5-MoE-A2.7B)."""
    original = model_class.tensor_force_quant
    if getattr(original, "_fate_edge_q4_0", False):
        return
    kinds, qtype = gguf_mod.MODEL_TENSOR, gguf_mod.GGMLQuantizationType
    kept = [getattr(kinds, k) for k in Q4_0_MIX_KEPT if hasattr(kinds, k)]

    def tensor_force_quant(self, name: str, new_name: str, bid: int | None, n_dims: int):
        forced = original(self, name, new_name, bid, n_dims)
        if forced is not False or n_dims < 2 or not new_name.endswith(".weight") or new_name.endswith("_norm.weight"):
            return forced
        if any(self.match_model_tensor_name(new_name, key, bid) for key in kept):
            return False  # the converter's own rule: F32 routers, outtype for the output matrix
        return qtype.Q4_0

    tensor_force_quant._fate_edge_q4_0 = True  # type: ignore[attr-defined]
    model_class.tensor_force_quant = tensor_force_quant


def _convert_main(llama_dir: str, argv: list[str]) -> None:
    """In the converter's process: import it from ``llama_dir``, patch the hash check, the SentencePiece
    probe, ERNIE's SentencePiece-only vocabulary and DeepSeek-V2's q-LoRA rank, run its main(). ``--outtype
    q4_0-mix``: see :func:`patch_q4_0_mix`."""
    sys.path[:0] = [llama_dir, str(Path(llama_dir) / "gguf-py")]
    import conversion.base  # type: ignore[import-not-found]
    import conversion.deepseek  # type: ignore[import-not-found]
    import conversion.ernie  # type: ignore[import-not-found]
    import convert_hf_to_gguf  # type: ignore[import-not-found]
    import gguf

    patch_pre_tokenizer(conversion.base.TextModel)
    patch_sentencepiece_probe(conversion.base.TextModel)
    patch_mla_without_q_lora(conversion.deepseek.DeepseekV2Model)
    patch_bpe_vocab_fallback(conversion.ernie.Ernie4_5Model)
    if Q4_0_MIX in argv:
        patch_q4_0_mix(conversion.base.TextModel, gguf)
        argv = ["bf16" if a == Q4_0_MIX else a for a in argv]
    sys.argv = ["convert_hf_to_gguf.py", *argv]
    convert_hf_to_gguf.main()


def read_gguf(path: str | Path):
    """A ``gguf.GGUFReader`` on ``path``, with the ``gguf`` package from llama.cpp's sources (the peers cache):
    ``.tensors`` (name, shape in ggml's order, data in PyTorch's) and ``.fields`` (the metadata)."""
    gguf_py = str(converter_dir() / "gguf-py")
    if gguf_py not in sys.path:
        sys.path.append(gguf_py)
    from gguf import GGUFReader

    return GGUFReader(str(path))


def quantize_q4_0(src: Path, dst: Path, threads: int = 2, allow_requantize: bool = False) -> None:
    import llama_cpp  # quantizing runs no threads: its OpenMP wait policy does not matter

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0
    params.nthread = threads
    params.allow_requantize = allow_requantize
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params)
    if rc != 0:
        raise FateEdgeError(f"llama_model_quantize({src} -> q4_0) returned {rc}")


def quantize_source(model_dir: str | Path, kinds: tuple[str, ...]) -> str:
    """The GGUF q4_0 is quantized from: f32 when it is asked for or cached, else bf16 (a bf16 checkpoint's f32
    GGUF holds the same values at twice the bytes: 11 GB for two Mixtral layers)."""
    return "f32" if "f32" in kinds or gguf_path(model_dir, "f32").exists() else "bf16"


def ensure_ggufs(model_dir: str | Path, kinds: tuple[str, ...] = DEFAULT_TYPES, quiet: bool = True) -> dict[str, Path]:
    """The GGUFs of ``model_dir`` in the ``kinds`` asked, converted on first use and then taken from the cache.
    Raises :class:`PeerUnavailableError` when llama-cpp-python or the converter is missing."""
    why = llama_cpp_missing()
    if why:
        raise PeerUnavailableError(why)
    model_dir = Path(model_dir).resolve()
    out = {k: gguf_path(model_dir, k) for k in kinds}
    todo = [k for k in kinds if not out[k].exists()]
    if not todo:
        return out
    source = quantize_source(model_dir, kinds)
    if "q4_0" in todo and source not in kinds:
        ensure_ggufs(model_dir, (source,), quiet)
    llama_dir = converter_dir()
    out[next(iter(out))].parent.mkdir(parents=True, exist_ok=True)
    for kind in [k for k in CONVERTED if k in todo]:
        if kind == "mxfp4" and not _mxfp4_checkpoint(model_dir):
            raise FateEdgeError(
                f"GGUF type mxfp4: {model_dir} has no MXFP4 experts (gpt-oss as published: fate-edge synth --mxfp4)"
            )
        tmp = out[kind].with_suffix(f".partial-{os.getpid()}")
        print(f"gguf: converting {model_dir} -> {out[kind]} ({kind})", flush=True)
        command = convert_command(model_dir, OUTTYPE[kind], tmp, llama_dir)
        proc = subprocess.run(command, capture_output=quiet, text=True)
        if proc.returncode != 0:
            tail = " | ".join((proc.stderr or "").strip().splitlines()[-4:]) if quiet else "see above"
            raise FateEdgeError(f"llama.cpp's converter failed on {model_dir} ({kind}): {tail}")
        tmp.rename(out[kind])
    if "q4_0" in todo:
        tmp = out["q4_0"].with_suffix(f".partial-{os.getpid()}")
        print(f"gguf: quantizing {source} -> {out['q4_0']} (q4_0)", flush=True)
        quantize_q4_0(gguf_path(model_dir, source), tmp)
        tmp.rename(out["q4_0"])
    return out


def _mxfp4_checkpoint(model_dir: Path) -> bool:
    cfg = json.loads((model_dir / "config.json").read_text()) if (model_dir / "config.json").exists() else {}
    quant = cfg.get("quantization_config")
    return isinstance(quant, dict) and quant.get("quant_method") == "mxfp4"


def q4_0_direct(model_dir: str | Path, out: str | Path, quiet: bool = True) -> Path:
    """llama.cpp's Q4_0 mix of ``model_dir`` at ``out`` without a full-precision GGUF: the converter writes the
    mix with a bf16 output matrix (:func:`patch_q4_0_mix`, ~1.1x the q4_0 file), ``llama_model_quantize`` makes
    that matrix Q6_K and copies the rest; the intermediate is deleted. For checkpoints too big for
    :func:`ensure_ggufs`' bf16 route on this disk."""
    why = llama_cpp_missing()
    if why:
        raise PeerUnavailableError(why)
    out = Path(out)
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)  # gguf_path's folder is made by ensure_ggufs otherwise
    mix = out.with_name(out.name + f".mix-partial-{os.getpid()}")
    print(f"gguf: converting {model_dir} -> {mix} (q4_0 mix, bf16 output)", flush=True)
    proc = subprocess.run(convert_command(model_dir, Q4_0_MIX, mix, converter_dir()), capture_output=quiet, text=True)
    try:
        if proc.returncode != 0:
            tail = " | ".join((proc.stderr or "").strip().splitlines()[-4:]) if quiet else "see above"
            raise FateEdgeError(f"llama.cpp's converter failed on {model_dir} ({Q4_0_MIX}): {tail}")
        tmp = out.with_name(out.name + f".partial-{os.getpid()}")
        print(f"gguf: quantizing {mix} -> {out} (q4_0, output q6_K)", flush=True)
        quantize_q4_0(mix, tmp, allow_requantize=True)
        tmp.rename(out)
    finally:
        mix.unlink(missing_ok=True)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--convert"]:
        _convert_main(argv[1], argv[2:])
        return 0
    kinds: tuple[str, ...] = DEFAULT_TYPES
    if len(argv) == 3 and argv[1] == "--types":
        kinds, argv = tuple(argv[2].split(",")), argv[:1]
    if len(argv) != 1 or argv[0].startswith("-") or not set(kinds) <= set(GGUF_TYPES):
        print("\n".join(ln.strip() for ln in __doc__.strip().splitlines()[-2:]), file=sys.stderr)
        return 2
    try:
        for kind, path in ensure_ggufs(argv[0], kinds, quiet=False).items():
            print(f"{kind}\t{path}")
    except FateEdgeError as exc:
        print(f"gguf: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
