"""Pure data: the TCA-BME encoder/decoder, storage accounting and (de)serialisation."""

from .tca_bme import (
    DEFAULT_GROUP_TILE,
    SUPPORTED_DTYPES,
    VALUE_ALIGN,
    Geometry,
    StorageBreakdown,
    TCABME,
    decode,
    encode,
    validate_arrays,
)

__all__ = [
    "DEFAULT_GROUP_TILE",
    "SUPPORTED_DTYPES",
    "VALUE_ALIGN",
    "Geometry",
    "StorageBreakdown",
    "TCABME",
    "decode",
    "encode",
    "validate_arrays",
]
