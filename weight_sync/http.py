"""HttpEngine: the weight-update calls of an Engine, made on a running server over HTTP.

`sync_weights(model, "http://host:port")` and `DeltaSync("http://host:port")` wrap the URL in this
handle. It speaks SGLang's `/update_weights_from_tensor` body (`serialized_named_tensors`, one entry;
`load_format`, `flush_cache`, `weight_version`) in the server's pickle-free codec: plain pairs and
flattened buckets are encoded by weight_sync/wire.py (which the server's tensor_codec re-exports);
a delta (`load_format="delta"`) is the base64 of weight_sync.delta_codec's blob, which the server
decodes with the same module. httpx is imported lazily. Not here: generation, streaming, retries.
"""

from __future__ import annotations

import base64


class HttpEngine:
    """`update_weights_from_tensor`, the LoRA adapter calls, `get_server_info`, `get_weights_checksum`,
    `get_weights_by_name` on a server."""

    def __init__(self, url: str, api_key: str | None = None, timeout_s: float = 600.0) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"HttpEngine: url must start with http:// or https://, got {url!r}")
        self.url, self.api_key, self.timeout_s = url.rstrip("/"), api_key, timeout_s
        self._client = None

    def _http(self):
        if self._client is None:
            import httpx

            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            self._client = httpx.Client(base_url=self.url, timeout=self.timeout_s, headers=headers)
        return self._client

    def _call(self, path: str, body: dict | None = None) -> dict:
        r = self._http().post(path, json=body or {})
        try:
            out = r.json()
        except ValueError:
            raise RuntimeError(f"{self.url}{path}: HTTP {r.status_code}, not JSON: {r.text[:200]!r}") from None
        if r.status_code >= 500:
            raise RuntimeError(f"{self.url}{path}: HTTP {r.status_code}: {out}")
        return out

    def update_weights_from_tensor(self, named_tensors, load_format: str | None = None, flush_cache: bool = True,
                                   weight_version: str | None = None, online: bool = False,
                                   abort_all_requests: bool = False) -> tuple[bool, str]:
        """Engine.update_weights_from_tensor over HTTP; `online` is the route's `force` (requests in flight are
        retracted and go on under the new weights instead of the update being refused)."""
        if load_format == "delta":
            from weight_sync.delta_codec import DeltaUpdate

            payload = base64.b64encode(DeltaUpdate.from_blob(named_tensors).to_bytes()).decode("ascii")
        elif load_format == "flattened_bucket":
            from weight_sync.bucket import as_one_bucket
            from weight_sync.wire import encode_bucket

            payload = encode_bucket(as_one_bucket(named_tensors, load_format))
        elif load_format in (None, "auto"):
            from weight_sync.wire import encode_named_tensors

            payload = encode_named_tensors(named_tensors)
        else:
            return False, f"update_weights_from_tensor failed: load_format={load_format!r} is not supported over HTTP"
        body = {"serialized_named_tensors": [payload], "load_format": load_format, "flush_cache": flush_cache,
                "weight_version": weight_version, "force": online, "abort_all_requests": abort_all_requests}
        out = self._call("/update_weights_from_tensor", body)
        if "success" not in out:
            return False, f"update_weights_from_tensor failed: {_error_message(out)}"
        return bool(out["success"]), str(out.get("message", ""))

    def load_lora_adapter_from_tensors(self, lora_name: str, tensors, config_dict: dict,
                                       load_format: str | None = None, pinned: bool = False) -> dict:
        """/load_lora_adapter_from_tensors: the adapter's PEFT-named tensors (a dict or pairs, or with
        load_format="flattened_bucket" a bucket or its dict) in the wire codec. -> SGLang's answer dict."""
        from weight_sync.bucket import as_one_bucket
        from weight_sync.wire import encode_bucket, encode_named_tensors

        if load_format == "flattened_bucket":
            payload = encode_bucket(as_one_bucket(tensors, load_format, last_wins=False))
        elif load_format is None:
            payload = encode_named_tensors(tensors)
        else:
            return {"success": False, "error_message": f"load_format={load_format!r} is not supported over HTTP"}
        out = self._call("/load_lora_adapter_from_tensors", {
            "lora_name": lora_name, "config_dict": config_dict, "serialized_tensors": payload,
            "load_format": load_format, "pinned": pinned})
        if "success" not in out:
            return {"success": False, "error_message": _error_message(out)}
        return out

    def unload_lora_adapter(self, lora_name: str) -> dict:
        return self._call("/unload_lora_adapter", {"lora_name": lora_name})

    def get_server_info(self) -> dict:
        return self._http().get("/get_server_info").json()

    def get_weights_checksum(self) -> dict:
        return self._call("/get_weights_checksum")

    def get_weights_by_name(self, name: str, truncate_size: int = 100):
        return self._call("/get_weights_by_name", {"name": name, "truncate_size": truncate_size})

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


def _error_message(out: dict) -> str:
    """The message of the server's error shape (a 400 for a bad body), or the whole answer."""
    err = out.get("error")
    return err.get("message") if isinstance(err, dict) else str(out)
