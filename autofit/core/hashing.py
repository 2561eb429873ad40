"""One hash for every fingerprint: a value as canonical JSON, hashed."""

from __future__ import annotations

import hashlib
import json
from typing import Any


def digest(value: Any) -> str:
    """sha256 of ``value`` as canonical JSON (sorted keys; anything else by ``str``)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()
