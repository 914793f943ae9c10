"""``autopar.faults``: bounded exits when a rank fails or hangs (the public names of
``autopar.runtime.faults``, where they are documented).

    from autopar.faults import deadline
    with deadline(60):
        pm.train_step(inputs, target)
"""

from autopar.runtime.faults import EXIT_CODE, PeerFailure, deadline, failures_shared, shared_failures

__all__ = ["EXIT_CODE", "PeerFailure", "deadline", "failures_shared", "shared_failures"]
