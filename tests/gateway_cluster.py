"""A whole serving stack in one process, on the seeded tiny Llama, for HTTP-level tests:

    HTTP (GatewayServer, loopback) -> gateway app -> Dispatcher -> WorkerHost prefill + decode
                                                                  (Mooncake TCP on loopback)

The tiny Llama has a 256-token vocabulary and no tokenizer, so `byte_tokenizer()` gives it one: a
byte-level `transformers` tokenizer whose 256 ids are the 256 bytes, with a plain chat template.
Text goes in as its UTF-8 bytes, and random output bytes come back through the same decode path as
any model's (replacement characters included).

    with GatewayStack() as stack:         # workers, dispatcher, server on a free port
        httpx.post(stack.url + "/v1/completions", json={...})
        stack.assert_at_rest()
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from unittest import mock

from cluster.serve.config import GatewayConfig
from cluster.worker_host.build import WorkerSpec
from cluster.worker_host.thread import HostLink, WorkerHost
from common.config import EngineConfig
from common.protocol import WorkerRole
from kernels.model import loader
from kernels.model.loader import LoadedModel
from kernels.model.tiny import make_tiny_llama, tiny_llama_config
from router.dispatcher import Dispatcher, DispatcherConfig
from router.gateway import GatewayServer, build_app
from router.workers import WorkerInfo
from tests.helpers import TINY_EOS, why_not_at_rest

TINY_MODEL = "tiny-bytes"
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")
ENGINE = EngineConfig(model=TINY_MODEL, page_size=4, num_pages=96, chunk_size=32, max_model_len=128,
                      max_running_requests=16, debug_kv=True)
REST_TIMEOUT_S = 10.0


def byte_tokenizer():
    """A `PreTrainedTokenizerFast` over the 256 byte-level symbols (ids 0..255), no special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {symbol: i for i, symbol in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=core, chat_template=CHAT_TEMPLATE)


def _tiny_loaded(tokenizer) -> LoadedModel:
    """A fresh tiny Llama (each worker its own module, same seeded weights) with `tokenizer`."""
    ours, _ = make_tiny_llama(seed=0)
    return LoadedModel(ours, ours.arch, tiny_llama_config(), tokenizer, Path("."), (TINY_EOS,))


class _Workers:
    """The dispatcher's `ViewSource`: the hosts, always alive, one incarnation each."""

    def __init__(self, hosts: dict[str, WorkerHost]):
        self.hosts = hosts
        self.links = {wid: HostLink(host) for wid, host in hosts.items()}

    async def workers(self) -> list[WorkerInfo]:
        return [WorkerInfo(wid, WorkerRole(h.spec.role), 1, True, h.session, h.conn.stats, 0, self.links[wid])
                for wid, h in self.hosts.items()]


class GatewayStack:
    """Workers, dispatcher and gateway server; the dispatcher and server share one event loop thread."""

    def __init__(self, **gateway_fields):
        self.tokenizer = byte_tokenizer()
        real_load = loader.load_for_serving  # what `build_worker` loads with

        def load(spec, *args, **kwargs):
            return _tiny_loaded(self.tokenizer) if spec == TINY_MODEL else real_load(spec, *args, **kwargs)

        with mock.patch.object(loader, "load_for_serving", load):
            self.hosts = {"prefill-0": WorkerHost(WorkerSpec("prefill", ENGINE), "prefill-0"),
                          "decode-0": WorkerHost(WorkerSpec("decode", ENGINE, host_pages=64), "decode-0")}
        self.max_model_len = min(h.max_request_tokens for h in self.hosts.values())
        self.config = GatewayConfig(port=0, **gateway_fields)
        self.dispatcher = Dispatcher.build(_Workers(self.hosts), DispatcherConfig(
            model_name=TINY_MODEL, max_model_len=self.max_model_len, refresh_interval_s=0.05, collect_timeout_s=0.05,
            relay_host="127.0.0.1"), tokenizer=self.tokenizer)  # as `tandem serve`
        self.app = build_app(self.dispatcher, self.config, on_shutdown=self.dispatcher.close)
        self.server = GatewayServer(self.app, self.config, graceful_timeout_s=10)
        self.port = self.server.bind()
        self.url = f"http://127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="gateway-stack", daemon=True)
        self._thread.start()
        started = threading.Event()
        asyncio.run_coroutine_threadsafe(self.dispatcher.start(), self._loop).result(30)
        self._serving = asyncio.run_coroutine_threadsafe(self.server.serve(lambda _: started.set()), self._loop)
        assert started.wait(30), "the gateway did not start"

    def __enter__(self) -> GatewayStack:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def workers_busy(self) -> dict[str, str]:
        """What each worker still holds, for workers that hold anything (empty: all at rest)."""
        return {wid: why for wid, host in self.hosts.items() if (why := why_not_at_rest(host.worker))}

    def assert_at_rest(self, timeout_s: float = REST_TIMEOUT_S) -> None:
        """Every worker alive, idle, holding no PRIVATE/IN_FLIGHT page, its pools and tree intact; the
        last stats each sent agree (no running or waiting request)."""
        deadline = time.monotonic() + timeout_s
        while busy := self.workers_busy():
            assert time.monotonic() < deadline, f"workers not at rest after {timeout_s}s: {busy}"
            time.sleep(0.05)
        for wid, host in self.hosts.items():
            assert not host.crashed, f"{wid} crashed:\n{host.crashed}"
            assert host._thread.is_alive(), f"{wid}: its loop is not running"
            host.worker.check_integrity()
            cache = host.worker.engine.kvm.prefix_cache
            assert cache.evictable_pages() == cache.cached_pages(), f"{wid}: a tree node is still locked"
        while any(h.conn.stats is None or h.conn.stats.num_running or h.conn.stats.num_waiting
                  for h in self.hosts.values()):
            assert time.monotonic() < deadline, {w: h.conn.stats for w, h in self.hosts.items()}
            time.sleep(0.05)
        assert not self.dispatcher.flights, f"the dispatcher still tracks {list(self.dispatcher.flights)}"

    def close(self) -> None:
        self.server.stop()
        self._serving.result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        for wid, host in self.hosts.items():
            assert host.shutdown(), f"{wid}: loop did not stop"
