"""What a quantized tensor looks like: bit width, group size, symmetry, and the bytes it costs."""

from __future__ import annotations

from dataclasses import dataclass

SUPPORTED_BITS = (8, 4, 3, 2)
SUPPORTED_GROUPS = (32, 64, 128)
META_BYTES = 2  # scale and zero are stored as fp16 (Fate stores fp32, which costs int2 most of its saving)
KINDS = ("int", "mxfp4")  # integer codes with scale (and zero), or OCP MXFP4: E2M1 codes with one E8M0 scale a block


@dataclass(frozen=True)
class QuantSpec:
    """Group-wise quantization of the last dimension of a weight matrix.

    Fate (WWW'26, arXiv 2502.12224) ships asymmetric round-to-nearest with group 64 for int4 and 32
    for int2; we keep its scheme but store the per-group scale and zero in fp16 instead of fp32.
    """

    bits: int = 4  # 8, 4, 3 or 2 bits per weight code
    group_size: int = 64  # consecutive weights along the input dimension that share one scale/zero
    asymmetric: bool = True  # True: scale and zero per group; False: scale only, codes centred on 2**(bits-1)
    kind: str = "int"  # "mxfp4": 4-bit E2M1 codes in blocks of 32 with a one-byte E8M0 scale (quant.mxfp4)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"QuantSpec.kind must be one of {KINDS}, not {self.kind!r}")
        if self.kind == "mxfp4" and (self.bits, self.group_size, self.asymmetric) != (4, 32, False):
            raise ValueError(
                "an mxfp4 QuantSpec is 4 bits in groups of 32 with no zero: QuantSpec(4, 32, False, 'mxfp4')"
            )
        if self.bits not in SUPPORTED_BITS:
            raise ValueError(f"QuantSpec.bits must be one of {SUPPORTED_BITS}, not {self.bits}")
        if self.group_size not in SUPPORTED_GROUPS:
            raise ValueError(f"QuantSpec.group_size must be one of {SUPPORTED_GROUPS}, not {self.group_size}")

    @property
    def qmax(self) -> int:
        """Largest code value."""
        return (1 << self.bits) - 1

    @property
    def storage_bits(self) -> int:
        """Bits one code occupies once packed: 3-bit codes are stored in 4-bit slots for now."""
        return 4 if self.bits == 3 else self.bits

    @property
    def meta_bytes_per_group(self) -> int:
        if self.kind == "mxfp4":
            return 1  # one E8M0 exponent byte
        return META_BYTES * (2 if self.asymmetric else 1)

    def __str__(self) -> str:
        if self.kind == "mxfp4":
            return "mxfp4"
        return f"int{self.bits}-g{self.group_size}-{'asym' if self.asymmetric else 'sym'}"


def bytes_per_weight(spec: QuantSpec) -> float:
    """Average stored bytes per weight: packed code plus this weight's share of its group's scale/zero.

    int4-g64 asymmetric: 0.5 + 4/64 = 0.5625 bytes (4.5 bits); int2-g32: 0.25 + 4/32 = 0.375 (3 bits).
    """
    return spec.storage_bits / 8 + spec.meta_bytes_per_group / spec.group_size


def tensor_nbytes(spec: QuantSpec, shape: tuple[int, ...]) -> int:
    """Exact bytes of a quantized tensor of ``shape`` (codes packed, plus scales and zeros)."""
    numel = 1
    for d in shape:
        numel *= d
    if shape[-1] % spec.group_size:
        raise ValueError(f"last dimension {shape[-1]} is not a multiple of group_size {spec.group_size}")
    groups = numel // spec.group_size
    return numel * spec.storage_bits // 8 + groups * spec.meta_bytes_per_group
