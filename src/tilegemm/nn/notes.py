"""The warning the conversions (``convert_``, ``quantize_``, ``quantize_experts_``) give for what they leave as it
was: a module of its own, so that every one of them can import it."""

from __future__ import annotations


class ConversionNote(UserWarning):
    """Some modules were left as they were by :func:`convert_`; the message says which and why."""
