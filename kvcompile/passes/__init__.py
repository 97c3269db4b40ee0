"""Graph passes of the kvcompile backend (see :mod:`kvcompile.passes.attention`)."""

from .attention import PATTERNS, KVAttentionPass, KVDtypeMismatch, PassReport

__all__ = ["KVAttentionPass", "KVDtypeMismatch", "PassReport", "PATTERNS"]
