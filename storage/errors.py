"""Errors of the stores (`storage/`): one root, each class marked retryable or permanent.

StoreError                        root; `retryable` tells the consume loop what to do
├── StoreUnavailable  (retryable) the database or Redis did not answer
├── AuthenticationFailed (perm.)  unknown, revoked or malformed key: one message for all
├── InvalidInput      (permanent) a bad value from a caller (CLI exit code 2)
│   └── NotFound      (permanent) a named tenant, key or model does not exist
└── Conflict          (permanent) a unique name is taken
"""

from __future__ import annotations


class StoreError(Exception):
    retryable: bool = False


class StoreUnavailable(StoreError):
    retryable = True


class AuthenticationFailed(StoreError):
    """The only error authentication raises; its text never says which check failed."""

    retryable = False

    def __init__(self) -> None:
        super().__init__("invalid API key")


class InvalidInput(StoreError):
    retryable = False


class NotFound(InvalidInput):
    retryable = False


class Conflict(InvalidInput):
    retryable = False
