"""`--num-clients N`: N load clients as Ray actors spread over the cluster's nodes, merged exactly.

    split_plans   job i goes to client i mod N; each client gets rate / N (N independent Poisson
                  streams of rate / N add up to one of the full rate; gamma streams only approximately)
                  and its share of --max-concurrency; arrival seeds differ per client
    RayClients    one actor per client, round-robin over the alive nodes that take work (advertise
                  CPUs) and have `client_cpus` of them, by hard node affinity (with a soft one, a
                  client meant for a node whose CPUs tandem's workers had all reserved went to
                  another node, and Ray's SPREAD is only best effort: both put 2 clients on one
                  node of 3); a node that
                  cannot host its client within PLACE_TIMEOUT_S fails the run, naming --client-cpus;
                  started together at one wall-clock instant; each returns its raw samples (`ClientRun`)
    merge_runs    every sample once, moved onto one time axis by its client's wall-clock start, in job
                  order; statistics are then computed from the merged raw samples (metrics.py), never
                  from per-client statistics

Clients on different nodes share a time axis only as well as the nodes' clocks agree (NTP: ~ms);
latencies themselves are measured on one clock each and are exact. `address="local"` starts a
loopback-only Ray here (`cluster.serve.local_ray`), as `tandem serve` does.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from dataclasses import dataclass, replace

from cluster.bench.load.client import ClientRun, LoadShape, RequestOutput, Target, run_client
from cluster.bench.load.datasets import Job

log = logging.getLogger("tandem.bench")

START_DELAY_S = 3.0  # actors start their runs this long after the driver hands out the plans
PLACE_TIMEOUT_S = 120.0  # for every client actor to be placed and answer
NAMESPACE = "tandem-bench-load"


@dataclass(frozen=True)
class ClientPlan:
    client_index: int
    jobs: tuple[Job, ...]
    shape: LoadShape


def split_plans(jobs: list[Job], shape: LoadShape, num_clients: int) -> list[ClientPlan]:
    """Client k: jobs k, k + N, k + 2N, ...; rate / N; an even share of the concurrency cap."""
    if num_clients < 1:
        raise ValueError("--num-clients must be >= 1")
    if num_clients > len(jobs):
        raise ValueError(f"--num-clients {num_clients} exceeds the {len(jobs)} jobs of the run")
    cap = shape.max_concurrency
    if cap is not None and cap < num_clients:
        raise ValueError(f"--max-concurrency {cap} cannot be shared by {num_clients} clients (each needs >= 1)")
    plans = []
    for k in range(num_clients):
        share = None if cap is None else cap // num_clients + (1 if k < cap % num_clients else 0)
        client_shape = replace(shape, request_rate=shape.request_rate / num_clients, max_concurrency=share,
                               seed=shape.seed * 1_000_003 + k)
        plans.append(ClientPlan(k, tuple(jobs[k::num_clients]), client_shape))
    return plans


def merge_runs(runs: list[ClientRun]) -> tuple[list[RequestOutput], float, float]:
    """(all samples on the earliest client's time axis in (job, turn) order, run duration, start wall time)."""
    t0_wall_s = min(r.start_wall_s for r in runs)
    outputs = [replace(o, start_s=o.start_s + (r.start_wall_s - t0_wall_s)) for r in runs for o in r.outputs]
    outputs.sort(key=lambda o: (o.index, o.turn))
    seen = {(o.index, o.turn) for o in outputs}
    assert len(seen) == len(outputs), "a request was counted by two clients: plans overlap?"
    return outputs, max(r.start_wall_s - t0_wall_s + r.duration_s for r in runs), t0_wall_s


class LoadClientActor:
    """A Ray actor running one client (`run_client`) in its own event loop."""

    def node(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def run(self, target: Target, plan: ClientPlan, tokenizer_dir: str | None, start_at_wall_s: float) -> ClientRun:
        codec = None
        if tokenizer_dir is not None:
            from cluster.bench.load.datasets import TokenizerCodec

            codec = TokenizerCodec(tokenizer_dir)
        return asyncio.run(run_client(target, list(plan.jobs), plan.shape, codec, False, start_at_wall_s))


class RayClients:
    """`num_clients` client actors on a Ray cluster, made once and reused by every run of a sweep.

    A context manager: entering joins `address` ("local": starts a loopback Ray here) and places the
    actors (round-robin over the nodes); leaving kills them, disconnects, and stops a local Ray."""

    def __init__(self, address: str, num_clients: int, tokenizer_dir: str | None, client_cpus: float = 1.0):
        self.address, self.num_clients, self.client_cpus = address, num_clients, client_cpus
        self.tokenizer_dir = tokenizer_dir  # each actor loads its own tokenizer (multi-turn, chat prompts)
        self.local = None
        self.actors: list = []
        self.nodes: list[str] = []

    def __enter__(self) -> RayClients:
        if self.address == "local":
            self.local = _start_local_ray(math.ceil(self.num_clients * self.client_cpus))
        import ray

        try:
            ray.init(address=self.local.address if self.local else self.address, namespace=NAMESPACE,
                     log_to_driver=True)
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            actor_class = ray.remote(num_cpus=self.client_cpus, max_restarts=0)(LoadClientActor)
            node_ids = client_node_ids(ray.nodes(), self.client_cpus)
            self.actors = [actor_class.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
                node_ids[k % len(node_ids)], soft=False)).remote() for k in range(self.num_clients)]
            try:
                self.nodes = ray.get([a.node.remote() for a in self.actors], timeout=PLACE_TIMEOUT_S)
            except ray.exceptions.GetTimeoutError:
                raise RuntimeError(f"the load clients were not all placed within {PLACE_TIMEOUT_S:.0f} s: a chosen "
                                   f"node has no {self.client_cpus} free CPUs now (lower --client-cpus)") from None
        except BaseException:
            self.__exit__(None, None, None)
            raise
        log.info("%d load clients on %d node(s): %s", self.num_clients, len(set(self.nodes)), ", ".join(self.nodes))
        return self

    def __exit__(self, *exc_info) -> None:
        import ray

        for actor in self.actors:
            ray.kill(actor)
        self.actors = []
        if ray.is_initialized():
            ray.shutdown()
        if self.local is not None:
            self.local.stop()
            self.local = None

    def run(self, target: Target, plans: list[ClientPlan]) -> list[ClientRun]:
        """Each plan on its actor, all starting at one wall-clock instant; their raw runs."""
        import ray

        assert len(plans) == len(self.actors), f"{len(plans)} plans for {len(self.actors)} client actors"
        start_at_wall_s = time.time() + START_DELAY_S
        return ray.get([a.run.remote(target, plan, self.tokenizer_dir, start_at_wall_s)
                        for a, plan in zip(self.actors, plans)])


def client_node_ids(nodes: list[dict], client_cpus: float) -> list[str]:
    """The alive nodes (from `ray.nodes()`) that take work and have at least `client_cpus` CPUs, in
    address order: client k goes to node k mod their number. A node advertising no CPU takes no work
    (a head started with num-cpus 0, as KubeRay's is): even a 0-CPU client is not sent there."""
    fit = sorted((n["NodeManagerAddress"], n["NodeID"]) for n in nodes
                 if n["Alive"] and n["Resources"].get("CPU", 0.0) > 0 and n["Resources"]["CPU"] >= client_cpus)
    if not fit:
        raise RuntimeError(f"no alive Ray node takes work with {client_cpus} CPUs for a load client (--client-cpus)")
    return [node_id for _, node_id in fit]


def _start_local_ray(num_cpus: int):
    from cluster.serve.local_ray import LocalRay

    return LocalRay.start(max(os.cpu_count() or 1, num_cpus), None)
