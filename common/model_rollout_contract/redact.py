"""Credentials written into a URL (``https://user:secret@host/``) are cut out of any text
before it is shown: a store endpoint can carry them, and errors (boto3's, ours) quote
the endpoint. The sidecar redacts its log lines and status with this, the operator the
messages it puts into a ModelDeployment's conditions and events."""

from __future__ import annotations

import re

# scheme://userinfo@ — userinfo is anything up to the first "@" before the host that has
# no "/", whitespace or quote in it (RFC 3986 forbids "/" there)
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/\s@\"'<>]+@")


def redact(text: str) -> str:
    """``https://user:secret@host/`` -> ``https://***@host/``, wherever it appears."""
    return _USERINFO.sub(r"\g<scheme>***@", text)
