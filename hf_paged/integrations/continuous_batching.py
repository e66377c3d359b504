"""transformers' continuous-batching API served by the PagedEngine.

``model.init_continuous_batching`` returns a ``PagedContinuousBatchingManager``, a subclass of
transformers' ``ContinuousBatchingManager`` that keeps its request plumbing for the installed
version: ``add_request`` / ``add_requests`` put transformers' ``RequestState`` on its input
queue, ``cancel_request`` an id on its cancel queue; results travel through its
``OutputRouter`` (``get_result``, ``__iter__``, ``request_id_iter``,
``register_result_handler``) as its ``GenerationOutput``; ``start`` / ``stop`` / ``join`` /
``destroy`` / ``pause`` and the ``BackgroundThreadStatus`` (``fatal_error``, which
``transformers serve`` reads) are its own. ``generate_batch`` and
``continuous_batching_context_manager`` are transformers' own too: they call
``init_continuous_batching``. What is replaced is what runs the model: transformers' batch
processor (its own paged cache, and a forward with paged-attention arguments that hf_paged's
model refuses) gives way to ``EngineLoop``, which turns each state into engine requests, steps
the engine on the background thread (the only thread that touches it) and copies tokens,
status, log-probabilities and timestamps back into the states.
"""

from __future__ import annotations

import logging
import queue
import threading
import weakref

import torch
from transformers.generation.configuration_utils import (
    ContinuousBatchingConfig,
    GenerationConfig,
)
from transformers.generation.continuous_batching.continuous_api import (
    BackgroundThreadStatus,
    ContinuousBatchingManager,
    OutputRouter,
)
from transformers.generation.continuous_batching.requests import (
    RequestState,
)

from hf_paged.generation.paged_engine import PagedEngine
from hf_paged.integrations.continuous_batching_engine import EngineLoop
from hf_paged.integrations.continuous_batching_requests import RequestSettings

logger = logging.getLogger(__name__)

# One running manager per engine: the engine is stepped by one thread only.
_RUNNING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def init_continuous_batching(
    model, generation_config: GenerationConfig | None = None,
    continuous_batching_config: ContinuousBatchingConfig | None = None, workload_hints=None,
) -> ContinuousBatchingManager:
    """transformers' ``ContinuousMixin.init_continuous_batching`` with hf_paged's manager: a
    manager kept by ``stop(keep_for_next_session=True)`` is returned as is; the generation
    config defaults to the model's (an EOS of None becomes -1, as transformers sets it); the
    continuous-batching config to the one the generation config carries, else the defaults."""
    cached = getattr(model, "_cached_continuous_batching_manager", None)
    if isinstance(cached, ContinuousBatchingManager):
        return cached
    gen_config = generation_config if generation_config is not None else model.generation_config
    if gen_config is None:
        raise ValueError("A GenerationConfig must be provided or set in the model.")
    if gen_config.eos_token_id is None:
        logger.warning("`eos_token_id` not set in GenerationConfig. Setting to -1 (disabled).")
        gen_config.eos_token_id = -1
    if continuous_batching_config is None:
        carried = getattr(gen_config, "continuous_batching_config", None)
        continuous_batching_config = (carried if isinstance(carried, ContinuousBatchingConfig)
                                      else ContinuousBatchingConfig())
    return PagedContinuousBatchingManager(model, gen_config, continuous_batching_config,
                                          workload_hints)


class _OneProcess:
    """What transformers' manager reads of its tensor-parallel helper: the engine runs its
    own ranks, and this process (rank 0) alone takes requests."""

    global_rank = 0
    is_tp_driver = True

    def destroy_cpu_comm_group(self) -> None:
        pass


class PagedContinuousBatchingManager(ContinuousBatchingManager):
    """transformers' ``ContinuousBatchingManager`` whose requests the model's PagedEngine
    serves (its scheduler, prefix cache, CUDA graphs). The continuous-batching config's cache
    and scheduler sizes do not apply (the engine was sized when it loaded); it reads
    ``return_logprobs``, ``seed``, ``max_queue_size``, ``per_request_processors`` and
    ``drop_unsupported_processors``."""

    def __init__(self, model, generation_config: GenerationConfig,
                 continuous_batching_config: ContinuousBatchingConfig,
                 workload_hints=None) -> None:
        # transformers' __init__ is not called: it switches the model to transformers' paged
        # attention, sizes transformers' KV cache and builds a tensor-parallel helper; the
        # engine has all three. Set here is what the inherited methods read.
        engine: PagedEngine = model.engine
        if not engine.is_leader:
            raise RuntimeError("continuous batching runs on rank 0 of a tensor-parallel group "
                               "only: under torchrun the other ranks follow its steps")
        self.engine = engine
        self.model = model
        self.generation_config = generation_config
        self.continuous_batching_config = continuous_batching_config
        self.input_queue: queue.Queue[RequestState] = queue.Queue(
            maxsize=continuous_batching_config.max_queue_size)
        self.cancel_queue: queue.Queue[str] = queue.Queue()
        self._request_counter = 0
        self._request_lock = threading.Lock()
        # transformers 5.23 calls the loop's wake-up event _wake_up_loop, earlier 5.x
        # _has_new_requests: the inherited add_request sets whichever it knows.
        self._wake_up_loop = self._has_new_requests = threading.Event()
        self.background_thread_status = BackgroundThreadStatus()
        self.output_router = OutputRouter()
        self.batch_processor: EngineLoop | None = None
        self._generation_thread: threading.Thread | None = None
        self.warmed_up = True  # the engine compiled and captured its graphs when it loaded
        self._original_attn_impl = None  # the model's attention is never switched
        num_return_sequences = getattr(generation_config, "num_return_sequences", None)
        self.num_return_sequences = num_return_sequences if num_return_sequences is not None else 1
        self.distributed_helper = _OneProcess()
        self.is_tp_driver = True
        bm = engine.block_manager
        self.settings = RequestSettings(model, generation_config, continuous_batching_config,
                                        min(engine.max_model_len, bm.num_blocks * bm.block_size))
        self.logit_processor = self.settings.cb_processors
        # add_requests sorts prompts for prefix sharing when the cache shares prefixes.
        self._use_prefix_sharing = engine.config.enable_prefix_caching
        self.current_batch = 0

    def validate_request(self, input_ids: list[int], max_new_tokens: int | None = None,
                         eos_token_id: int | list[int] | None = None,
                         **logit_processor_kwargs) -> None:
        """Raise the error that ``add_request`` with these arguments would deliver as the
        request's failure (a prompt or length the engine cannot fit, a bad per-request
        value), queueing nothing: a server can refuse it before its response starts."""
        state = RequestState(
            request_id="validate_request", initial_tokens=list(input_ids),
            max_new_tokens=(self.generation_config.max_new_tokens if max_new_tokens is None
                            else max_new_tokens),
            eos_token_id=(self.generation_config.eos_token_id if eos_token_id is None
                          else eos_token_id),
            logit_processor_kwargs=logit_processor_kwargs)
        params, _ = self.settings.params(state)
        self.engine.validate_request(state.initial_tokens, params)

    # ---- what transformers' manager does with its own model runner ------------------------

    def switch_to_cb_friendly_attn(self, *args, **kwargs) -> None:
        """Nothing to switch: the engine's paged attention serves."""

    def warmup(self) -> None:
        """Nothing to warm: the engine compiled and captured its graphs when it loaded."""
        self.warmed_up = True

    def start(self) -> None:
        """Start the background thread that steps the engine (one running manager per
        engine)."""
        if not self.is_running():
            other = _RUNNING.get(self.engine)
            if other is not None and other is not self and other.is_running():
                raise RuntimeError("another continuous batching manager is running on this "
                                   "model's engine; stop it before starting this one")
            if self.engine.closed:
                raise RuntimeError("this model was closed; load it again to generate")
            _RUNNING[self.engine] = self
            self.batch_processor = self._create_batch_processor()
        super().start()

    def _create_batch_processor(self) -> EngineLoop:
        return EngineLoop(self.engine, self.settings, self.output_router)

    # ---- the background thread ------------------------------------------------------------

    def _run_generation_loop(self, **_ignored) -> None:
        # The engine chooses its own grad and inference modes: whatever the installed
        # transformers' start() passes its loop about them (5.24: use_inference_mode) is moot.
        status = self.background_thread_status
        loop = self.batch_processor or self._create_batch_processor()
        try:
            if self.engine.device.type == "cuda":
                torch.cuda.set_device(self.engine.device)
            seed = self.continuous_batching_config.seed
            if seed is not None:  # transformers seeds its sampling at the loop's start too
                torch.manual_seed(seed)
            with torch.no_grad():  # grad mode is per thread
                while self._loop_once(loop):
                    pass
            # Requests are left only after stop(hard_stop=True): they fail as in transformers.
            self._fail_all_remaining_requests(RuntimeError(
                "Generation loop finished before this request completed w/ "
                f"self.background_thread_status.tp_status = {status.tp_status}"), loop)
        except Exception as error:
            logger.error("Error in hf_paged's continuous batching loop: %s", error, exc_info=True)
            self._handle_critical_error(error, loop)
        finally:
            loop.close()
            status.mark_as_stopped()

    def _loop_once(self, loop: EngineLoop) -> bool:
        """One turn: take new requests and cancellations, then step the engine, or wait for
        work; False once a stop applies."""
        status = self.background_thread_status
        status.update_with_tp_status(status.local_status)  # one process: its own is final
        if status.tp_status >= BackgroundThreadStatus.HARD_STOP:
            return False
        is_pause_requested = getattr(status, "is_pause_requested", None)  # transformers >= 5.23
        if is_pause_requested is not None and is_pause_requested():
            loop.synchronize()
            status.pause_and_wait()
        loop.take(_drain(self.input_queue), _drain(self.cancel_queue))
        if loop.active:
            loop.step()
            self.current_batch += 1
            return True
        if status.tp_status == BackgroundThreadStatus.FLUSH_AND_STOP:
            return False
        self._wake_up_loop.wait(timeout=0.1)
        self._wake_up_loop.clear()
        return True

    def _handle_critical_error(self, error: Exception, batch_processor) -> None:
        """As transformers: stop at once, fail every request, record the fatal error (which
        ``transformers serve`` reads to answer 503)."""
        self.background_thread_status.request_stop(BackgroundThreadStatus.HARD_STOP, 0)
        self._fail_all_remaining_requests(error, batch_processor)
        self.background_thread_status.record_fatal_error(error)

    def _fail_all_remaining_requests(self, error: Exception, batch_processor) -> None:
        for state in _drain(self.input_queue):
            self.output_router.fail_and_deliver(state, error)
        if batch_processor is not None:
            batch_processor.fail_all(error)


def _drain(q: queue.Queue) -> list:
    items = []
    while True:
        try:
            items.append(q.get_nowait())
        except queue.Empty:
            return items
