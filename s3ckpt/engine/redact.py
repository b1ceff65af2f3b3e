"""Keep credentials out of logs, including botocore's own DEBUG output.

With DEBUG logging botocore prints canonical requests and request headers, which carry the session
token. s3ckpt installs a filter on the botocore, aiobotocore and urllib3 loggers that rewrites any
record containing a credential value in use, a security-token header, or a signature.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Iterable

__all__ = ["install", "redact"]

_PATTERNS = [
    re.compile(r"(x-amz-security-token['\"]?\s*[:=]\s*b?['\"]?)[^'\"\s,}|]+", re.IGNORECASE),
    re.compile(r"(Signature=)[0-9a-f]+", re.IGNORECASE),
]
_MASK = "***"
_secrets: set[str] = set()
_lock = threading.Lock()


def redact(text: str) -> str:
    """``text`` with every known secret value and token header replaced by ``***``."""
    for secret in _secrets:
        text = text.replace(secret, _MASK)
    for pattern in _PATTERNS:
        text = pattern.sub(rf"\g<1>{_MASK}", text)
    return text


class _Filter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        cleaned = redact(message)
        if cleaned != message:
            record.msg, record.args = cleaned, None
        return True


_FILTER = _Filter()


def install(secrets: Iterable[str | None]) -> None:
    """Remember secret values and filter every botocore, aiobotocore and urllib3 logger."""
    with _lock:
        _secrets.update(s for s in secrets if s and len(s) >= 8)
        manager = logging.Logger.manager
        for name in list(manager.loggerDict):
            if name.split(".")[0] in ("botocore", "aiobotocore", "urllib3", "s3ckpt"):
                logger = logging.getLogger(name)
                if _FILTER not in logger.filters:
                    logger.addFilter(_FILTER)
