"""Graph passes of the kvcompile backend (see :mod:`kvcompile.passes.attention`).

* :mod:`.attention` — the pass: sites, format check, report;
* :mod:`.spellings` — how the dequantized cache reaches attention (the K/V spelling table);
* :mod:`.forms` — attention forms (SDPA, the eager chain, softcap, sinks);
* :mod:`.rewrite` — checks every form shares, and the emitted op;
* :mod:`.graph` — helpers over FX nodes.
"""

from .attention import KVAttentionPass, KVDtypeMismatch, PassReport
from .forms import ATTENTION_FORMS
from .spellings import KV_SPELLINGS

__all__ = ["KVAttentionPass", "KVDtypeMismatch", "PassReport", "KV_SPELLINGS", "ATTENTION_FORMS"]
