"""fedlase on Flower (flwr 1.42, Message API): the same methods, sampling, local training and aggregation
as the embedded engine, with clients on Flower nodes (Simulation Engine or Deployment Engine).

Modules: `codec` (sparse payloads, reply checks), `rounds` (the server side of a round, partitions pinned to node
keys), `buffered` (schedule=fedbuff: the asynchronous event loop on the nodes' replies), `node_data` (a node's
own cached samples), `server_app` and `client_app` (the Flower apps), `launch` (`engine=flower-sim` /
`engine=flower-deploy`; the Simulation Engine is `sim_engine`, the processes below a run and their reaping
`processes`), `security` (certificates, node keys, pins), `proxy` (nginx in
front of the SuperLink and beside each node) and `worker` (a node's warm worker; `worker_link` its ClientApp half,
`worker_start` its first steps). The loopback deployment is tools/flower_local.py. See
docs/flower.md."""
from .worker_start import start_if_worker

start_if_worker()   # `python -m fedlase.flower.worker`: -P and its node watched before anything below is imported

from .launch import QUIET_ENV, quiet_env  # noqa: E402

quiet_env()   # before flwr or ray is imported anywhere below this package

from .launch import run_flower  # noqa: E402

__all__ = ["QUIET_ENV", "quiet_env", "run_flower"]
