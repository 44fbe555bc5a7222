"""The local stack on 127.0.0.1: a real S3 server (SeaweedFS), a real MLflow server and,
unless ``TIDE_STACK__AIRFLOW=false``, Airflow (API server, scheduler, dag-processor,
triggerer; LocalExecutor, or CeleryExecutor with one worker per queue).

Used by ``make demo``, by the tests and by anyone trying TIDE on one machine.
"""

__all__ = [
    "SERVICES",
    "Service",
    "ServiceStatus",
    "StackError",
    "StackManager",
    "free_ports",
    "pid_alive",
]

from tide_lib.stack.manager import ServiceStatus, StackError, StackManager, free_ports, pid_alive
from tide_lib.stack.services import SERVICES, Service
