"""The Ray cluster as the stages meet it: connect (bounded), what it has, and fail fast when it cannot serve a run.

- :func:`init_ray` connects to ``ray.address`` / ``RAY_ADDRESS`` (or starts a local Ray); an address that does not
  answer ends after ``ray.connect_timeout_s`` in a one-paragraph :class:`ClusterError`, and a local cluster that
  ``ray start`` recorded but that no longer answers is named and replaced by a fresh local Ray.
- :func:`use_gpu` decides GPU training from the *cluster's* resources; :func:`check_request` refuses (exit 2) a
  request a local Ray can never satisfy, before it starts (``pipeline.config.resources``).
- :func:`wait_for_workers` reserves a run's resources; while the autoscaler adds nodes it keeps waiting, and
  ``ray.resources_timeout_s`` after the last node on its way it ends in a :class:`ClusterError`, never a silent hang.

The console keeps the stages' own lines and real errors; Ray's chatter stays in its session logs
(``/tmp/ray/session_*/logs``), through the job's and Ray Train's logging configs below and what the ``transfusion``
command sets before it imports Ray (``stages.cli.ray_env``).
"""

from __future__ import annotations

import math
import os
import socket
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from pipeline.config.params import Params
from pipeline.config.resources import KINDS, check_request, trial_shape, use_gpu
from pipeline.host import usable_cpus
from pipeline.runs.undocumented import local_gcs_port, pending_nodes, ray_record_file, stale_local_record

if TYPE_CHECKING:
    import ray
    import ray.train


#: Ray's own Python loggers in every process of a job (``ray.init(logging_config=...)``): their warnings (e.g. Ray
#: Train's placement-group cleaner's whenever a trial ends by ASHA or Ctrl-C) stay in the logs; with a job logging
#: config Ray also drops its "(pid=...)" prefix from the lines it forwards.
RAY_LOG_LEVEL = "ERROR"
#: Ray Train's ``ray.train`` logs on the console: INFO is the controller's chatter, its WARNINGs are about its own
#: internals; ERROR keeps a worker's "Error in training function" traceback. Every level stays in ``logs/train``.
TRAIN_CONSOLE_LEVEL = "ERROR"
#: The same for a Tune trial's Ray Train run: a trial torn down by Ctrl-C or ASHA may fail its controller's report to
#: Tune (40 lines of traceback); a trial that really fails gets its one-line reason from the job's tracker.
TRIAL_CONSOLE_LEVEL = "CRITICAL"


class ClusterError(RuntimeError):
    """The Ray cluster cannot be reached, or cannot give the resources in time; the message says what to do."""


def address_of(params: Params) -> str | None:
    return params.ray.address or os.environ.get("RAY_ADDRESS") or None


def with_worker_cpus(params: Params, trial_cpu: float = 0.0) -> Params:
    """``ray.cpus_per_worker: null`` made a number, what each worker asks Ray for (its torch threads:
    ``pipeline.config.ray.torch_threads``): on a Ray this command starts on this machine (no ``ray.address`` /
    ``RAY_ADDRESS``, or ``local``), this machine's usable CPUs less a Tune trial's own ``trial_cpu`` (a job whose runs
    are trials: tables), over ``ray.num_workers``, in quarters, at least 0.25, so that a lone run uses every core and
    several workers share them; on a cluster, 1 (Ray Train's default). A number is kept."""
    r = params.ray
    if r.cpus_per_worker is not None:
        return params
    local = address_of(params) in (None, "local")
    cpus = max(0.25, math.floor(4 * (usable_cpus() - trial_cpu) / r.num_workers) / 4) if local else 1.0
    return params.model_copy(update={"ray": r.model_copy(update={"cpus_per_worker": cpus})})


def host_port(address: str) -> tuple[str, int] | None:
    """``host:port`` of an explicit address (``ray://h:p``, ``h:p``); None for ``auto``/``local``."""
    if address in ("auto", "local"):
        return None
    parts = urlsplit(address if "://" in address else f"gcs://{address}")
    if parts.hostname is None or parts.port is None:
        return None
    return parts.hostname, parts.port


def _probe(host: str, port: int, timeout: float) -> None:
    """Wait until ``host:port`` accepts a TCP connection, for at most ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, port), timeout=min(5.0, max(0.1, deadline - time.monotonic()))):
                return
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise ClusterError(
                    f"cannot reach the Ray cluster at {host}:{port} ({exc.strerror or exc}) after {timeout:g} s "
                    "(ray.connect_timeout_s); start the cluster (`ray start --head`), fix ray.address / RAY_ADDRESS, "
                    "or unset them to run on a local Ray") from None
            time.sleep(0.5)


def train_logging(level: str = TRAIN_CONSOLE_LEVEL) -> ray.train.LoggingConfig:
    """Ray Train's logging for a Train run of the stages (``RunConfig(logging_config=...)``): ``level`` and above on
    the console, everything in Ray's session logs (:data:`TRAIN_CONSOLE_LEVEL`, :data:`TRIAL_CONSOLE_LEVEL`)."""
    import ray.train

    return ray.train.LoggingConfig(log_level=level)


def ray_logging() -> ray.LoggingConfig:
    """The job's logging config (:data:`RAY_LOG_LEVEL`) for every ``ray.init`` of the stages."""
    import ray

    return ray.LoggingConfig(log_level=RAY_LOG_LEVEL)


def _auth_refused(exc: BaseException) -> bool:
    """Ray's connect failed because the cluster wants a token this client did not send (or a different one)."""
    from ray.exceptions import AuthenticationError

    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, AuthenticationError) or "InvalidAuthToken" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _auth_error(address: str | None) -> ClusterError:
    """The one line a user needs when token authentication stops the connect (Ray's own text is a page long)."""
    where = f"the Ray cluster at {address!r}" if address else "the local Ray cluster"
    mode = os.environ.get("RAY_AUTH_MODE")
    if mode == "token":
        return ClusterError(
            f"{where} did not accept this machine's auth token (none found, or not the cluster's; "
            "RAY_AUTH_MODE=token); give this machine the cluster's token (`ray get-auth-token` on the head node "
            "prints it) in ~/.ray/auth_token, RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN, or set RAY_AUTH_MODE=disabled "
            "for a cluster started without authentication")
    return ClusterError(
        f"{where} uses token authentication and this client sends no token (RAY_AUTH_MODE is "
        f"{mode or 'unset'}); set RAY_AUTH_MODE=token and give this machine the cluster's token (`ray get-auth-token` "
        "on the head node prints it) in ~/.ray/auth_token or RAY_AUTH_TOKEN")


def init_ray(params: Params) -> None:
    """Connect to the configured cluster, or start a local Ray; bounded by ``ray.connect_timeout_s``.

    Worker output (our progress lines) is forwarded to this console (``log_to_driver``); Ray's own chatter is not
    (module docstring).
    """
    import ray
    from ray.exceptions import AuthenticationError

    if ray.is_initialized():
        return
    address = address_of(params)
    if address:
        target = host_port(address)
        if target:
            _probe(*target, params.ray.connect_timeout_s)
    else:  # a local Ray: ray.init() would join the last `ray start` cluster Ray recorded, also a dead one
        stale = stale_local_record(min(5.0, params.ray.connect_timeout_s))
        if stale:
            sys.stdout.write(f"[ray] the local Ray cluster recorded at {stale} ({ray_record_file()}) does not answer "
                             "(a Ray stopped without `ray stop`); starting a fresh local Ray for this run\n")
            address = "local"
    try:
        with local_gcs_port(address) as extra:
            ray.init(address=address, log_to_driver=True, configure_logging=False, logging_config=ray_logging(),
                     **extra)
    except AuthenticationError:  # token mode without a token (Ray's own check, before connecting)
        raise _auth_error(address) from None
    except ConnectionError as exc:  # e.g. "auto" with no cluster running, or a token the cluster refused
        if _auth_refused(exc):
            raise _auth_error(address) from None
        raise ClusterError(f"cannot connect to the Ray cluster at {address!r}: {str(exc).splitlines()[0]}; start "
                           "it, or unset ray.address / RAY_ADDRESS to run on a local Ray") from None


def local_nodes() -> list[dict[str, float]]:
    """The one node a local Ray would start on (no ``ray.address`` / ``RAY_ADDRESS``): this machine's usable CPUs
    and CUDA GPUs, known before Ray starts (Ray may count fewer CPUs under a cgroup quota; the check after start
    uses Ray's own count)."""
    import torch

    return [{"CPU": float(usable_cpus()), "GPU": float(torch.cuda.device_count())}]


def live_nodes() -> list[dict[str, float]]:
    """The connected Ray's alive nodes, each as its CPUs and GPUs (``ray.nodes()``)."""
    import ray

    return [{k: float(n["Resources"].get(k, 0.0)) for k in KINDS} for n in ray.nodes() if n.get("Alive")]


def wait_for_workers(params: Params, *, gpu: bool, cpus_per_worker: float | None = None, trial_cpu: float = 0.0,
                     pending=pending_nodes, poll_s: float = 10.0, say=sys.stdout.write) -> None:
    """Reserve one run's bundles (``ray.num_workers`` workers, plus a trial's own ``trial_cpu``), then release them
    for Ray Train and Tune; give up ``ray.resources_timeout_s`` after the autoscaler last had a node on its way
    (:func:`pipeline.runs.undocumented.pending_nodes`).

    Ray Train V2 waits for a worker group's resources and retries the wait forever (so does a Tune trial's Train
    run); this puts a bound on it that knows about autoscaling: while nodes are launching or booting (a cold cluster:
    instances boot, mount the shared storage, install the project) the wait goes on, with a progress line a minute;
    with nothing on its way, it ends after ``ray.resources_timeout_s`` in a :class:`ClusterError` naming the wait,
    never a silent hang. A request that a cluster's nodes can never hold ends the same way.
    """
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    shape = trial_shape(params, gpu, cpus_per_worker, trial_cpu)
    bundle: dict[str, float] = {"CPU": shape.cpus_per_worker, **({"GPU": 1} if gpu else {})}
    what = f"{params.ray.num_workers} worker(s) of {bundle}" + (f" and a trial's {{'CPU': {trial_cpu:g}}}"
                                                                  if trial_cpu else "")
    group = placement_group(shape.bundles(), strategy="PACK")
    timeout = params.ray.resources_timeout_s
    start = last_pending = time.monotonic()
    told = -float("inf")  # the first line at once, then one a minute
    try:
        while not group.wait(timeout_seconds=max(0.1, min(poll_s, last_pending + timeout - time.monotonic()))):
            now = time.monotonic()
            coming = pending()
            if coming:
                last_pending = now
                if now - told >= 60.0:
                    told = now
                    say(f"[ray] waiting for {what}: the autoscaler is adding {coming} node(s) ({now - start:.0f} s so "
                        "far)\n")
            elif now >= last_pending + timeout:
                free = ray.available_resources()
                have = ", ".join(f"{free.get(k, 0):g} {k}" for k in KINDS)
                raise ClusterError(
                    f"waited {now - start:.0f} s for {what} (ray.num_workers, {shape.cpu_key}, ray.use_gpu), "
                    f"{timeout:g} s (ray.resources_timeout_s) of them with no node on its way, and the cluster never "
                    f"had them free (free now: {have}); wait for other jobs to finish, raise ray.resources_timeout_s, "
                    "or ask for fewer resources")
    finally:
        remove_placement_group(group)


def ray_up() -> bool:
    """This process is connected to a Ray already (e.g. ``transfusion rehearse``'s, which may declare GPUs)."""
    if "ray" not in sys.modules:
        return False
    import ray

    return ray.is_initialized()


def connect(params: Params, root: Path | None = None, *, tracking: bool = True, cpus_per_worker: float | None = None,
            trial_cpu: float = 0.0, what: str = "pretraining") -> tuple[bool, dict[str, float]]:
    """What every Ray stage does first, cheapest check first; returns whether the workers train on GPUs, and the
    cluster's resources now (``ray.cluster_resources()``: callers size their concurrency from them).

    1. the tracking store (``root``'s, or ``MLFLOW_TRACKING_URI``) answers and is sound, before Ray starts;
    2. for a local Ray, the request fits this machine (exit 2 before Ray starts);
    3. connect (bounded by ``ray.connect_timeout_s``);
    4. for a local Ray, also one this process runs already (a rehearsal's, declaring GPUs), the request fits its
       nodes (exit 2). A cluster (an address) may still grow: what it cannot hold ends in :func:`wait_for_workers`'s
       bounded wait, and Ray Train refuses a worker group beyond the maximum an autoscaler publishes.
    """
    if tracking:
        from pipeline.runs.tracking import check_reachable, tracking_uri

        check_reachable(tracking_uri(root))
    request = {"cpus_per_worker": cpus_per_worker, "trial_cpu": trial_cpu, "what": what}
    local = address_of(params) is None
    if local and not ray_up():  # a Ray this process already runs is checked below, as it is
        nodes = local_nodes()
        check_request(params, nodes, gpu=use_gpu(params, sum(n["GPU"] for n in nodes)), **request)
    init_ray(params)
    import ray

    totals = {k: float(v) for k, v in ray.cluster_resources().items()}
    gpu = use_gpu(params, totals.get("GPU", 0.0))
    if local:
        check_request(params, live_nodes(), gpu=gpu, **request)
    return gpu, totals


def start_local_ray(num_gpus: int = 0, **init: object) -> None:
    """Start this process's local Ray on this machine's CPUs, declaring ``num_gpus`` GPUs it may not have (as
    ``ray start --num-gpus N`` does): Ray schedules workers on them exactly as on real GPUs (``CUDA_VISIBLE_DEVICES``,
    ``ray.get_gpu_ids()``), and ``ray.backend: gloo`` trains them on the CPU. The stages then use this Ray.

    Its GCS port and the address every process of the job gets are :func:`init_ray`'s for a local Ray: Ray Train's
    placement-group cleaner, which removes the workers' bundles of a run whose trial ended (ASHA, Ctrl-C), finds
    this Ray also while other local Rays run (without, it cannot, and the bundles stay taken). ``init``: more
    ``ray.init`` arguments (``num_cpus``, ``object_store_memory``)."""
    import ray

    if ray.is_initialized():
        return
    with local_gcs_port(None) as extra:
        ray.init(**{"num_cpus": usable_cpus(), "num_gpus": num_gpus, "log_to_driver": True,
                    "configure_logging": False, "logging_config": ray_logging(), **init, **extra})
