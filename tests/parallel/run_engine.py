"""Runs the engines a JSON job list describes (argv[1]) and writes what they did as JSON to
argv[2] (one file per rank under torchrun: argv[2] + ".rank<N>"). The multi-process tests run
it as a subprocess with a timeout, so that a hang fails the test instead of stalling the run.

A job: {"checkpoint": path, "engine": {engine options}, "calls": [{"lengths": [...],
"seed": int, "generate": {generate kwargs}}]}, each call seeded with torch.manual_seed(0),
and optionally "failing_processor": true (then a call whose logits processor raises, and
the first call again), "kill_worker": true (then kill the engine's worker and call again),
"interrupt": true (then Ctrl-C a call mid-step, and close the engine), "model_object":
true (load transformers' way, hf_paged.AutoModelForCausalLM, and score ``SCORE`` with its
forward: the logits with labels' loss, the last position's logits, the inner model's hidden
states, every layer's too; a masked row's generation) or
"data_parallel": true (the README's data-parallel recipe with accelerate: the calls' prompts
split between the launched processes, new tokens gathered on rank 0), or "leave_open": true
(the engine is not closed: once the results are written this process kills itself with
SIGKILL, leaving its workers, whose pids the results list, to notice on their own).
With RUN_ENGINE_HANG_S set, a run still going after that many seconds prints every thread's
stack to stderr and exits. Once every engine is closed, the last result lists what they left
running in this process (``left_behind``: threads, a process group).
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import threading
import time

import torch

import hf_paged
from tests.conftest import left_padded

SCORE = dict(lengths=[5, 9, 14, 3, 11], seed=7)


def model_call(model) -> dict:
    """The model call on a left-padded batch, and generate on a row whose mask keeps nothing
    (its first token comes from a model call)."""
    ids, mask = left_padded(SCORE["lengths"], model.config.vocab_size, seed=SCORE["seed"])
    labels = ids.masked_fill(mask == 0, -100)
    out = model(ids, attention_mask=mask, labels=labels)
    mask[1] = 0
    tokens = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=4)
    inner = model.model(ids[:, :7], output_hidden_states=True)
    return dict(logits=out.logits.tolist(), loss=float(out.loss),
                last=model(ids[:, :7], logits_to_keep=1).logits.tolist(),
                hidden=inner.last_hidden_state.tolist(),
                layers=[h.tolist() for h in inner.hidden_states],
                masked_row=tokens.tolist())


def generate(engine, call: dict) -> list | dict:
    ids, mask = left_padded(call["lengths"], engine.hf_config.vocab_size, seed=call["seed"])
    torch.manual_seed(0)
    out = engine.generate(ids, attention_mask=mask, **call["generate"])
    if isinstance(out, torch.Tensor):
        return out.tolist()
    return dict(sequences=out.sequences.tolist(), scores=[s.tolist() for s in out.scores])


def failing_processor(engine, call: dict) -> dict:
    """A logits processor (run on rank 0 only) that raises: the caller gets its error, the
    ranks stay in step, and the same call then gives the same tokens as before."""

    def processor(input_ids, scores):
        raise ValueError("processor failed")

    try:
        generate(engine, dict(call, generate=dict(call["generate"], logits_processor=[processor])))
        error = None
    except ValueError as e:
        error = str(e)
    return dict(error=error, again=generate(engine, call))


def kill_worker(engine, call: dict) -> dict:
    """SIGKILL the worker, call again: the error, how soon it came, how long close() took."""
    worker = engine.executor.ranks.workers[0]
    os.kill(worker.pid, signal.SIGKILL)
    start, error = time.perf_counter(), None
    try:
        generate(engine, call)
    except RuntimeError as e:
        error = str(e)
    raised = time.perf_counter() - start
    start = time.perf_counter()
    engine.close()
    return dict(error=error, raise_seconds=raised, close_seconds=time.perf_counter() - start,
                worker_reaped=worker.poll() is not None)


def interrupt(engine, call: dict) -> dict:
    """Ctrl-C (SIGINT to this process) in the fifth step, after rank 0 has sent the step to
    its worker and before it runs it (the worst moment): whether the call was interrupted,
    and close()'s cleanup."""
    workers, run, calls = engine.executor.ranks.workers, engine.executor.runner.run, []
    # Ctrl-C raises KeyboardInterrupt even where this process was started with SIGINT ignored
    # (a background job of a non-interactive shell).
    signal.signal(signal.SIGINT, signal.default_int_handler)

    def run_then_interrupt(batch, inputs):
        calls.append(1)
        if len(calls) == 5:
            os.kill(os.getpid(), signal.SIGINT)
        return run(batch, inputs)

    engine.executor.runner.run = run_then_interrupt
    try:
        generate(engine, call)
        interrupted = False
    except KeyboardInterrupt:
        interrupted = True
    start = time.perf_counter()
    engine.close()
    return dict(interrupted=interrupted, close_seconds=time.perf_counter() - start,
                workers_reaped=all(w.poll() is not None for w in workers))


def data_parallel(engine, call: dict) -> list:
    from accelerate import PartialState
    from accelerate.utils import gather_object

    state = PartialState(cpu=engine.device.type == "cpu")
    ids, mask = left_padded(call["lengths"], engine.hf_config.vocab_size, seed=call["seed"])
    prompts = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
    params = hf_paged.SamplingParams(max_new_tokens=call["generate"]["max_new_tokens"])
    with state.split_between_processes(prompts) as mine:
        outputs = engine.generate_tokens(mine, params)
    return gather_object(outputs)


def left_behind() -> list[str]:
    """What the closed engines left running in this process: threads that would hold up its
    exit or that hf_paged named, and a default process group that hf_paged made (under
    torchrun the launcher's stays the script's)."""
    left = [t.name for t in threading.enumerate() if t is not threading.main_thread()
            and (not t.daemon or t.name.startswith("hf_paged"))]
    if "RANK" not in os.environ and torch.distributed.is_initialized():
        left.append("the default process group")
    return left


def main() -> None:
    if "RUN_ENGINE_HANG_S" in os.environ:
        faulthandler.dump_traceback_later(float(os.environ["RUN_ENGINE_HANG_S"]), exit=True)
    jobs, out = json.loads(sys.argv[1]), sys.argv[2]
    results, open_engines = [], []
    for job in jobs:
        result = {}
        if job.get("model_object"):
            model = hf_paged.AutoModelForCausalLM.from_pretrained(job["checkpoint"],
                                                                  **job["engine"])
            engine = model.engine
            result["model_call"] = model_call(model)
        else:
            engine = hf_paged.from_pretrained(job["checkpoint"], **job["engine"])
        if job.get("data_parallel"):
            result["outputs"] = [data_parallel(engine, call) for call in job["calls"]]
        else:
            result["outputs"] = [generate(engine, call) for call in job["calls"]]
        result["stats"] = engine.stats()
        if job.get("failing_processor"):
            result["failing_processor"] = failing_processor(engine, job["calls"][0])
        if job.get("kill_worker"):
            result["killed"] = kill_worker(engine, job["calls"][0])
        if job.get("interrupt"):
            result["interrupted"] = interrupt(engine, job["calls"][0])
        if job.get("leave_open"):
            result["worker_pids"] = [w.pid for w in engine.executor.ranks.workers]
            open_engines.append(engine)
        else:
            engine.close()
        results.append(result)
    if "RANK" in os.environ:
        out += f".rank{os.environ['RANK']}"
    if not open_engines and results:
        results[-1]["left_behind"] = left_behind()
    with open(out, "w") as f:
        json.dump(results, f)
    if open_engines:
        os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main()
