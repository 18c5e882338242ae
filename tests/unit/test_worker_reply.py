"""The TP workers' replies to sluice's collective_rpc calls: each worker-extension method
answers a value or the error it caught (never raises an Exception, so vLLM's reply queues
stay in step), and the engine folds the answers once all arrived: every value, one
exception naming every failing rank (WeightGroupError kept for a lost group), and a
checksum refused unless every worker gave a string. Fake workers and a fake vLLM client
stand in for vLLM here; tests/integration/test_engine_tp.py runs the real TP=2 engine."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from rollout.engine import EngineSpec, VLLMEngine
from rollout.weight_group import WeightGroupError
from rollout.weight_protocol import checksum_tensors, encode_state
from rollout.weight_reload import WeightReloadExtension
from rollout.worker_reply import WorkerError, WorkerReply, fold_checksums, fold_replies


def test_all_ok_gives_every_value_in_rank_order():
    assert fold_replies("m", [(0, 3, None, None), [1, 4, None, None]]) == [3, 4]
    assert fold_replies("m", [WorkerReply(0).to_wire(), WorkerReply(1).to_wire()]) == [None, None]


def test_one_failed_worker_is_named_with_its_error():
    replies = [WorkerReply(0, 1).to_wire(), WorkerReply.failed(1, KeyError("no such tensor")).to_wire()]
    with pytest.raises(WorkerError, match=r"sluice_load_weights failed on TP worker 1 of 2: "
                                          r"worker 1: KeyError: 'no such tensor'"):
        fold_replies("sluice_load_weights", replies)


def test_a_lost_weight_group_stays_a_weight_group_error_and_names_every_failed_rank():
    replies = [WorkerReply.failed(0, WeightGroupError("no weight group")).to_wire(),
               WorkerReply.failed(1, TimeoutError("past sync.timeout_s")).to_wire()]
    with pytest.raises(WeightGroupError, match="TP worker 0, 1 of 2: worker 0: WeightGroupError: "
                                               "no weight group; worker 1: TimeoutError") as info:
        fold_replies("sluice_receive_weights", replies)
    # A worker's TimeoutError is not the engine's: the router reads TimeoutError as "engine gone".
    assert not isinstance(info.value, TimeoutError)


def test_an_answer_that_is_not_a_reply_is_refused():
    with pytest.raises(WorkerError, match="not a sluice worker reply"):
        fold_replies("sluice_checksum", [(0, "abc", None, None), None])


def test_checksums_agree_disagree_or_are_refused():
    assert fold_checksums(["ab" * 32, "ab" * 32]) == "ab" * 32
    assert fold_checksums(["a" * 64, "b" * 64]) == f"TP workers disagree: {'a' * 12}, {'b' * 12}"
    with pytest.raises(WorkerError, match=r"worker 1 answered None \(NoneType\), not a digest"):
        fold_checksums(["a" * 64, None])
    with pytest.raises(WorkerError, match="no worker answered"):
        fold_checksums([])


class FakeRunner:
    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def get_model(self) -> torch.nn.Module:
        return self.model

    def reload_weights(self, **source: Any) -> None:
        raise AssertionError("the extension must reload through the worker's entry point")


class FakeWorker(WeightReloadExtension):
    """What the extension needs of vLLM's Worker: rank, device, model_runner, reload_weights."""

    def __init__(self, rank: int, model: torch.nn.Module) -> None:
        self.rank, self.device = rank, "cpu"
        self.model_runner = FakeRunner(model)
        self.reloads: list[dict[str, Any]] = []

    def reload_weights(self, **source: Any) -> None:
        state = dict(source["weights_iterator"])
        self.reloads.append(state)
        self.model_runner.model.load_state_dict(state)


def norm_model(value: float) -> torch.nn.Module:
    model = torch.nn.LayerNorm(4)
    torch.nn.init.constant_(model.weight, value)
    return model


def test_worker_methods_answer_errors_as_values_and_reload_through_the_worker():
    worker = FakeWorker(1, norm_model(1.0))
    state = {"weight": torch.full((4,), 2.0), "bias": torch.zeros(4)}
    assert worker.sluice_load_weights(blob=encode_state(state)) == (1, None, None, None)
    assert len(worker.reloads) == 1 and torch.equal(worker.model_runner.model.weight, state["weight"])
    assert worker.sluice_checksum(["weight"]) == (1, checksum_tensors(state, ["weight"]), None, None)
    assert worker.sluice_receive_weights([]) == (1, None, "WeightGroupError",
                                                 "no weight group: sluice_receive_weights before "
                                                 "sluice_init_weight_group, or the last push aborted it")
    rank, _, error_type, error = worker.sluice_checksum(["missing"])
    assert (rank, error_type) == (1, "KeyError") and "missing" in error
    assert worker.sluice_load_weights()[2] == "ValueError"


def test_keyboard_interrupt_still_ends_the_worker():
    worker = FakeWorker(0, norm_model(1.0))

    def interrupted(**source: Any) -> None:
        raise KeyboardInterrupt

    worker.reload_weights = interrupted  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        worker.sluice_load_weights(blob=encode_state({"weight": torch.ones(4)}))


class FakeLLM:
    """vLLM's AsyncLLM as far as the engine's worker calls go: collective_rpc runs the method
    on every worker and returns the answers in rank order (what vLLM does once no worker
    raises), or answers `canned` instead."""

    def __init__(self, workers: list[FakeWorker], canned: list[Any] | None = None) -> None:
        self.workers, self.canned = workers, canned

    async def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        if self.canned is not None:
            return self.canned
        return [getattr(w, method)(*args) for w in self.workers]

    async def reset_prefix_cache(self, reset_running_requests: bool = False,
                                 reset_connector: bool = False) -> bool:
        return True  # nothing holds KV blocks here


def engine_over(llm: FakeLLM) -> VLLMEngine:
    engine = VLLMEngine(EngineSpec(model_path="unused", tp_size=len(llm.workers)))
    engine._llm, engine._paused = llm, True  # paused: no pause/resume round trip
    return engine


def test_the_engine_raises_once_naming_the_failed_rank_and_keeps_its_version():
    workers = [FakeWorker(0, norm_model(1.0)), FakeWorker(1, norm_model(1.0))]
    engine = engine_over(FakeLLM(workers))
    good = {"weight": torch.full((4,), 3.0), "bias": torch.zeros(4)}

    def fails(**source: Any) -> None:
        raise RuntimeError("size mismatch for weight")

    workers[0].reload_weights = fails  # type: ignore[method-assign]
    with pytest.raises(WorkerError, match="sluice_load_weights failed on TP worker 0 of 2: "
                                          "worker 0: RuntimeError: size mismatch"):
        asyncio.run(engine.update_weights(1, blob=encode_state(good)))
    assert engine.version == 0 and len(workers[1].reloads) == 1
    del workers[0].reload_weights
    asyncio.run(engine.update_weights(1, blob=encode_state(good)))
    assert engine.version == 1
    assert asyncio.run(engine.checksum(["weight"])) == checksum_tensors(good, ["weight"])


def test_the_engine_refuses_a_checksum_that_is_not_a_string_from_every_worker():
    digest = "ab" * 32
    engine = engine_over(FakeLLM([], canned=[(0, digest, None, None), (1, None, None, None)]))
    with pytest.raises(WorkerError, match="worker 1 answered None"):
        asyncio.run(engine.checksum(["weight"]))
