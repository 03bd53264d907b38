"""Functions that travel whole (``rt::fn``): both sides' list of them.

The client patches these functions so calls on remote tensors go to the server as one call
(:mod:`gpu_trace.runtime.client.composites`); the server resolves a call's name here to the
function it runs (:mod:`gpu_trace.runtime.server.pseudo_ops`). Neither side imports the other:
this table is all they share.
"""

from __future__ import annotations

from typing import Any

import torch

#: name -> (owner, attribute): what is patched on the client and resolved on the server.
FUNCTIONS: dict[str, tuple[Any, str]] = {
    "lstm": (torch._VF, "lstm"),
    "gru": (torch._VF, "gru"),
    "rnn_tanh": (torch._VF, "rnn_tanh"),
    "rnn_relu": (torch._VF, "rnn_relu"),
    "sdpa": (torch.nn.functional, "scaled_dot_product_attention"),
}

#: name -> the original function, while the client has patched it (this process may be the
#: server too: it must run the original, never the client's wrapper).
ORIGINALS: dict[str, Any] = {}


def server_function(name: Any) -> Any:
    """The function the server runs for ``name`` (its original, never a wrapper); or None."""
    entry = FUNCTIONS.get(name) if type(name) is str else None
    if entry is None:
        return None
    return ORIGINALS.get(name) or getattr(*entry)
