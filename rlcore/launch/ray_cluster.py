"""Launch one experiment on a Ray cluster: engine servers and trainer ranks as actors of one placement group.

    ray start --head                       # on the head node; on the others: ray start --address HEAD:6379
    rlcore-launch --ray --address auto --alloc engines:2+trainer:4 --model /models/qwen2.5-1.5b \\
        -- experiments/gsm8k_grpo.py grpo --model /models/qwen2.5-1.5b
    (or: rlcore-ray-launch / python -m rlcore.launch.ray_cluster --address auto --alloc ... -- script.py [flags])

The allocation syntax is ``rlcore.launch``'s: ``engines:N[xT]+trainer:M``. One placement group holds
``N + M`` bundles — engine ``i`` is bundle ``i`` with ``{"GPU": T}``, trainer rank ``r`` is bundle ``N + r``
with ``{"GPU": 1}``; on a cluster without GPUs every bundle is ``{"CPU": 1}`` and every process gets
``CUDA_VISIBLE_DEVICES=""``. Each bundle gets one :class:`ProcessHost` actor, which runs one child process
on its node:

- an engine actor starts ``python -m rlcore.serve`` (``--engine embedded``) or SGLang on the GPUs Ray gave
  it, waits for ``GET /health`` and reports ``host:port``. Servers bind ``0.0.0.0`` and advertise the node's
  IP when the cluster spans several nodes, else they bind and advertise ``127.0.0.1`` (``--host`` overrides);
- trainer rank ``r`` runs ``python script.py [flags]`` with the variables torchrun would set (``RANK``,
  ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``/``MASTER_PORT`` of
  rank 0's node, ``CUDA_VISIBLE_DEVICES`` = the node's trainer GPUs in local-rank order) plus
  ``RLCORE_ENGINE_ADDRS``. The experiment file is the same one ``rlcore.launch`` runs.

Failures: a trainer rank that exits non-zero (or whose actor dies) ends the run with that code. An engine
that dies is reported and left out: the trainer's ``EngineClient`` marks the server dead after its retries
and keeps generating on the others (docs/spec/system.md §13). Only when every engine is gone does the launcher
stop the run (exit code 1).

Lifetimes: children run in their own process group and get ``SIGKILL`` if their actor process dies
(``PR_SET_PDEATHSIG``, Linux). On normal exit, on an exception, on SIGINT or SIGTERM the launcher stops
every child (SIGTERM, SIGKILL after a grace period), kills every actor and removes the placement group; a
Ray session it started itself is shut down. The script and ``rlcore`` must be importable at the same path
on every node (a shared filesystem or the same checkout); disk weight updates need a directory every node
sees (``--engine.disk-root``).

Why not Ray Train's ``TorchTrainer`` for the trainer ranks (checked against Ray 2.60's source; docs/scaling.md
has the details): it runs a Python function in its workers and always calls ``dist.init_process_group`` there
first, while the trainer here is an arbitrary experiment script that sets up its own group, as under torchrun
(running it inside the worker initialises the group twice; as the worker's child, the env must be rebuilt and
rank 0's ``MASTER_PORT`` is taken); its worker group has its own placement group of identical bundles, so the
engines' ``{"GPU": T}`` bundles cannot share it; it restarts the group on failure instead of returning the
trainer's exit code and tolerating dead engines; and it needs ``ray[train]``. Placement groups, actors and GPU
ids are Ray's; only ``trainer_envs`` (torchrun's variables) is ours.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import tyro

from rlcore import launch

ENV_ADDRS = launch.ENV_ADDRS
PYTHON = "{python}"
"""Placeholder for ``argv[0]``: replaced by the interpreter of the actor that starts the child."""
_REPO_ROOT = str(Path(__file__).resolve().parents[2])
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class RayLaunchConfig:
    """How ``launch_ray`` uses the Ray cluster (the allocation itself is a ``launch.Allocation``)."""

    address: str | None = None
    """Cluster to join: 'auto' (a running ``ray start`` cluster), 'ray://host:10001' (Ray Client) or None
    (the current Ray session if one is initialised, else a new local one-node cluster)."""
    engine: Literal["embedded", "sglang"] = "embedded"
    """Engine server: ``rlcore.serve`` or SGLang (tensor parallel needs SGLang)."""
    host: str = "auto"
    """Address the engine servers bind: 'auto' = 0.0.0.0 when the cluster has several nodes, else 127.0.0.1."""
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """Placement-group strategy (PACK: as few nodes as possible)."""
    use_gpus: bool | None = None
    """Ask for GPU bundles; None: when the cluster has GPUs."""
    engine_args: tuple[str, ...] = ()
    """Extra flags appended to every engine server's command line."""
    setup_timeout_s: float = 300.0
    """Limit for placing the group and for the engines to become healthy."""
    stop_grace_s: float = 10.0
    """Time children get between SIGTERM and SIGKILL at teardown."""
    poll_s: float = 0.5
    """Period of the liveness checks of trainer ranks and engines."""
    num_cpus: int | None = None
    """CPUs of a local cluster this launcher starts itself (address None, no session yet); None: all."""
    name: str = ""
    """Prefix of the actor and placement-group names (``<name>-engine-<i>``, ``<name>-trainer-<r>``);
    empty: 'rlcore-' plus a random suffix."""

    def __post_init__(self) -> None:
        if self.setup_timeout_s <= 0 or self.stop_grace_s < 0 or self.poll_s <= 0:
            raise ValueError(
                "RayLaunchConfig.setup_timeout_s and poll_s must be > 0 and stop_grace_s >= 0; "
                f"got {self.setup_timeout_s}, {self.poll_s}, {self.stop_grace_s}"
            )
        if self.engine not in ("embedded", "sglang"):
            raise ValueError(f"RayLaunchConfig.engine must be 'embedded' or 'sglang', got {self.engine!r}")
        if self.num_cpus is not None and self.num_cpus < 1:
            raise ValueError(f"RayLaunchConfig.num_cpus must be >= 1 or None, got {self.num_cpus}")


# ----------------------------------------------------------------------------------------------------------
# Pure helpers (no Ray needed)
# ----------------------------------------------------------------------------------------------------------


def placement_bundles(alloc: launch.Allocation, use_gpus: bool) -> list[dict[str, float]]:
    """Bundles of the run's placement group: the N engines first, then the M trainer ranks."""
    if not use_gpus:
        return [{"CPU": 1.0} for _ in range(alloc.engines + alloc.trainer)]
    return [{"GPU": float(alloc.engine_gpus)}] * alloc.engines + [{"GPU": 1.0}] * alloc.trainer


def bind_host(host: str, num_nodes: int) -> str:
    """Resolve ``host='auto'``: 0.0.0.0 when the servers must be reachable from other nodes, else 127.0.0.1."""
    if host != "auto":
        return host
    return "0.0.0.0" if num_nodes > 1 else "127.0.0.1"


def advertised(host: str, node_ip: str, port: int) -> str:
    """``host:port`` other processes reach a server at: the node's IP for a wildcard bind, else ``host``."""
    h = node_ip if host in ("0.0.0.0", "::", "") else host
    return f"[{h}]:{port}" if ":" in h else f"{h}:{port}"


def trainer_envs(
    node_ips: Sequence[str],
    gpu_ids: Sequence[Sequence[str]],
    *,
    master_addr: str,
    master_port: int,
    use_gpus: bool,
) -> list[dict[str, str]]:
    """torchrun's per-rank environment for ranks placed on ``node_ips[r]`` holding Ray GPUs ``gpu_ids[r]``.

    Local ranks count ranks of one node in rank order; nodes are numbered (``GROUP_RANK``) in order of their
    first rank. Each rank sees all of its node's trainer GPUs, ordered by local rank (NCCL peer access needs
    them visible), and ``LOCAL_RANK`` selects its own.
    """
    if len(node_ips) != len(gpu_ids):
        raise ValueError(
            f"node_ips and gpu_ids need one entry per rank, got {len(node_ips)} and {len(gpu_ids)}"
        )
    world = len(node_ips)
    nodes = list(dict.fromkeys(node_ips))
    per_node = {ip: [r for r in range(world) if node_ips[r] == ip] for ip in nodes}
    envs = []
    for r, ip in enumerate(node_ips):
        local = per_node[ip]
        if use_gpus:
            visible = ",".join(g for q in local for g in gpu_ids[q])
        else:
            visible = ""
        envs.append(
            {
                "RANK": str(r),
                "WORLD_SIZE": str(world),
                "LOCAL_RANK": str(local.index(r)),
                "LOCAL_WORLD_SIZE": str(len(local)),
                "GROUP_RANK": str(nodes.index(ip)),
                "MASTER_ADDR": master_addr,
                "MASTER_PORT": str(master_port),
                "CUDA_VISIBLE_DEVICES": visible,
            }
        )
    return envs


# ----------------------------------------------------------------------------------------------------------
# The actor: one child process per bundle
# ----------------------------------------------------------------------------------------------------------


def _die_with_parent() -> None:
    """preexec_fn: SIGKILL this child when the process that started it dies (e.g. its actor is killed)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class ProcessHost:
    """Runs one child process on the node (and GPUs) Ray placed it on; used as a Ray actor.

    Methods run one at a time on the actor's main thread (the default for a Ray actor), which the child's
    parent-death signal is tied to; none of them blocks longer than ``wait_healthy``'s timeout.
    """

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None

    def node_ip(self) -> str:
        """IP of this actor's node, as Ray knows it."""
        import ray

        return ray.util.get_node_ip_address()

    def gpu_ids(self) -> list[str]:
        """GPU ids Ray assigned to this actor (empty on CPU bundles)."""
        import ray

        return [str(g) for g in ray.get_gpu_ids()]

    def free_port(self, host: str = "127.0.0.1") -> int:
        """A currently free TCP port of this node on ``host``."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family) as s:
            s.bind((host, 0))
            return s.getsockname()[1]

    def start(self, argv: Sequence[str], env: Mapping[str, str], cwd: str | None = None) -> int:
        """Start ``argv`` (``PYTHON`` as ``argv[0]`` means this actor's interpreter) with ``env`` added to the
        actor's environment, in a new session; returns the child's pid."""
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"this ProcessHost already runs pid {self.proc.pid}; stop it first")
        cmd = [sys.executable if a == PYTHON and i == 0 else a for i, a in enumerate(argv)]
        full_env = {**os.environ, **env}
        full_env["PYTHONPATH"] = os.pathsep.join(p for p in (_REPO_ROOT, full_env.get("PYTHONPATH", "")) if p)
        self.proc = subprocess.Popen(
            cmd, env=full_env, cwd=cwd, start_new_session=True, preexec_fn=_die_with_parent
        )
        return self.proc.pid

    def wait_healthy(self, addr: str, timeout_s: float) -> None:
        """Poll ``http://addr/health`` until it answers 200; fail fast if the child exits."""
        if self.proc is None:
            raise RuntimeError("wait_healthy before start")
        launch.wait_healthy([self.proc], [addr], timeout_s)

    def poll(self) -> int | None:
        """The child's exit code, or None while it runs."""
        return None if self.proc is None else self.proc.poll()

    def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM the child's process group, SIGKILL after ``grace_s``; returns its exit code."""
        if self.proc is None:
            return None
        launch.terminate([self.proc], grace_s)
        return self.proc.returncode


# ----------------------------------------------------------------------------------------------------------
# The driver
# ----------------------------------------------------------------------------------------------------------


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise ImportError("--ray needs Ray: pip install -e '.[ray]' in the rlcore checkout (or pip install ray)") from e
    return ray


@contextlib.contextmanager
def _session(ray: Any, cfg: RayLaunchConfig) -> Iterator[None]:
    """Join ``cfg.address`` (or reuse the current session, or start a local one); shut down only what we started."""
    if ray.is_initialized():
        yield
        return
    kwargs: dict[str, Any] = {"address": cfg.address, "log_to_driver": True}
    if cfg.address is None:
        kwargs.update(num_cpus=cfg.num_cpus, include_dashboard=False)
    ray.init(**kwargs)
    try:
        yield
    finally:
        ray.shutdown()


@contextlib.contextmanager
def _signals_raise() -> Iterator[None]:
    """Turn SIGINT/SIGTERM into KeyboardInterrupt so ``finally`` blocks tear down (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_signal(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _cause(ray: Any, e: Exception) -> Exception:
    """The user-level exception inside a RayTaskError (the actor method's own error)."""
    if isinstance(e, ray.exceptions.RayTaskError) and isinstance(getattr(e, "cause", None), Exception):
        return e.cause
    return e


def _log(msg: str) -> None:
    print(f"[ray_launch] {msg}", flush=True)


class _Run:
    """Actors and placement group of one launch; ``teardown`` is safe to call at any point of ``start``."""

    def __init__(self, ray: Any, alloc: launch.Allocation, cfg: RayLaunchConfig):
        self.ray, self.alloc, self.cfg = ray, alloc, cfg
        self.name = cfg.name or f"rlcore-{uuid.uuid4().hex[:8]}"
        self.pg: Any = None
        self.engines: list[Any] = []
        self.ranks: list[Any] = []
        self.addrs: list[str] = []
        self.ports: dict[str, set[int]] = {}
        self.host_cls = ray.remote(ProcessHost)

    def _actor(self, bundle: int, role: str, gpus: float) -> Any:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(
            placement_group=self.pg, placement_group_bundle_index=bundle
        )
        return self.host_cls.options(
            name=f"{self.name}-{role}",
            num_cpus=0 if gpus else 1,
            num_gpus=gpus,
            max_restarts=0,
            scheduling_strategy=strategy,
        ).remote()

    def _port(self, actor: Any, node_ip: str, host: str) -> int:
        """A free port on the actor's node that no other server of this run was given.

        Servers bind seconds after their port is picked (after loading the model), and the kernel may hand the
        same free port to two consecutive probes, so ports are deduplicated per node.
        """
        taken = self.ports.setdefault(node_ip, set())
        for _ in range(64):
            port = self.ray.get(actor.free_port.remote(host))
            if port not in taken:
                taken.add(port)
                return port
        raise RuntimeError(f"no unused free port found on node {node_ip} after 64 tries")

    def start(self, trainer_cmd: Sequence[str], model: str) -> None:
        ray, alloc, cfg = self.ray, self.alloc, self.cfg
        from ray.util.placement_group import placement_group

        cluster_gpus = int(ray.cluster_resources().get("GPU", 0))
        use_gpus = cluster_gpus > 0 if cfg.use_gpus is None else cfg.use_gpus
        if use_gpus and alloc.total_gpus > cluster_gpus:
            raise ValueError(f"--alloc needs {alloc.total_gpus} GPUs but the Ray cluster has {cluster_gpus}")
        num_nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
        host = bind_host(cfg.host, num_nodes)
        bundles = placement_bundles(alloc, use_gpus)
        self.pg = placement_group(bundles, strategy=cfg.strategy, name=f"{self.name}-pg")
        try:
            ray.get(self.pg.ready(), timeout=cfg.setup_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(
                f"placement group {bundles} ({cfg.strategy}) not placed after {cfg.setup_timeout_s:.0f} s; the "
                f"cluster has {ray.available_resources()} free: shrink --alloc, add nodes or free resources"
            ) from None
        _log(f"placement group {self.name}-pg ready on {num_nodes} node(s): {bundles}")

        # --- engines: one actor per bundle [0, N), each starts its server and waits for /health ---
        for i in range(alloc.engines):  # appended one by one so that teardown sees every created actor
            self.engines.append(self._actor(i, f"engine-{i}", alloc.engine_gpus if use_gpus else 0))
        local_addrs = []
        for i, actor in enumerate(self.engines):
            ip = ray.get(actor.node_ip.remote())
            port = self._port(actor, ip, host)
            cmd = launch.engine_command(cfg.engine, model, host, port, alloc.engine_gpus, cfg.engine_args)
            cmd[0] = PYTHON
            env = {"TRITON_CACHE_DIR": f"/tmp/rlcore-triton-{self.name}-engine{i}"}
            if not use_gpus:
                env["CUDA_VISIBLE_DEVICES"] = ""
            ray.get(actor.start.remote(cmd, env))
            self.addrs.append(advertised(host, ip, port))
            local_addrs.append(f"127.0.0.1:{port}" if host in ("0.0.0.0", "") else self.addrs[-1])
        try:
            ray.get(
                [a.wait_healthy.remote(la, cfg.setup_timeout_s) for a, la in zip(self.engines, local_addrs)]
            )
        except ray.exceptions.RayTaskError as e:
            raise _cause(ray, e) from None
        if self.addrs:
            _log(f"engines healthy: {','.join(self.addrs)}")

        # --- trainer: one actor per bundle [N, N+M), torchrun's environment, the experiment script ---
        for r in range(alloc.trainer):
            self.ranks.append(self._actor(alloc.engines + r, f"trainer-{r}", 1 if use_gpus else 0))
        ips = ray.get([a.node_ip.remote() for a in self.ranks])
        gpu_ids = ray.get([a.gpu_ids.remote() for a in self.ranks])
        multi_node = len(set(ips)) > 1 or num_nodes > 1
        master_addr = ips[0] if multi_node else "127.0.0.1"
        master_port = self._port(self.ranks[0], ips[0], "0.0.0.0" if multi_node else "127.0.0.1")
        envs = trainer_envs(ips, gpu_ids, master_addr=master_addr, master_port=master_port, use_gpus=use_gpus)
        common = {ENV_ADDRS: ",".join(self.addrs), "NCCL_CUMEM_ENABLE": "0", "NCCL_NVLS_ENABLE": "0"}
        for key in ("NCCL_CUMEM_ENABLE", "NCCL_NVLS_ENABLE"):
            common[key] = os.environ.get(key, common[key])
        argv = [PYTHON, *trainer_cmd]
        ray.get([a.start.remote(argv, {**common, **e}, os.getcwd()) for a, e in zip(self.ranks, envs)])
        _log(f"trainer started: {alloc.trainer} rank(s), master {master_addr}:{master_port}")

    def _poll(self, actor: Any) -> tuple[int | None, str]:
        """(exit code or None while running, reason); an actor that died counts as exit code 1."""
        try:
            return self.ray.get(actor.poll.remote(), timeout=60), ""
        except self.ray.exceptions.RayActorError as e:
            return 1, f"actor died: {type(e).__name__}"
        except self.ray.exceptions.GetTimeoutError:
            return None, ""

    def monitor(self) -> int:
        """Block until the trainer finishes (its exit code) or every engine is gone (1)."""
        live = dict(enumerate(self.engines))
        while True:
            rcs = [self._poll(a) for a in self.ranks]
            bad = [(r, rc, why) for r, (rc, why) in enumerate(rcs) if rc not in (None, 0)]
            if bad:
                r, rc, why = bad[0]
                _log(f"trainer rank {r} exited with code {rc} {why}; stopping")
                return rc
            if all(rc == 0 for rc, _ in rcs):
                return 0
            for i, actor in list(live.items()):
                rc, why = self._poll(actor)
                if rc is not None:
                    del live[i]
                    _log(
                        f"engine {i} at {self.addrs[i]} died (code {rc}{', ' + why if why else ''}); the trainer continues on "
                        f"{len(live)} engine(s)"
                    )
            if self.addrs and not live:
                _log("every engine is gone; stopping")
                return 1
            time.sleep(self.cfg.poll_s)

    def teardown(self) -> None:
        """Stop every child (SIGTERM, then SIGKILL), kill every actor, remove the placement group."""
        ray = self.ray
        actors = self.ranks + self.engines
        refs = []
        for a in actors:
            with contextlib.suppress(Exception):
                refs.append(a.stop.remote(self.cfg.stop_grace_s))
        if refs:
            with contextlib.suppress(Exception):
                ray.wait(refs, num_returns=len(refs), timeout=self.cfg.stop_grace_s + 10)
        for a in actors:
            with contextlib.suppress(Exception):
                ray.kill(a, no_restart=True)
        if self.pg is not None:
            from ray.util.placement_group import remove_placement_group

            with contextlib.suppress(Exception):
                remove_placement_group(self.pg)
        self.ranks, self.engines, self.pg = [], [], None


def launch_ray(
    alloc: launch.Allocation,
    trainer_cmd: Sequence[str],
    *,
    model: str,
    cfg: RayLaunchConfig = RayLaunchConfig(),
) -> int:
    """Run the engines and the trainer of ``alloc`` on a Ray cluster; returns the trainer's exit code.

    Blocks until the trainer ends (or every engine is gone) and always tears the run down before returning.
    """
    if not trainer_cmd:
        raise ValueError(
            "trainer_cmd is empty; pass the experiment script and its flags, e.g. ['e.py', '--steps', '2']"
        )
    ray = _import_ray()
    with _session(ray, cfg), _signals_raise():
        run = _Run(ray, alloc, cfg)
        try:
            run.start(trainer_cmd, model)
            return run.monitor()
        finally:
            run.teardown()


@dataclass(frozen=True, kw_only=True)
class RayArgs:
    """Command line of ``rlcore-ray-launch`` / ``python -m rlcore.launch.ray_cluster`` (also the Ray flags of
    ``rlcore-launch --ray``): ``--alloc ... --model DIR -- script.py [its flags]``."""

    alloc: str
    """Allocation ``engines:N[xT]+trainer:M``: N engine servers of T GPUs each, then an M-rank trainer."""
    model: str
    """HF model directory served by the engines (the same path on every node)."""
    engine: Literal["embedded", "sglang"] = "embedded"
    """Engine server: ``rlcore.serve`` (embedded) or SGLang (tensor parallel needs SGLang)."""
    host: str | None = "auto"
    """Address the engine servers bind; auto: 0.0.0.0 on a multi-node cluster, else 127.0.0.1."""
    setup_timeout: float = 300.0
    """Seconds allowed for placing the group and for every engine to answer /health."""
    address: str | None = None
    """Ray cluster to join: 'auto', 'ray://HOST:10001' (Ray Client), or None for a local cluster."""
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """Placement-group strategy (PACK: as few nodes as possible)."""
    num_cpus: int | None = None
    """CPUs of a local cluster started here (no --address); None: all of this machine's."""
    cmd: Annotated[tuple[str, ...], tyro.conf.Positional, tyro.conf.arg(metavar="-- SCRIPT [FLAGS]")] = ()
    """The trainer command after ``--``: the experiment script and its own flags."""

    def __post_init__(self) -> None:
        launch.parse_allocation(self.alloc)  # raises, naming --alloc and the syntax
        if not self.cmd:
            raise ValueError(
                "give the trainer command after '--', e.g. -- experiments/gsm8k_grpo.py grpo --model PATH"
            )

    def ray_config(self) -> RayLaunchConfig:
        """The ``RayLaunchConfig`` these flags select."""
        return RayLaunchConfig(
            address=self.address, engine=self.engine, host=self.host or "auto", strategy=self.strategy,
            setup_timeout_s=self.setup_timeout, num_cpus=self.num_cpus,
        )  # fmt: skip


def run_args(a: RayArgs) -> int:
    """Run the launch ``a`` describes; the trainer's exit code (130 after SIGINT/SIGTERM, once torn down)."""
    try:
        return launch_ray(launch.parse_allocation(a.alloc), a.cmd, model=a.model, cfg=a.ray_config())
    except KeyboardInterrupt as e:  # SIGINT / SIGTERM: the run was already torn down
        _log(f"interrupted ({e}); children stopped, placement group removed")
        return 130


def main(argv: Sequence[str] | None = None) -> int:
    """``rlcore-ray-launch``: parse ``argv`` (default ``sys.argv[1:]``) and ``run_args``."""
    return run_args(tyro.cli(RayArgs, args=argv, prog="rlcore-ray-launch", description=__doc__))


if __name__ == "__main__":
    sys.exit(main())
