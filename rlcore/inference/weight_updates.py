"""The engine's weight-update methods (full loads from a state dict, disk, shared tensors or a broadcast group, and
LoRA adapters), kept apart from the scheduling code of :mod:`rlcore.inference.engine`.

Every load is staged and checked on the calling thread (``weights.stage_weights``) and committed by the engine's
loop thread between two forward passes, so no token is sampled from half-loaded weights; a failed load changes
nothing. :class:`WeightUpdates` is a mixin of :class:`rlcore.inference.engine.Engine`: it uses the engine's
``model``, ``device``, ``_call`` (run on the loop thread), ``_s`` (the scheduler), ``_groups`` and ``_lora``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from rlcore.inference.lora import LoraAdapter
from rlcore.inference.protocol import EngineError
from rlcore.inference.weights import (
    Abandoned,
    CommitGate,
    check_complete,
    check_specs,
    commit_weights,
    hf_ignored_keys,
    init_custom_process_group,
    named_tensors,
    parse_dtype,
    read_hf_checkpoint,
    stage_weights,
)


class WeightUpdates:
    """Weight loads of an :class:`~rlcore.inference.engine.Engine` (see the module docstring)."""

    model: torch.nn.Module
    device: torch.device
    _s: Any
    _lora: Any
    _groups: dict[str, Any]

    def _call(self, fn, timeout: float | None = None) -> Any:  # provided by Engine
        raise NotImplementedError

    def _commit(
        self, staged: list[tuple[torch.Tensor, torch.Tensor]], version: int | None, gate: CommitGate | None = None
    ) -> None:
        """Run by the loop thread between two forward passes: unless ``gate`` says the caller gave up
        (``Abandoned``: nothing is written), copy the staged tensors in, bump the scheduler's
        epoch and set ``version`` (when given). Then, by ``EngineConfig.kv_after_update``: ``recompute``: retracted
        requests drop the blocks they kept now and running rows theirs at the next ``Scheduler.step``; all are
        prefilled again (``stats["reprefill_requests"]``, ``stats["reprefill_tokens"]``, counted by
        ``Scheduler.admit``). ``keep``: running and retracted requests keep their KV and decode on under the new
        weights (``stats["kv_kept_requests"]``, ``stats["kv_kept_tokens"]``); each request's ``epoch`` stays the one
        its prompt was prefilled under, so no new request joins those blocks (``Scheduler.join_live``)."""
        s = self._s
        _claim(gate)
        try:
            commit_weights(staged)
        except EngineError:
            s.epoch += 1  # some tensors may have changed: no KV computed before may be reused
            raise
        s.epoch += 1
        if version is not None:
            s.version = int(version)
        held = [r for r in s.waiting if r.blocks]  # retracted requests that kept their blocks
        if s.keep_kv:
            s.stats["kv_kept_requests"] += len(s.running) + len(held)
            s.stats["kv_kept_tokens"] += sum(r.kv_tokens for r in s.running + held)
        else:  # their KV predates the new weights
            s.stale.update(held)
            for r in held:
                s.drop_kv(r)
        s.stats["weight_loads"] += 1

    def update_weights_from_state_dict(
        self, state_dict: dict[str, torch.Tensor], version: int | None = None, *, gate: CommitGate | None = None
    ) -> None:
        """Copy HF-named tensors into the model (cast to the engine dtype) and set ``version``; atomic: every
        name, shape, dtype and value is checked first (``weights.stage_weights``), a failed load changes nothing.
        Refused while a LoRA adapter is loaded (``load_lora_adapter``). ``gate``: see ``weights.CommitGate``."""
        with self._lora.full_load():
            staged = stage_weights(self.model, state_dict.items())
            self._call(lambda: self._commit(staged, version, gate))

    def update_weights_from_disk(
        self,
        path: str | os.PathLike,
        version: int | None = None,
        *,
        allow_partial: bool = False,
        gate: CommitGate | None = None,
    ) -> None:
        """Load every ``*.safetensors`` file of an HF model directory (or one file) and set ``version``.

        The files are read and checked on the calling thread (generation continues meanwhile); the loop thread
        only copies the staged tensors in. The checkpoint's keys go through transformers' own conversions, as in
        ``from_pretrained`` (``weights.read_hf_checkpoint``): a hub MoE checkpoint's per-expert tensors load into
        transformers 5's fused ``mlp.experts.gate_up_proj`` / ``down_proj``. The names ``from_pretrained`` ignores
        are skipped (``hf_ignored_keys``: an older conversion's per-layer ``rotary_emb.inv_freq``, DeepSeek-V3's MTP
        layer). A failed load (bad path, unknown name, wrong shape, two keys for one parameter, a NaN, inf or huge
        value) changes nothing. A checkpoint that lacks parameters of the model is refused unless
        ``allow_partial`` (a new version over partly old weights would be mislabelled). Refused while a LoRA adapter
        is loaded. ``gate``: see ``weights.CommitGate``.
        """
        with self._lora.full_load():
            known = named_tensors(self.model)  # one walk of the model for the whole load
            staged = stage_weights(
                self.model, read_hf_checkpoint(self.model, path, skip=hf_ignored_keys(self.model), known=known), known
            )
            if not allow_partial:
                check_complete(self.model, staged, f"the checkpoint at {os.fspath(path)!r}")
            self._call(lambda: self._commit(staged, version, gate))
        self.model_path = str(path)  # as SGLang's tokenizer manager records a successful load (a failed one raised)

    def update_weights_from_tensors(
        self, named: Sequence[tuple[str, torch.Tensor]], version: int | None = None, *, gate: CommitGate | None = None
    ) -> None:
        """Copy tensors that another process shares with this one (CUDA IPC or shared memory, see
        :mod:`rlcore.inference.tensor_ipc`) into the model and set ``version``; atomic like a disk load.

        Returns only when the copies are complete (a device synchronisation on CUDA), so the sender may reuse its
        buffers as soon as the call returns."""
        with self._lora.full_load():
            staged = stage_weights(self.model, named)
            self._call(lambda: self._commit(staged, version, gate))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        staged.clear()  # drop the references to the sender's memory

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int | str,
        rank_offset: int,
        world_size: int,
        backend: str = "gloo",
        group_name: str = "update_weight_group",
        timeout_s: float = 300.0,
    ) -> None:
        """Join the trainer's broadcast group as rank ``rank_offset`` (blocks until every rank joined, at most
        ``timeout_s``). Runs in the calling thread (not the loop) so generation continues during the rendezvous.
        """
        if group_name in self._groups:
            raise EngineError(
                f"group_name {group_name!r} already exists; destroy it first or pick another name"
            )
        init = f"tcp://{master_address}:{int(master_port)}"
        self._groups[group_name] = init_custom_process_group(
            backend, init, int(world_size), int(rank_offset), group_name, timeout_s
        )

    def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str = "update_weight_group",
        version: int | None = None,
        *,
        gate: CommitGate | None = None,
    ) -> None:
        """Receive ``names`` by ``broadcast(src=0)`` in order into staging buffers, then load them all and set
        ``version``. Names, dtypes and shapes are checked before anything is received (so a bad request fails
        fast instead of deadlocking the broadcast); a failed receive changes nothing."""
        if group_name not in self._groups:
            raise EngineError(f"group_name {group_name!r} is unknown; call init_weights_update_group first")
        if not (len(names) == len(dtypes) == len(shapes)):
            raise EngineError("names, dtypes and shapes must have the same length")
        specs = [(n, parse_dtype(d), tuple(int(x) for x in shp)) for n, d, shp in zip(names, dtypes, shapes)]
        check_specs(self.model, specs)
        self._lora.refuse_full_load()
        pg = self._groups[group_name]
        import torch.distributed as dist

        dev = self.device if dist.get_backend(pg) != "gloo" else torch.device("cpu")
        received = []
        for n, dt, shp in specs:
            buf = torch.empty(shp, dtype=dt, device=dev)
            dist.broadcast(buf, src=0, group=pg)
            received.append((n, buf))
        with self._lora.full_load():
            staged = stage_weights(self.model, received)
            self._call(lambda: self._commit(staged, version, gate))

    # -- LoRA adapters (rlcore.inference.lora: merged into the live weights from a kept base copy) -----------------

    @property
    def lora_adapters(self) -> dict[str, str]:
        """Loaded adapters ``{lora_name: lora_path}`` (SGLang's ``loaded_adapters``), oldest first."""
        return self._lora.paths()

    @property
    def lora_applied(self) -> str | None:
        """The adapter merged into the weights: the most recently loaded one (None: the base weights)."""
        return self._lora.applied

    def load_lora_adapter(
        self,
        name: str,
        adapter: str | os.PathLike | LoraAdapter,
        version: int | None = None,
        *,
        gate: CommitGate | None = None,
    ) -> dict[str, str]:
        """Load an adapter (a PEFT directory or an in-memory ``LoraAdapter``) and apply it; returns the loaded set.

        The adapter is read, checked against the model and merged (``W_base + s · B @ A``) on the calling thread
        while generation continues; the loop thread then copies the new weights in between two forward passes and
        sets ``version`` (when given), like a full weight load: requests whose KV predates it are re-prefilled, so
        no token mixes two adapters (with ``EngineConfig.kv_after_update="keep"`` they continue on their KV). It
        becomes the applied adapter (the previous one stays loaded, superseded).
        A failed load (bad path, unknown module, wrong shape, name already loaded) changes nothing.
        """
        return self._lora.load(name, adapter, lambda staged, done: self._call(
            lambda: self._commit_lora(staged, done, version, gate)))

    def _commit_lora(self, staged: list, done: Any, version: int | None, gate: CommitGate | None) -> None:
        _claim(gate)
        if staged:
            self._commit(staged, version)
        done()

    def unload_lora_adapter(
        self, name: str, version: int | None = None, *, gate: CommitGate | None = None
    ) -> dict[str, str]:
        """Unload an adapter; returns the loaded set. Unloading the applied one applies the newest remaining adapter,
        or copies the base weights back (exactly) when none is left; committed between two forward passes, with
        ``version`` set when given. Unloading a superseded adapter changes no weight (nor the version). Unknown names
        raise."""
        return self._lora.unload(name, lambda staged, done: self._call(
            lambda: self._commit_lora(staged, done, version, gate)))


def _claim(gate: CommitGate | None) -> None:
    if gate is not None and not gate.claim():
        raise Abandoned("the caller stopped waiting (timeout_s) before the commit; nothing was loaded")
