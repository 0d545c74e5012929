"""Batch jobs on a Ray cluster (engine: ray): each replica is a Ray actor holding one LLM planned for its node.

The driver (run.py's job loop) stays the only writer of the outputs: it hands each idle replica a shard of
requests, reads the answers back one by one as the replica's streaming generator yields them, and writes each
once. A replica that dies has the unanswered requests of its shard put back in the queue for the next idle
replica (Ray restarts the actor, which loads its model again before it takes more); one lost while it loads is
restarted the same way. ray is imported here only, and only when a job runs on it."""

from __future__ import annotations

import logging
import math
import os
import queue
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from offload.errors import ConfigError, OffloadError
from offload.jobs.batch import Request
from offload.jobs.config import RAY_EXTRA_HINT, JobConfig, plan_request
from offload.options import DistributedOptions
from offload.jobs.worker import OnAnswer, OnError, generate_answers, job_timeline, llm_report, load_llm
from offload.planner import Budget
from offload.profile.report import JobCounts, format_report

logger = logging.getLogger("offload")

CONTROL = "control"  # the actors' concurrency group for calls that answer while a shard runs (pid, report)
REPORT_TIMEOUT_S = 60.0  # a replica that does not send its report in this time is reported as lost
_END = object()  # the last item a shard's worker thread puts in its queue


def import_ray():
    """The ray module, or ConfigError naming the extra that brings it."""
    try:
        import ray
    except ImportError:
        raise ConfigError(f"engine: ray needs the ray package, which is not installed; {RAY_EXTRA_HINT}") from None
    return ray


CONNECT_TIMEOUT_S = 10.0  # for a HOST:PORT that does not answer (Ray itself retries for minutes)


def connect(ray, address: str) -> bool:
    """Join the cluster at address unless this process already has (then its cluster is used); True if this call
    connected."""
    if ray.is_initialized():
        return False
    check_reachable(address)
    try:
        ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING)
    except (ConnectionError, RuntimeError, TimeoutError, ValueError) as e:
        start = "start one with `ray start --head`, or set distributed.address to local (a cluster for this job)"
        raise ConfigError(f"cannot reach the Ray cluster at distributed.address {address!r} "
                          f"({' '.join(str(e).split())[:200]}); {start}") from None
    return True


def check_reachable(address: str) -> None:
    """A HOST:PORT that does not accept connections fails here in one sentence, not after Ray's long retries."""
    if address in ("auto", "local"):
        return
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as e:
        raise ConfigError(f"cannot reach the Ray cluster at distributed.address {address!r} ({e.strerror or e}); "
                          f"check the head node's address and port (`ray status` there prints them)") from None


def replicas_that_fit(nodes: list[dict], cpus: float, gpus: float) -> int:
    """How many replicas of cpus (and gpus) each the alive nodes hold, one whole replica per node share."""
    total = 0
    for node in nodes:
        if not node.get("Alive", True):
            continue
        have = node.get("Resources", {})
        fits = math.floor(have.get("CPU", 0) / cpus + 1e-9)
        if gpus:
            fits = min(fits, math.floor(have.get("GPU", 0) / gpus + 1e-9))
        total += fits
    return total


def replica_count(ray, dist: DistributedOptions) -> int:
    """distributed.replicas, checked against what the cluster's nodes hold (else they would wait forever)."""
    fit = replicas_that_fit(ray.nodes(), dist.cpus_per_replica, dist.gpus_per_replica)
    wanted = dist.replicas or fit
    what = f"{dist.cpus_per_replica:g} CPU" + (f" and {dist.gpus_per_replica:g} GPU" if dist.gpus_per_replica else "")
    if fit < max(wanted, 1):
        raise ConfigError(f"key 'distributed.replicas': {max(wanted, 1)} replica(s) of {what} each do not fit the "
                          f"Ray cluster, whose nodes hold {fit}; lower distributed.replicas or "
                          f"distributed.cpus_per_replica / gpus_per_replica, or add nodes")
    return wanted


class Replica:
    """The body of one Ray actor: one LLM planned for the node it runs on, answering shards as a stream."""

    def __init__(self, config: JobConfig, index: int):
        self.config, self.index = config, index
        self.llm, self.timeline = None, None
        self.counts = JobCounts()

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def load(self, n_on_node: int = 1) -> dict:
        """Load and plan the model here (again after a restart), for this replica's share of the node's memory;
        where this replica runs and what it planned."""
        if self.llm is None:
            self.config = node_share(self.config, n_on_node)
            self.llm = load_llm(self.config)
            self.timeline = job_timeline(self.llm)
        return self.describe()

    def describe(self) -> dict:
        plan = getattr(self.llm, "plan", None)
        return {"replica": self.index, "node": socket.gethostname(), "ip": _node_ip(), "pid": os.getpid(),
                "batch_size": self.llm.max_batch_size if self.llm is not None else None,
                "plan": None if plan is None else {"hardware": plan.hardware, "summary": plan.summary_line,
                                                   "weight_format": plan.weight_format}}

    def pid(self) -> int:
        return os.getpid()

    def report(self) -> dict:
        """This replica's report since it (last) started: its requests, where its time went, its memory."""
        return {**self.describe(), "report": llm_report(self.config, self.counts, self.llm, self.timeline)}

    def generate(self, shard: list[Request]):
        """Yield (custom_id, Answer or error message) as each request of the shard finishes (a Ray streaming
        generator: the driver reads each item as soon as it is yielded)."""
        self.load()
        items = queue.SimpleQueue()
        threading.Thread(target=self._generate, args=(shard, items.put), daemon=True).start()
        while (item := items.get()) is not _END:
            if isinstance(item, BaseException):
                raise item
            yield item

    def _generate(self, shard: list[Request], put) -> None:
        """generate_answers in a thread of its own, each result put in the queue the generator reads."""
        start, counts = time.perf_counter(), self.counts
        counts.n_requests += len(shard)

        def on_answer(req: Request, answer) -> None:
            counts.n_done += 1
            counts.n_prompt_tokens += answer.n_prompt
            counts.n_cached_tokens += answer.n_cached
            counts.n_generated_tokens += answer.n_generated
            put((req.key, answer))

        def on_error(req: Request, message: str) -> None:
            counts.n_failed += 1
            put((req.key, message))

        try:
            generate_answers(self.llm, shard, on_answer, on_error)
        except BaseException as e:  # raised by the generator in the actor's thread, so Ray sends it to the driver
            put(e)
        finally:
            counts.generate_s += time.perf_counter() - start
            put(_END)


def node_share(config: JobConfig, n_on_node: int) -> JobConfig:
    """The config of one of n_on_node replicas on a node: the budgets left unset become its share of the node's
    defaults (RAM split between them, VRAM by its fraction of a GPU), so that together they fit the node."""
    memory, gpus = config.memory, config.distributed.gpus_per_replica
    split_cpu, split_gpu = memory.cpu is None and n_on_node > 1, memory.gpu is None and 0 < gpus < 1
    if not (split_cpu or split_gpu):
        return config
    default = Budget.for_hardware(plan_request(config).profile())
    share = {"cpu": default.cpu_bytes // n_on_node} if split_cpu else {}
    share |= {"gpu": int(default.gpu_bytes * gpus)} if split_gpu else {}
    return config.model_copy(update={"memory": memory.model_copy(update=share)})


def _node_ip() -> str | None:
    import ray

    return ray.util.get_node_ip_address() if ray.is_initialized() else None


@dataclass
class Slot:
    """One replica as the driver sees it: its actor, where it runs, and what it is doing."""

    index: int
    actor: Any
    info: dict
    n_on_node: int = 1  # replicas on its node when it started, which share the node's memory
    shard: dict[str, Request] | None = None  # custom_id -> request, for the shard it is answering
    loading: Any = None  # the load call of a restarted replica, until it is back
    failures: int = 0
    n_answered: int = 0
    n_failed: int = 0
    n_generated_tokens: int = 0
    history: list[dict] = field(default_factory=list)  # info of earlier lives (before a restart)


class Replicas:
    """A job's replicas on a Ray cluster; generate_answers runs a job's requests on them, reports() says what each
    did; close() ends them (and the connection to the cluster, if start_replicas made it)."""

    def __init__(self, ray, config: JobConfig, slots: list[Slot], connected: bool):
        from offload.weights.default_model import resolve_model

        self.ray, self.config, self.slots, self.connected = ray, config, slots, connected
        self.path = resolve_model(config.model.path)  # the model's name in the records the driver writes

    def generate_answers(self, requests: list[Request], on_answer: OnAnswer, on_error: OnError) -> None:
        """Answer every request on the replicas, calling on_answer or on_error once per request."""
        Dispatch(self.ray, self.slots, self.config.distributed, on_answer, on_error).run(requests)

    def pids(self) -> list[int]:
        """The process of each replica, as the replica itself says."""
        return self.ray.get([s.actor.pid.options(concurrency_group=CONTROL).remote() for s in self.slots])

    def reports(self) -> list[dict]:
        """Each replica's report (node, plan, tokens/s, where the time went) with what the driver wrote from it."""
        refs = [s.actor.report.options(concurrency_group=CONTROL).remote() for s in self.slots]
        ready, _ = self.ray.wait(refs, num_returns=len(refs), timeout=REPORT_TIMEOUT_S)
        return [_replica_report(self.ray, slot, ref if ref in ready else None) for slot, ref in zip(self.slots, refs)]

    def close(self) -> None:
        for slot in self.slots:
            self.ray.kill(slot.actor, no_restart=True)
        if self.connected:
            self.ray.shutdown()


def _replica_report(ray, slot: Slot, ref) -> dict:
    try:
        own = ray.get(ref) if ref is not None else None
    except ray.exceptions.RayError:
        own = None
    base = own or {**slot.info, "report": None}
    return {**base, "restarts": slot.failures, "answered": slot.n_answered, "failed": slot.n_failed,
            "generated_tokens": slot.n_generated_tokens, "lost": own is None, "earlier_lives": slot.history}


def start_replicas(config: JobConfig) -> Replicas:
    """Connect to the cluster, start the replicas and wait until each has loaded and planned its model."""
    ray = import_ray()
    dist = config.distributed
    connected, actors = connect(ray, dist.address), []
    try:
        actor = ray.remote(concurrency_groups={CONTROL: 1}, max_restarts=dist.max_restarts,
                           max_task_retries=0)(Replica)
        n = replica_count(ray, dist)
        actors += [actor.options(num_cpus=dist.cpus_per_replica, num_gpus=dist.gpus_per_replica).remote(config, i)
                   for i in range(n)]
        failures = [0] * n  # times each replica was lost while it started

        def node_id(a, i: int, retries: int):
            return a.node_id.options(concurrency_group=CONTROL, max_task_retries=retries).remote()

        def load(a, i: int, retries: int):
            return a.load.options(max_task_retries=retries).remote(sharing[i])

        nodes = answer_each(ray, actors, node_id, failures, dist.max_restarts, "starting")
        sharing = [nodes.count(node) for node in nodes]  # replicas on each one's node, which share its memory
        infos = answer_each(ray, actors, load, failures, dist.max_restarts, "loading its model")
    except BaseException:
        for a in actors:
            ray.kill(a, no_restart=True)
        if connected:
            ray.shutdown()
        raise
    for info in infos:
        logger.info(f"replica {info['replica']} on {info['node']} ({info['ip']}, pid {info['pid']}): "
                    f"{(info['plan'] or {}).get('summary', 'placement given')}, batch {info['batch_size']}")
    slots = [Slot(i, a, info, k, failures=f) for i, (a, info, k, f) in enumerate(zip(actors, infos, sharing, failures))]
    return Replicas(ray, config, slots, connected)


def answer_each(ray, actors: list, call, failures: list[int], max_restarts: int, doing: str) -> list:
    """Each starting replica's answer to call(actor, index, max_task_retries), a Ray call. One lost meanwhile is
    asked again, as one lost mid-job is: Ray restarts it, and the call waits for that (up to max_restarts losses
    in all, counted in failures); past them, or if the call raises, one sentence says why the job cannot start."""
    answers, calls = [None] * len(actors), {call(a, i, 0): i for i, a in enumerate(actors)}
    while calls:
        [ref], _ = ray.wait(list(calls), num_returns=1)
        i = calls.pop(ref)
        try:
            answers[i] = _answer(ray, i, ref)
        except ray.exceptions.RayActorError as e:  # its process or node was lost
            failures[i] += 1
            if failures[i] > max_restarts:
                raise OffloadError(f"replica {i} was lost while {doing} ({type(e).__name__}) {failures[i]} time(s), "
                                   f"more than distributed.max_restarts = {max_restarts} allows; nothing was written: "
                                   f"check its node (a process killed while it loads is often out of memory), then "
                                   f"rerun the job") from None
            logger.warning(f"replica {i} was lost while {doing} ({type(e).__name__}); it restarts "
                           f"({failures[i]} of distributed.max_restarts = {max_restarts})")
            calls[call(actors[i], i, -1)] = i  # retried by Ray while the actor is restarting
    return answers


def _answer(ray, index: int, ref):
    """A starting replica's answer to a call, or the one-sentence error it raised."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, OffloadError):
            raise type(e.cause)(f"replica {index} could not start: {e.cause}") from None
        raise


class Dispatch:
    """The driver's loop: hand each idle replica a shard, take each answer as it comes, put back what a lost
    replica left unanswered. The Ray calls are the only messages; the queue of requests is the only state."""

    def __init__(self, ray, slots: list[Slot], dist: DistributedOptions, on_answer: OnAnswer, on_error: OnError):
        self.ray, self.slots, self.dist = ray, slots, dist
        self.on_answer, self.on_error = on_answer, on_error
        self.queue: deque[Request] = deque()
        self.calls: dict[Any, Slot] = {}  # a shard's streaming generator, or a restarted replica's load call

    def run(self, requests: list[Request]) -> None:
        self.queue.extend(requests)
        while self.queue or any(s.shard is not None for s in self.slots):
            self.hand_out()
            if not self.calls:
                raise self.all_lost()
            ready, _ = self.ray.wait(list(self.calls), num_returns=1)
            self.receive(ready[0])

    def alive(self) -> list[Slot]:
        return [s for s in self.slots if s.failures <= self.dist.max_restarts]

    def hand_out(self) -> None:
        """A shard for each idle replica: its planned batch (or distributed.shard_size), and no more than an
        equal share of what is left, so that the last requests are spread over the replicas too."""
        alive = self.alive()
        share = math.ceil(len(self.queue) / max(len(alive), 1))
        for slot in alive:
            if not self.queue or slot.shard is not None or slot.loading is not None:
                continue
            size = min(self.dist.shard_size or slot.info.get("batch_size") or share, share, len(self.queue))
            shard = [self.queue.popleft() for _ in range(max(size, 1))]
            slot.shard = {r.key: r for r in shard}
            self.calls[slot.actor.generate.options(num_returns="streaming").remote(shard)] = slot

    def receive(self, call) -> None:
        slot = self.calls[call]
        if slot.loading is not None:
            return self.reloaded(call, slot)
        try:
            key, result = self.ray.get(next(call))
        except StopIteration:
            del self.calls[call]
            self.requeue(slot)  # every request has its item, so nothing is left unless the replica skipped one
        except self.ray.exceptions.RayTaskError as e:
            raise _replica_error(slot, e) from None
        except self.ray.exceptions.RayError as e:  # the actor died, its node was lost, or an answer was lost
            del self.calls[call]
            self.lost(slot, e)
        else:
            self.accept(slot, key, result)

    def accept(self, slot: Slot, key: str, result) -> None:
        """Pass on an answer (or an error message) of a request the replica holds; one that arrives twice, or
        after its request went to another replica, is dropped: each request is written once."""
        req = slot.shard.pop(key, None) if slot.shard is not None else None
        if req is None:
            return
        if isinstance(result, str):
            slot.n_failed += 1
            self.on_error(req, result)
        else:
            slot.n_answered += 1
            slot.n_generated_tokens += result.n_generated
            self.on_answer(req, result)

    def requeue(self, slot: Slot) -> None:
        if slot.shard:
            self.queue.extendleft(reversed(list(slot.shard.values())))
        slot.shard = None

    def lost(self, slot: Slot, error: Exception) -> None:
        """A replica died mid-shard: its unanswered requests go back to the queue, and once Ray has restarted
        it (up to distributed.max_restarts times), it loads its model and takes shards again."""
        n_left = len(slot.shard or ())
        self.requeue(slot)
        slot.failures += 1
        gone = slot.failures > self.dist.max_restarts
        logger.warning(f"replica {slot.index} on {slot.info.get('node')} (pid {slot.info.get('pid')}) was lost "
                       f"({type(error).__name__}); its {n_left} unanswered request(s) go back to the queue"
                       + ("; it was lost more than distributed.max_restarts times and is not used again" if gone
                          else "; it restarts"))
        if not gone:  # retried by Ray while the actor is restarting (it is unavailable until then)
            slot.loading = slot.actor.load.options(max_task_retries=-1).remote(slot.n_on_node)
            self.calls[slot.loading] = slot

    def reloaded(self, call, slot: Slot) -> None:
        del self.calls[call]
        slot.loading = None
        try:
            info = self.ray.get(call)
        except self.ray.exceptions.RayTaskError as e:
            raise _replica_error(slot, e) from None
        except self.ray.exceptions.RayError as e:
            return self.lost(slot, e)
        slot.history.append(slot.info)
        slot.info = info

    def all_lost(self) -> OffloadError:
        return OffloadError(f"every replica was lost (each more than distributed.max_restarts = "
                            f"{self.dist.max_restarts} times) with {len(self.queue)} request(s) left; the answers "
                            f"written are kept: check the nodes and rerun to resume")


def _replica_error(slot: Slot, e) -> Exception:
    """An error raised in a replica: an OffloadError keeps its type and sentence, naming the replica."""
    if isinstance(e.cause, OffloadError):
        return type(e.cause)(f"replica {slot.index} on {slot.info.get('node')}: {e.cause}")
    return e


def format_replicas(replicas: list[dict]) -> str:
    """Each replica's node, plan and report, indented under one line per replica."""
    lines = []
    for r in replicas:
        plan = r.get("plan") or {}
        lines.append(f"replica {r['replica']} on {r['node']} ({r['ip']}, pid {r['pid']}): {r['answered']} answered, "
                     f"{r['failed']} failed, {r['restarts']} restart(s); plan {plan.get('summary', 'n/a')} on "
                     f"{plan.get('hardware', 'n/a')}, batch {r.get('batch_size')}"
                     + ("; lost, so no report" if r["lost"] else ""))
        if r.get("report"):  # its what-ifs are in the JSON report; printed, they would repeat for each replica
            lines += [f"    {line}" for line in format_report({**r["report"], "what_ifs": None}).splitlines()]
    return "\n".join(lines)
