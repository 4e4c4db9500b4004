"""Errors of the bus package, each marked retryable or permanent.

BusError                      root; `retryable` says whether trying again can help
├── BusUnavailable            broker unreachable or timed out (retryable)
├── DeliveryFailed            a publish was not confirmed (retryable)
├── CommitFailed              offsets not committed, e.g. after a rebalance (retryable)
├── TopicError                a topic is missing or has the wrong shape (permanent)
└── DecodeError               bytes are not a valid message for the topic (permanent)
"""

from __future__ import annotations


class BusError(Exception):
    retryable: bool = False


class BusUnavailable(BusError):
    retryable = True


class DeliveryFailed(BusError):
    retryable = True


class CommitFailed(BusError):
    retryable = True


class TopicError(BusError):
    retryable = False


class DecodeError(BusError):
    retryable = False
