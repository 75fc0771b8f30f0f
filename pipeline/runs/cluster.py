"""The Ray cluster as the stages meet it: connect (bounded: :func:`connect`), what it has, and fail fast when it
cannot serve a run (:func:`wait_for_workers`). The console keeps the stages' own lines and real errors; Ray's chatter
stays in its session logs, through the levels below and what ``stages.cli.ray_env`` sets before Ray is imported.
"""

from __future__ import annotations

import math
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from pipeline.config.params import Params
from pipeline.config.resources import KINDS, check_request, trial_shape, use_gpu
from pipeline.host import usable_cpus
from pipeline.runs.undocumented import local_gcs_port, pending_nodes, ray_record_file, stale_local_record

#: Ray's own Python loggers in every process of a job: their warnings (e.g. Ray Train's placement-group cleaner's
#: when a trial ends by ASHA or Ctrl-C) stay in the logs; with it Ray also drops its "(pid=...)" prefix.
RAY_LOG_LEVEL = "ERROR"
#: Ray Train's console: its INFO and WARNINGs are about its own internals; ERROR keeps a worker's traceback.
TRAIN_CONSOLE_LEVEL = "ERROR"
#: A Tune trial's: a trial torn down by Ctrl-C or ASHA may fail its controller's report to Tune (40 lines of
#: traceback); a trial that really fails gets its one-line reason from the job's tracker.
TRIAL_CONSOLE_LEVEL = "CRITICAL"


@dataclass(frozen=True)
class Capacity:
    """What a job opens on: whether its workers train on GPUs, and the cluster's resources then (a cluster may still
    grow: :func:`wait_for_workers`)."""

    gpu: bool
    totals: dict[str, float]


class ClusterError(RuntimeError):
    """The Ray cluster cannot be reached, or cannot give the resources in time; the message says what to do."""


def address_of(params: Params) -> str | None:
    return params.ray.address or os.environ.get("RAY_ADDRESS") or None


def with_worker_cpus(params: Params, trial_cpu: float = 0.0) -> Params:
    """``ray.cpus_per_worker: null`` made a number: on a local Ray this machine's usable CPUs less ``trial_cpu`` over
    ``ray.num_workers`` (in quarters, at least 0.25), so that a lone run uses every core; on a cluster, 1."""
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
                raise ClusterError(f"cannot reach the Ray cluster at {host}:{port} ({exc.strerror or exc}) after "
                                   f"{timeout:g} s (ray.connect_timeout_s); start the cluster (`ray start --head`), "
                                   "fix ray.address / RAY_ADDRESS, or unset them to run on a local Ray") from None
            time.sleep(0.5)


def _ray_init(**kwargs: object) -> None:
    """``ray.init`` as every stage calls it: workers' output forwarded here, Ray's loggers at :data:`RAY_LOG_LEVEL`."""
    import ray

    ray.init(**{"log_to_driver": True, "configure_logging": False,
                "logging_config": ray.LoggingConfig(log_level=RAY_LOG_LEVEL), **kwargs})


def _auth_refused(exc: BaseException) -> bool:
    """Ray's connect failed because the cluster wants a token this client did not send (or another)."""
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
        return ClusterError(f"{where} did not accept this machine's auth token (none found, or not the cluster's; "
                            "RAY_AUTH_MODE=token); give this machine the cluster's token (`ray get-auth-token` on the "
                            "head node prints it) in ~/.ray/auth_token, RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN, or set "
                            "RAY_AUTH_MODE=disabled for a cluster started without authentication")
    return ClusterError(f"{where} uses token authentication and this client sends no token (RAY_AUTH_MODE is "
                        f"{mode or 'unset'}); set RAY_AUTH_MODE=token and give this machine the cluster's token "
                        "(`ray get-auth-token` on the head node prints it) in ~/.ray/auth_token or RAY_AUTH_TOKEN")


def init_ray(params: Params) -> None:
    """Connect to the configured cluster, or start a local Ray; bounded by ``ray.connect_timeout_s``."""
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
            _ray_init(address=address, **extra)
    except AuthenticationError:  # token mode without a token (Ray's own check, before connecting)
        raise _auth_error(address) from None
    except ConnectionError as exc:  # e.g. "auto" with no cluster running, or a token the cluster refused
        if _auth_refused(exc):
            raise _auth_error(address) from None
        raise ClusterError(f"cannot connect to the Ray cluster at {address!r}: {str(exc).splitlines()[0]}; start "
                           "it, or unset ray.address / RAY_ADDRESS to run on a local Ray") from None


def local_nodes() -> list[dict[str, float]]:
    """The one node a local Ray would start on: this machine's usable CPUs and CUDA GPUs, before Ray starts (under
    a cgroup quota Ray may count fewer CPUs; the check after start uses Ray's count)."""
    import torch

    return [{"CPU": float(usable_cpus()), "GPU": float(torch.cuda.device_count())}]


def live_nodes() -> list[dict[str, float]]:
    """The connected Ray's alive nodes, each as its CPUs and GPUs (``ray.nodes()``)."""
    import ray

    return [{k: float(n["Resources"].get(k, 0.0)) for k in KINDS} for n in ray.nodes() if n.get("Alive")]


def wait_for_workers(params: Params, *, gpu: bool, cpus_per_worker: float | None = None, trial_cpu: float = 0.0,
                     pending=pending_nodes, poll_s: float = 10.0, say=sys.stdout.write) -> None:
    """Reserve one run's bundles (and a trial's own ``trial_cpu``), then release them for Ray Train and Tune. Ray
    Train V2 waits for them forever; this wait goes on while nodes are on their way (``pending_nodes``), with a line a
    minute, and ``ray.resources_timeout_s`` after the last one ends in a :class:`ClusterError`."""
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
                raise ClusterError(f"waited {now - start:.0f} s for {what} (ray.num_workers, {shape.cpu_key}, "
                                   f"ray.use_gpu), {timeout:g} s (ray.resources_timeout_s) of them with no node on its "
                                   f"way, and the cluster never had them free (free now: {have}); wait for other jobs "
                                   "to finish, raise ray.resources_timeout_s, or ask for fewer resources")
    finally:
        remove_placement_group(group)


def ray_up() -> bool:
    """This process is connected to a Ray already (e.g. ``transfusion rehearse``'s, which may declare GPUs)."""
    ray = sys.modules.get("ray")  # not imported: not connected
    return ray is not None and ray.is_initialized()


def connect(params: Params, root: Path | None = None, *, tracking: bool = True, cpus_per_worker: float | None = None,
            trial_cpu: float = 0.0, what: str = "pretraining") -> Capacity:
    """What every Ray stage does first, cheapest first: the tracking store is sound; a local Ray's request fits this
    machine (exit 2, before Ray starts); connect; a local Ray's nodes (also a rehearsal's) fit it."""
    check_tracking(root, tracking)
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
    return Capacity(gpu, totals)


def check_tracking(root: Path | None, tracking: bool) -> None:
    """The tracking store is sound (when tracking): a job's first check."""
    if tracking:
        from pipeline.runs.tracking import check_reachable, tracking_uri

        check_reachable(tracking_uri(root))


def check_here(params: Params, root: Path | None = None, *, tracking: bool = True) -> Capacity:
    """What a run in this process (``pipeline.runs.train.in_process``: no Ray) checks first: the tracking store is
    sound, its one worker fits this machine (exit 2); its capacity is this machine's."""
    check_tracking(root, tracking)
    nodes = local_nodes()
    gpu = use_gpu(params, nodes[0]["GPU"])
    check_request(params, nodes, gpu=gpu)
    return Capacity(gpu, nodes[0])


def start_local_ray(num_gpus: int = 0, **init: object) -> None:
    """Start this process's local Ray on this machine's CPUs, declaring ``num_gpus`` GPUs it may not have (as ``ray
    start --num-gpus N``; ``ray.backend: gloo`` trains on the CPU); ``init``: more ``ray.init`` arguments."""
    import ray

    if ray.is_initialized():
        return
    with local_gcs_port(None) as extra:
        _ray_init(**{"num_cpus": usable_cpus(), "num_gpus": num_gpus, **init, **extra})
