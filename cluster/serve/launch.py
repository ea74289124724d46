"""`tandem serve`: bring up Ray, the controller and its workers, the dispatcher and the gateway;
take them down again on Ctrl-C / SIGTERM.

    ray (local or --address) -> controller actor -> worker actors (placement groups)
    this process: uvicorn + FastAPI gateway -> dispatcher -> worker actors (deliver / collect)

Shutdown order: uvicorn stops accepting and waits up to `drain_timeout_s` for open requests; what
is still running then is aborted (its KV released on every worker); the workers are stopped; the
placement groups removed; and a Ray instance this process started is stopped (`cluster.serve.local_ray`:
loopback only, token auth, its processes in their own OS session, so a SIGTERM to this process's
group drains like one to this process).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import time
from typing import cast

from cluster.serve.config import ServeConfig

log = logging.getLogger("tandem.serve")


class ServeStartError(RuntimeError):
    """The cluster could not be brought up (a worker failed to load, resources missing)."""


def serve(config: ServeConfig) -> int:
    from cluster.serve.gpu_plan import node_gpu_memory_bytes
    from cluster.serve.gpus import node_gpu_count
    from kernels.model.convert import resolve_model_dir  # not the loader: the gateway's process has no torch
    from kernels.model.generation_config import sampling_defaults
    from kernels.model.tokenizer import load_tokenizer

    # Before Ray starts: a bad model spec (or generation config) fails here, fast and with a plain message.
    model_dir = resolve_model_dir(config.model)
    tokenizer = load_tokenizer(model_dir)
    sampling = sampling_defaults(config.gateway.generation_config, config.model, model_dir)
    log.info("unset sampling fields: %s", sampling.describe())
    node_gpus = None if config.cluster.address is not None else node_gpu_count()
    config, plan = _placed(config, model_dir, node_gpus, node_gpu_memory_bytes())
    for line in plan.describe():
        log.info("%s", line)
    guard = _SignalGuard()
    guard.install()  # a signal while Ray starts: KeyboardInterrupt, and LocalRay.start stops what it started
    local_ray = _start_local_ray(config, node_gpus) if node_gpus is not None else None
    try:
        _connect_ray(config, local_ray)
        guard.install()  # again: Ray's driver installs its own SIGTERM handler in ray.init
        return _serve_on_ray(config, tokenizer, sampling, guard)
    finally:
        guard.stopping = True
        if local_ray is not None:
            import ray

            ray.shutdown()
            local_ray.stop()


def _serve_on_ray(config: ServeConfig, tokenizer, sampling, guard: _SignalGuard) -> int:
    import ray

    controller = None
    try:
        controller = _start_controller(config)
        records = ray.get(controller.views.remote())
        log.info("workers ready: %s", ", ".join(f"{r.worker_id} ({r.session})" for r in records))
        asyncio.run(_serve_gateway(config, controller, records, tokenizer, sampling, guard))
        return 0
    finally:
        if controller is not None:
            _stop_controller(controller, config)


def _placed(config: ServeConfig, model_dir, node_gpus: int | None, gpu_bytes: int | None):
    """(`config` with its CUDA workers fitted on the node's GPUs and every size resolved, the plan)."""
    from cluster.serve.memory import ModelShape, node_ram_bytes, plan_memory

    config = with_debug_kv(fit_gpus(config, node_gpus))
    return plan_memory(config, ModelShape.read(model_dir), node_ram_bytes(), gpu_bytes)


def print_plan(config: ServeConfig, gpus: int | None = None, gpu_memory_gib: float | None = None) -> int:
    """`tandem serve --plan-only`: what `serve` would place where, for this node or for one of `gpus`
    GPUs of `gpu_memory_gib` each, printed; nothing is started. Exit code 0."""
    from cluster.serve.gpu_plan import node_gpu_memory_bytes
    from cluster.serve.gpus import node_gpu_count
    from kernels.model.convert import resolve_model_dir

    node_gpus = gpus if gpus is not None else node_gpu_count()
    gpu_bytes = int(gpu_memory_gib * 2**30) if gpu_memory_gib is not None else node_gpu_memory_bytes()
    local = config.cluster.address is None
    config, plan = _placed(config, resolve_model_dir(config.model), node_gpus if local else None, gpu_bytes)
    ray = (f"Ray: a local instance told of {node_gpus} GPU(s)" if local
           else f"Ray: the cluster at {config.cluster.address}")
    gpu = f" of {gpu_bytes / 2**30:.0f} GiB" if gpu_bytes else ""
    print(f"{ray}{gpu}; {config.model}")
    for name in ("prefill", "decode", "colocated"):
        group = getattr(config, name)
        if group.count:
            print(f"  {name} x{group.count}: {group.num_cpus:g} CPU, {group.num_gpus:g} GPU each, "
                  f"on {group.engine.device} in {group.engine.dtype}")
    for line in plan.describe():
        print(line)
    cuda = [g.engine for g in (config.prefill, config.decode, config.colocated) if g.count and g.engine.device != "cpu"]
    if cuda:
        from cluster.serve.gpu_plan import tp_advice
        from cluster.serve.memory import ModelShape

        shape = ModelShape.read(resolve_model_dir(config.model))
        print(tp_advice(shape, shape.weight_bytes(cuda[0], prepacked=False), cuda[0].dtype,
                        config.memory.gpu_memory_utilization))
    return 0


def with_debug_kv(config: ServeConfig) -> ServeConfig:
    """`config` with every group's engine checking KV after each step where TANDEM_DEBUG_KV is set here:
    workers are Ray actors that do not see this process's environment (on a cluster, not even its node)."""
    from common.config import debug_kv_from_env

    if not debug_kv_from_env():
        return config
    log.info("TANDEM_DEBUG_KV is set: every worker checks its KV integrity after each step (slower)")
    groups = {name: dataclasses.replace(g, engine=dataclasses.replace(g.engine, debug_kv=True))
              for name, g in (("prefill", config.prefill), ("decode", config.decode), ("colocated", config.colocated))}
    return config.with_groups(groups)


def fit_gpus(config: ServeConfig, node_gpus: int | None) -> ServeConfig:
    """`config` with its CUDA workers fitted on a local instance's `node_gpus` (`cluster.serve.gpus`);
    as it is on a cluster Ray already runs (None). Raises ServeStartError where they cannot fit."""
    from cluster.serve.gpus import GPUPlacementError, gpu_demand, share_gpus

    if node_gpus is None:
        return config
    try:
        fitted = share_gpus(config, node_gpus)
    except GPUPlacementError as exc:
        raise ServeStartError(str(exc)) from None
    if fitted is not config:
        log.info("%d GPU(s) for CUDA workers asking %g: each asks %g of one", node_gpus, gpu_demand(config),
                 next(g.num_gpus for g in (fitted.prefill, fitted.decode, fitted.colocated) if g.num_gpus))
    return fitted


def _start_local_ray(config: ServeConfig, node_gpus: int):
    """A loopback-only, token-authenticated Ray instance in its own OS session (`cluster.serve.local_ray`),
    told of the node's `node_gpus` GPUs (never of more: Ray would hand out devices that do not exist)."""
    from cluster.serve.local_ray import LocalRay, LocalRayError

    groups = (config.prefill, config.decode, config.colocated)
    wanted = sum(g.count * g.num_cpus for g in groups)
    num_cpus = config.cluster.num_cpus or max(os.cpu_count() or 1, int(wanted + 0.999))
    resources: dict[str, float] = {}  # the one node hosts every group, so it has what each asks for
    for group in groups:
        for name, amount in group.resources.items():
            resources[name] = resources.get(name, 0.0) + group.count * amount
    try:
        return LocalRay.start(num_cpus, node_gpus, resources)
    except LocalRayError as exc:
        raise ServeStartError(f"could not start a local Ray instance: {exc}") from exc


def _connect_ray(config: ServeConfig, local_ray) -> None:
    """Join `cluster.address`, or the local instance this process started."""
    import ray

    address = config.cluster.address if local_ray is None else local_ray.address
    ray.init(address=address, namespace=config.cluster.namespace, log_to_driver=True)


def _start_controller(config: ServeConfig):
    import ray
    from ray.actor import ActorHandle
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from cluster.serve.controller import CONTROLLER_NAME, Controller

    t0 = time.monotonic()
    namespace = config.cluster.namespace
    # On this process's node (the head, in a deployment): losing a worker node must not take it along.
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    try:
        # a handle (Ray types it `ActorHandle[T] | type[T]`, so that `@ray.method`s type-check)
        controller = cast(ActorHandle, ray.remote(num_cpus=0)(Controller).options(
            name=CONTROLLER_NAME, namespace=namespace, scheduling_strategy=here).remote(config))
    except ValueError:  # the name is taken
        raise ServeStartError(f"another tandem serve is running in Ray namespace {namespace!r} on this cluster "
                              "(give this one its own cluster.namespace)") from None
    try:
        ray.get(controller.start.remote(), timeout=config.cluster.worker_start_timeout_s + 60)
    except BaseException as exc:
        ray.kill(controller)
        if isinstance(exc, (ray.exceptions.RayError, ray.exceptions.GetTimeoutError)):
            from cluster.serve.controller import last_line

            raise ServeStartError(f"the workers did not start: {last_line(exc)}") from exc
        raise
    log.info("controller and workers started in %.1fs", time.monotonic() - t0)
    return controller


def _stop_controller(controller, config: ServeConfig) -> None:
    import ray

    try:
        ray.get(controller.shutdown.remote(), timeout=60)
    except Exception as exc:  # noqa: BLE001 - shutting down: report and go on killing
        log.warning("controller shutdown failed: %s", exc)
    ray.kill(controller)


class _SignalGuard:
    """SIGINT/SIGTERM before the gateway serves: stop starting (KeyboardInterrupt). While it serves,
    uvicorn owns the signals (drain, then stop) and re-raises the signal when it is done; that
    re-raise, and any later signal, must not cut short stopping the workers and Ray (nor does a
    signal once `stopping` is set, after a failed start)."""

    def __init__(self) -> None:
        self.server: object | None = None  # the gateway's uvicorn server, once it serves
        self.stopping = False

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.server is None and not self.stopping:
            raise KeyboardInterrupt(f"signal {signum} during start-up")
        log.info("signal %d: already shutting down", signum)


def _relay_host(config: ServeConfig) -> str | None:
    """Where the token relay listens (`cluster.token_relay`): where the transfer engine binds."""
    if not config.cluster.token_relay:
        return None
    if config.transport.hostname == "auto":
        import ray

        return ray.util.get_node_ip_address()
    return config.transport.hostname


async def _serve_gateway(config: ServeConfig, controller, records, tokenizer, sampling, guard: _SignalGuard) -> None:
    from cluster.serve.actors import ControllerViews
    from router.dispatcher import Dispatcher, DispatcherConfig
    from router.gateway import GatewayServer, build_app
    from router.policy import Policy

    rc = config.router
    dispatcher = Dispatcher.build(ControllerViews(controller), DispatcherConfig(
        model_name=config.model, max_model_len=min(r.max_request_tokens for r in records),
        policy=Policy(rc.policy), policy_params=rc,
        max_pending=config.gateway.max_pending_requests, max_transfer_retries=rc.max_transfer_retries,
        refresh_interval_s=config.cluster.heartbeat_interval_s, landing_timeout_s=config.transport.bootstrapping_s,
        prefill_answers=rc.prefill_answers, relay_host=_relay_host(config), migration=rc.migration(),
        admission=rc.admission(config.prefill.engine.chunk_size, min(
            g.engine.max_running_requests for g in (config.decode, config.colocated) if g.count))), tokenizer=tokenizer)

    async def on_shutdown() -> None:
        aborted = dispatcher.abort_all()  # uvicorn already waited `drain_timeout_s` for them
        if aborted:
            log.warning("aborted %d requests still running at shutdown", aborted)
        await dispatcher.close()

    async def restart_workers(worker_ids: list[str] | None, drain_timeout_s: float | None) -> list[dict]:
        return await controller.rolling_restart.remote(worker_ids, drain_timeout_s)

    app = build_app(dispatcher, config.gateway, sampling=sampling, on_shutdown=on_shutdown,
                    restart_workers=restart_workers)
    # The gateway's own server: the connection bounds of `config.gateway` apply as in every other use.
    server = GatewayServer(app, config.gateway, graceful_timeout_s=config.cluster.drain_timeout_s,
                           log_level="info", access_log=False)
    try:
        server.bind()
    except OSError as exc:
        raise ServeStartError(f"the gateway cannot listen on {config.gateway.host}:{config.gateway.port}: "
                              f"{exc.strerror or exc}") from None
    await dispatcher.start()
    guard.server = server.uvicorn_server  # uvicorn owns SIGINT/SIGTERM while it serves (drain, then stop)
    await server.serve()
