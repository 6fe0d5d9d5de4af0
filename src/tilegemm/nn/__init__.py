"""Drop-in modules built on tilegemm's ops."""

from tilegemm.nn.int4 import Int4Linear, quantize_

__all__ = ["Int4Linear", "quantize_"]
