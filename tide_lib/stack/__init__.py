"""The local stack: a real S3 server (SeaweedFS) and a real MLflow server on 127.0.0.1.

Used by ``make demo``, by the tests and by anyone trying TIDE on one machine.
"""

from tide_lib.stack.manager import ServiceStatus, StackError, StackManager, free_ports, pid_alive
from tide_lib.stack.services import SERVICES, Service

__all__ = [
    "SERVICES",
    "Service",
    "ServiceStatus",
    "StackError",
    "StackManager",
    "free_ports",
    "pid_alive",
]
