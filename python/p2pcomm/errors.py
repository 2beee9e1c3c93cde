"""Exceptions raised by p2pcomm, one per status code of the C ABI."""

from __future__ import annotations


class P2PCommError(RuntimeError):
    """Base class of every error p2pcomm raises. ``code`` is the C status."""

    code = 10

    def __init__(self, message: str):
        super().__init__(message)


class InvalidArgumentError(P2PCommError, ValueError):
    """A tensor, size, pointer or option is not acceptable."""

    code = 1


class UnsupportedError(P2PCommError, TypeError):
    """A dtype, reduce op or algorithm this backend cannot run."""

    code = 2


class CapacityError(P2PCommError, ValueError):
    """A tensor is larger than the registered or staging capacity."""

    code = 3


class StateError(P2PCommError):
    """The communicator is not open (used before init or after close)."""

    code = 4


class MismatchError(P2PCommError):
    """Ranks called a collective with different arguments."""

    code = 5


class PeerTimeoutError(P2PCommError, TimeoutError):
    """A peer never arrived within the timeout; the message names it."""

    code = 6


class BootstrapError(P2PCommError):
    """Rendezvous between the ranks failed."""

    code = 7


class CUDAError(P2PCommError):
    """A CUDA driver or NVRTC call failed."""

    code = 8


class ForkError(P2PCommError):
    """p2pcomm was used in a process forked after it was loaded."""

    code = 9


class InternalError(P2PCommError):
    """A bug in p2pcomm; please report it with the message."""

    code = 10


class PeerUnavailableError(P2PCommError):
    """Two GPUs of the group cannot access each other's memory."""

    code = 11


_BY_CODE = {
    cls.code: cls
    for cls in (
        InvalidArgumentError, UnsupportedError, CapacityError, StateError, MismatchError,
        PeerTimeoutError, BootstrapError, CUDAError, ForkError, InternalError, PeerUnavailableError,
    )
}


def error_for(code: int, message: str) -> P2PCommError:
    """Return the exception for a non-zero C status code."""
    return _BY_CODE.get(code, InternalError)(message)
