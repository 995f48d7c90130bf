"""Exceptions raised by vmm. Every misuse gets its own type so callers can react precisely."""


class VmmError(Exception):
    """Base class of every vmm error."""


class BackendUnavailable(VmmError):
    """The backend cannot run here (no GPU, no driver, no cuda-python); the message says why."""


class PoolExhausted(VmmError):
    """The physical page pool has no free page left."""


class NoMemory(VmmError):
    """The system has no memory for a page a woken pool creates at its first use. Not
    PoolExhausted: the pool has free ids, so waiting for room would wait forever."""


class DoubleFree(VmmError):
    """A reference was dropped from a page that holds none."""


class NotMapped(VmmError):
    """Unmapping, sharing or copying a page index that has no page mapped."""


class AlreadyMapped(VmmError):
    """Mapping over a page index that already has a page mapped."""


class OutOfRange(VmmError):
    """A page index, offset or view outside the reservation."""


class UnmappedAccess(VmmError):
    """A checked view would cover pages that are not mapped."""


class ReservationReleased(VmmError):
    """The reservation was already released."""


class PartialUnmap(VmmError):
    """An unmap failed part-way: the first `done` pages of the run are unmapped, the rest are not."""

    def __init__(self, message: str, done: int):
        super().__init__(message)
        self.done = done


class InvariantViolation(VmmError):
    """Pool bookkeeping disagrees with the mappings: a bug, never user error."""
