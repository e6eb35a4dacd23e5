"""Weight-only low-bit quantization: formats, quantizer, importers (GPTQ, HQQ/GemLite)."""

from .lowbit import SUPPORTED_BITS, SUPPORTED_GROUP_SIZES, LowBitStorage, LowBitWeight, pack, unpack

__all__ = ["SUPPORTED_BITS", "SUPPORTED_GROUP_SIZES", "LowBitStorage", "LowBitWeight", "pack", "unpack"]
