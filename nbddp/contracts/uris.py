"""A tracker's address without the credentials it may carry: what nbddp writes into a run dir.

A tracking URI may hold a user and password (``https://user:token@mlflow.example.com``); the run dir, and any file
of it a colleague or a CI log is shown, must not. So a URI is written without them (:func:`without_credentials`),
and the process that needs to write to the store again takes the one its own environment holds when it names the
same place (:func:`with_credentials`).
"""

from __future__ import annotations

import os
from urllib.parse import urlsplit, urlunsplit


def without_credentials(uri: str) -> str:
    """``uri`` with no user or password (``https://user:token@host/x`` → ``https://host/x``)."""
    parts = urlsplit(uri)
    if "@" not in parts.netloc:
        return uri
    return urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]))


def with_credentials(uri: str, variable: str = "MLFLOW_TRACKING_URI") -> str:
    """The URI in ``variable`` when it is ``uri`` with credentials (the store's own); else ``uri``."""
    own = os.environ.get(variable, "")
    return own if own and without_credentials(own) == uri else uri
