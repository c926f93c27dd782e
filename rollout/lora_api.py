"""The Engine's LoRA surface, SGLang's names: load_lora_adapter, load_lora_adapter_from_tensors,
unload_lora_adapter, and the adapter a request names (generate(lora_path=...)).

Mixed into Engine. Adapters themselves are the runner's (runner/lora/); this file handles the requests
around them. Every call takes the engine lock, so it runs between scheduler steps. A load is checked
whole before anything is written (a refused adapter changes nothing); a request is bound to its
adapter's load uid when it is submitted, and one naming an adapter that is not loaded (or is being
unloaded) is refused by name.

Unloading an adapter that requests in flight use waits for them to finish, as SGLang does (new
requests naming it are refused meanwhile); with generation paused they could never finish, so the
unload is refused instead, naming how many requests hold it. The adapter's prefix-cache entries are
freed with it. Return values are SGLang's LoRAUpdateOutput: success, error_message, loaded_adapters
(name -> path, "__tensor__" for tensor loads).

With every slot taken (`max_loaded_loras`), a load is refused, as SGLang refuses it ("Maximum number of loaded
LoRA adapters is N. Please unload some LoRA adapters before loading new ones."): nothing is evicted behind the
caller's back, so a request naming an adapter it loaded never finds it gone.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from dataclasses import asdict, dataclass

logger = logging.getLogger(__name__)


@dataclass
class LoRAUpdateOutput:
    success: bool
    error_message: str | None = None
    loaded_adapters: dict[str, str] | None = None

    def to_dict(self) -> dict:
        return asdict(self)


class LoRAAPI:
    _lora_unloading: set  # uids being unloaded (set in Engine.__init__)
    _reqs_lock: threading.Lock  # guards _reqs and _lora_unloading against submit (Engine.__init__)

    def _loaded(self) -> dict[str, str]:
        return {name: a["path"] for name, a in self.runner.lora_adapters().items()}

    def _lora_result(self, what: str, fn) -> LoRAUpdateOutput:
        with self._cv:
            try:
                fn()
            except Exception as e:  # reported, never raised: SGLang's (success, error_message) contract
                logger.warning("%s failed: %s", what, e)
                return LoRAUpdateOutput(False, f"{what} failed: {e}", self._loaded())
            self._cv.notify_all()
            return LoRAUpdateOutput(True, None, self._loaded())

    def load_lora_adapter(self, lora_name: str, lora_path: str, pinned: bool = False) -> LoRAUpdateOutput:
        """Load the PEFT adapter in directory `lora_path` as `lora_name` (SGLang's signature)."""
        if not isinstance(lora_path, str | os.PathLike):  # str(None) would be a directory named "None"
            return LoRAUpdateOutput(False, f"load_lora_adapter({lora_name!r}) failed: lora_path must be a directory "
                                           f"path, got {type(lora_path).__name__}", self._loaded())
        # The runner checks everything (a free slot included) before it writes a byte (every rank, on TP).
        return self._lora_result(f"load_lora_adapter({lora_name!r})", lambda: (
            self.runner.load_lora_adapter(lora_name, str(lora_path), pinned=pinned)))

    def load_lora_adapter_from_tensors(self, lora_name: str, tensors, config_dict: dict, load_format: str | None = None,
                                       pinned: bool = False) -> LoRAUpdateOutput:
        """Load an adapter from PEFT-named tensors (a dict or pairs; load_format="flattened_bucket": weight_sync
        buckets) and its adapter_config dict."""
        return self._lora_result(f"load_lora_adapter_from_tensors({lora_name!r})", lambda: (
            self.runner.load_lora_adapter(lora_name, None, tensors, config_dict, load_format, pinned)))

    def unload_lora_adapter(self, lora_name: str, timeout_s: float | None = None) -> LoRAUpdateOutput:
        """Unload `lora_name`, after the requests in flight on it finish (refused while paused with such
        requests, or after `timeout_s` seconds of waiting; None waits as long as they run)."""
        what = f"unload_lora_adapter({lora_name!r})"
        # Checked before the adapter is marked as unloading: a bad timeout raising after it would leave the
        # adapter loaded but refused to every request, and an unhashable name would fail in the lookup.
        if not isinstance(lora_name, str):
            return LoRAUpdateOutput(False, f"{what} failed: lora_name must be a string, got {type(lora_name).__name__}",
                                    self._loaded())
        if timeout_s is not None and (not isinstance(timeout_s, int | float) or isinstance(timeout_s, bool)
                                      or not timeout_s >= 0):  # nan too
            return LoRAUpdateOutput(False, f"{what} failed: timeout_s must be None or a number of seconds >= 0, "
                                           f"got {timeout_s!r}", self._loaded())
        info = self.runner.lora_adapters().get(lora_name)
        if info is None:
            with self._cv:
                return self._lora_result(what, lambda: self.runner.unload_lora_adapter(lora_name))  # names it
        uid = info["uid"]
        with self._reqs_lock:  # submit binds adapters under this lock: no new request on uid after this
            self._lora_unloading.add(uid)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        try:
            while True:
                # Wait outside the step gate: the scheduler must keep stepping the requests we wait for.
                with self._reqs_lock:
                    users = sum(1 for r in self._reqs.values() if r.lora_id == uid)
                if not users:
                    break
                if self._paused or self._shutdown or (deadline is not None and time.monotonic() > deadline):
                    why = "generation is paused (continue_generation() or abort them first)" if self._paused \
                        else "the engine is shutting down" if self._shutdown else f"timeout_s={timeout_s} passed"
                    return LoRAUpdateOutput(False, f"{what} failed: {users} request(s) in flight use it and "
                                            f"{why}", self._loaded())
                time.sleep(0.02)
            with self._cv:  # a step boundary; nothing can bind uid any more, and its last users are gone
                self.scheduler.kv.drop_lora_cache(uid)
                return self._lora_result(what, lambda: self.runner.unload_lora_adapter(lora_name))
        finally:
            with self._reqs_lock:
                self._lora_unloading.discard(uid)

    async def async_load_lora_adapter(self, lora_name: str, lora_path: str, pinned: bool = False) -> LoRAUpdateOutput:
        """load_lora_adapter for an event loop (SGLang's): the blocking call runs in a worker thread."""
        return await asyncio.to_thread(self.load_lora_adapter, lora_name, lora_path, pinned)

    async def async_unload_lora_adapter(self, lora_name: str, timeout_s: float | None = None) -> LoRAUpdateOutput:
        """unload_lora_adapter for an event loop: it may wait for requests on the adapter, which the loop
        itself may be serving, so it never blocks the loop."""
        return await asyncio.to_thread(self.unload_lora_adapter, lora_name, timeout_s)

    # ---- requests ------------------------------------------------------------------------------
    def _lora_names(self, lora_path, num: int) -> list[str | None]:
        """generate's lora_path: None, one name for every prompt, or one name (or None) per prompt."""
        names = lora_path if isinstance(lora_path, list) else [lora_path] * num
        if len(names) != num:
            raise ValueError(f"lora_path has {len(names)} entries for {num} prompts")
        for n in names:
            if n is not None and not isinstance(n, str):
                raise ValueError(f"lora_path entries must be adapter names (str) or None, got {n!r}")
        if any(n is not None for n in names) and not self.runner.config.enable_lora:
            raise ValueError("lora_path given but LoRA is off: create the engine with enable_lora=True")
        return names

    def _bind_loras(self, reqs) -> None:
        """Under the engine lock, at submit: each request's adapter name -> the uid of the loaded adapter."""
        if not any(r.lora_name for r in reqs):
            return
        loaded = self.runner.lora_adapters()
        for r in reqs:
            if r.lora_name is None:
                continue
            info = loaded.get(r.lora_name)
            if info is None:
                raise ValueError(f"LoRA adapter {r.lora_name!r} is not loaded; loaded: {sorted(loaded)}")
            if info["uid"] in self._lora_unloading:
                raise ValueError(f"LoRA adapter {r.lora_name!r} is being unloaded; new requests cannot use it")
        for r in reqs:
            if r.lora_name is not None:
                r.lora_id = loaded[r.lora_name]["uid"]
