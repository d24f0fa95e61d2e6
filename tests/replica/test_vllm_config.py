"""Choosing the engine: settings (flags, environment, config file), the engine registry, and
the vLLM engine's configuration checks -- no engine is started here."""

from __future__ import annotations

import argparse
import asyncio
import json
import re

import pytest

from unicache.cli.local_cluster import ClusterSettings, served_model_name
from unicache.contract.request_class import SINGLE_TURN, RequestClass, Task
from unicache.replica.engines.api import ServingEngine
from unicache.replica.engines.builtin.async_engine import AsyncEngine
from unicache.replica.engines.registry import make_engine
from unicache.replica.engines.vllm.config import SCHEDULER_CLS, VLLMEngineConfig
from unicache.replica.engines.vllm.engine import VLLMEngine
from unicache.replica.engines.vllm.request_meta import class_from_extra_args, class_to_extra_args, salt_from_vllm, salt_to_vllm
from unicache.replica.settings import ReplicaSettings, add_settings_arguments, settings_from_args


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_settings_arguments(p)
    return p.parse_args(argv)


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    return str(tmp_path)


def test_engine_model_and_served_name_from_flags_env_and_file(monkeypatch, tmp_path, model_dir):
    for name in ("ENGINE", "CHECKPOINT", "SERVED_MODEL_NAME"):
        monkeypatch.delenv(f"UNICACHE_{name}", raising=False)
    s = settings_from_args(parse(["--engine", "vllm", "--model", model_dir, "--served-model-name", "tiny"]))
    assert (s.engine, s.checkpoint, s.served_model_name) == ("vllm", model_dir, "tiny")
    assert settings_from_args(parse(["--checkpoint", model_dir])).checkpoint == model_dir  # the old name stays
    assert settings_from_args(parse([])).engine == "torch"  # the default
    monkeypatch.setenv("UNICACHE_ENGINE", "vllm")
    monkeypatch.setenv("UNICACHE_CHECKPOINT", model_dir)
    assert settings_from_args(parse([])).engine == "vllm"
    monkeypatch.delenv("UNICACHE_CHECKPOINT")
    cfg = tmp_path / "replica.yaml"
    cfg.write_text(f"engine: torch\ncheckpoint: {model_dir}\nserved-model-name: m\n")
    monkeypatch.delenv("UNICACHE_ENGINE")
    s = settings_from_args(parse(["--config", str(cfg)]))
    assert (s.engine, s.checkpoint, s.served_model_name) == ("torch", model_dir, "m")


def test_the_registry_builds_the_named_engine(model_dir):
    torch_engine = make_engine(ReplicaSettings(model_preset="tiny", device="cpu"))
    assert type(torch_engine) is AsyncEngine and isinstance(torch_engine, ServingEngine)
    vllm_engine = make_engine(ReplicaSettings(engine="vllm", checkpoint=model_dir, block_size=32, num_blocks=8))
    assert type(vllm_engine) is VLLMEngine and isinstance(vllm_engine, ServingEngine)
    assert (vllm_engine.served_model_name, vllm_engine.block_size) == (model_dir.rstrip("/").rsplit("/", 1)[-1], 32)
    with pytest.raises(ValueError, match=r"unknown engine 'tgi' \(choose from torch, vllm\)"):
        make_engine(ReplicaSettings(engine="tgi"))
    with pytest.raises(ValueError, match="the vllm engine needs --model"):
        make_engine(ReplicaSettings(engine="vllm"))


def test_vllm_config_is_checked_before_vllm_starts(model_dir, tmp_path):
    with pytest.raises(ValueError, match="no config.json there"):
        VLLMEngineConfig(model=str(tmp_path / "missing"))
    from unicache.replica.eviction.registry import policy_names

    live = ", ".join(sorted(set(policy_names()) - {"opt"}) + ["vllm"])  # every registry policy but the offline one
    with pytest.raises(ValueError, match=re.escape(f"eviction policy 'opt' cannot run inside vLLM (choose from {live})")):
        VLLMEngineConfig(model=model_dir, eviction_policy="opt")
    cfg = VLLMEngineConfig(model=model_dir, block_size=16, num_blocks=10)
    with pytest.raises(ValueError, match="vLLM's CPU attention needs a multiple of 32"):
        cfg.engine_args("cpu", "ipc:///e", "ipc:///r", "ipc:///s")
    args = VLLMEngineConfig(model=model_dir, block_size=32, num_blocks=10, eviction_policy="lru", served_model_name="m").engine_args(
        "cpu", "ipc:///e", "ipc:///r", "ipc:///s"
    )
    # The pool: 10 usable blocks plus vLLM's null block; the context capped by the pool.
    assert (args["num_gpu_blocks_override"], args["max_model_len"], args["served_model_name"]) == (11, 320, ["m"])
    assert args["scheduler_cls"] == SCHEDULER_CLS
    assert args["additional_config"] == {"unicache": {"eviction_policy": "lru", "status_endpoint": "ipc:///s"}}
    ev = args["kv_events_config"]
    assert (ev.publisher, ev.endpoint, ev.replay_endpoint, ev.enable_kv_cache_events) == ("zmq", "ipc:///e", "ipc:///r", True)


def test_class_and_salt_travel_as_vllm_carries_them():
    cls = RequestClass(tenant="acme", session_id="s", turn=3, task=Task.AGENT, template=True, template_blocks=2)
    assert class_from_extra_args(class_to_extra_args(cls)) == cls
    assert class_from_extra_args(None) == class_from_extra_args({}) == SINGLE_TURN
    assert salt_to_vllm(b"\x01\xff") == "01ff" and salt_from_vllm("01ff") == b"\x01\xff"
    assert salt_to_vllm(None) is None and salt_from_vllm(None) is None


def test_unicache_up_serves_the_model_directory_name():
    assert served_model_name(ClusterSettings(checkpoint="/models/tiny-llama/")) == "tiny-llama"
    assert served_model_name(ClusterSettings(checkpoint="/models/x", served_model_name="prod")) == "prod"
    assert served_model_name(ClusterSettings()) == ""


def test_settings_check_refuses_a_bad_engine_before_anything_starts(model_dir):
    from unicache.plumbing.errors import UsageError

    with pytest.raises(UsageError, match=r"engine: unknown engine 'tgi' \(choose from torch, vllm\)"):
        ReplicaSettings(engine="tgi").check()
    with pytest.raises(UsageError, match="the vllm engine needs --model"):
        ReplicaSettings(engine="vllm").check()
    with pytest.raises(UsageError, match="eviction policy 'opt' cannot run inside vLLM"):
        ReplicaSettings(engine="vllm", checkpoint=model_dir, eviction_policy="opt").check()
    ReplicaSettings(engine="vllm", checkpoint=model_dir, eviction_policy="vllm", block_size=32).check()
    with pytest.raises(UsageError, match="eviction_policy"):
        ReplicaSettings(eviction_policy="vllm").check()  # vLLM's own order needs vLLM


@pytest.mark.parametrize(
    "settings, expected",
    [
        (dict(checkpoint="/models/tiny-llama/"), "tiny-llama"),
        (dict(checkpoint="/models/x", served_model_name="prod"), "prod"),
        (dict(), "unicache-default"),
    ],
)
def test_unicache_up_gives_the_router_the_served_model_name(settings, expected):
    from unicache.cli.local_cluster import LocalCluster

    cluster = LocalCluster(ClusterSettings(**settings))
    try:
        assert cluster.router_config().served_model_name == expected
    finally:
        cluster.stop_backends()


def test_vllm_logprobs_become_ours_top_k_by_rank_with_the_sampled_token_only_if_ranked():
    from types import SimpleNamespace as LP

    from unicache.replica.engines.api import TokenLogprob
    from unicache.replica.engines.vllm.outputs import token_logprobs

    per_token = [
        {7: LP(logprob=-0.1, rank=1), 3: LP(logprob=-2.5, rank=2)},  # sampled token ranked first
        {9: LP(logprob=-0.2, rank=1), 4: LP(logprob=-1.9, rank=2), 5: LP(logprob=-6.0, rank=40)},  # sampled 5, rank 40
    ]
    assert token_logprobs([7, 5], per_token, 2) == [
        TokenLogprob(-0.1, [(7, -0.1), (3, -2.5)]),
        TokenLogprob(-6.0, [(9, -0.2), (4, -1.9)]),
    ]
    assert token_logprobs([5], per_token[1:], 0) == [TokenLogprob(-6.0, [])]
    assert token_logprobs([7], None, None) is None  # not asked for
    with pytest.raises(ValueError, match="logprobs for none of 1 tokens"):
        token_logprobs([7], None, 2)
    with pytest.raises(ValueError, match="logprobs for 2 of 1 tokens"):
        token_logprobs([7], per_token, 2)


def test_phase_times_read_vllms_request_stats():
    from types import SimpleNamespace

    from unicache.replica.engines.vllm.engine import phase_times

    stats = SimpleNamespace(queued_ts=10.0, scheduled_ts=10.25, first_token_ts=10.75)
    assert phase_times(stats, first_token_s=0.9) == (0.25, 0.5)
    # no stats (vLLM's stats off) or the core has not scheduled it: our own clock, no queue
    assert phase_times(None, first_token_s=0.9) == (0.0, 0.9)
    assert phase_times(SimpleNamespace(queued_ts=10.0, scheduled_ts=0.0, first_token_ts=0.0), 0.9) == (0.0, 0.9)
    # scheduled but no first-token stamp yet: the rest of our own first-token time
    assert phase_times(SimpleNamespace(queued_ts=10.0, scheduled_ts=10.25, first_token_ts=0.0), 0.9) == (0.25, 0.65)


# --- vLLM on GPUs: the engine arguments built for CUDA (no GPU needed to build them) -------
EP = ("ipc:///e", "ipc:///r", "ipc:///s")


def test_cuda_args_leave_the_pool_graphs_and_context_to_vllm(model_dir):
    args = ReplicaSettings(engine="vllm", checkpoint=model_dir, block_size=32).vllm_engine_config().engine_args("cuda", *EP)
    for key in ("enforce_eager", "num_gpu_blocks_override", "max_model_len", "gpu_memory_utilization", "kv_cache_memory_bytes"):
        assert key not in args, key  # CUDA graphs on; vLLM's profiling sizes the pool; the model's context
    assert (args["tensor_parallel_size"], args["distributed_executor_backend"], args["block_size"]) == (1, "uni", 32)
    # the CPU path keeps today's explicit sizing: 1,024 blocks, eager, the pool caps the context
    cpu = ReplicaSettings(engine="vllm", checkpoint=model_dir, block_size=32).vllm_engine_config().engine_args("cpu", *EP)
    assert (cpu["num_gpu_blocks_override"], cpu["enforce_eager"], cpu["max_model_len"]) == (1025, True, 4096)
    assert (cpu["gpu_memory_utilization"], cpu["kv_cache_memory_bytes"]) == (0.05, 256 << 20)


def test_cuda_args_take_tp_memory_share_pinned_pool_and_the_passthrough(model_dir, monkeypatch, tmp_path):
    cfg = tmp_path / "replica.yaml"
    cfg.write_text(f"engine: vllm\ncheckpoint: {model_dir}\nblock-size: 32\ntensor-parallel-size: 4\n"
                   "gpu-memory-utilization: 0.85\nenforce-eager: true\nmax-model-len: 2048\n"
                   "vllm-args: {kv_cache_dtype: fp8, enable_chunked_prefill: true}\n")
    s = settings_from_args(parse(["--config", str(cfg)]))
    s.check()
    args = s.vllm_engine_config().engine_args("cuda", *EP)
    assert (args["tensor_parallel_size"], args["distributed_executor_backend"]) == (4, "mp")
    assert (args["gpu_memory_utilization"], args["enforce_eager"], args["max_model_len"]) == (0.85, True, 2048)
    assert (args["kv_cache_dtype"], args["enable_chunked_prefill"]) == ("fp8", True)
    assert "num_gpu_blocks_override" not in args
    pinned = ReplicaSettings(engine="vllm", checkpoint=model_dir, block_size=32, num_blocks=100).vllm_engine_config()
    args = pinned.engine_args("cuda", *EP)
    assert (args["num_gpu_blocks_override"], args["max_model_len"]) == (101, 3200)  # the pinned pool caps the context
    monkeypatch.setenv("UNICACHE_VLLM_ARGS", '{"swap_space": 8}')
    assert settings_from_args(parse([])).vllm_args == '{"swap_space": 8}'


def test_the_ray_actor_asks_for_the_replicas_tensor_parallel_gpus():
    from unicache.replica.actor import actor_options

    assert (actor_options("r0", True, num_gpus=4)["num_gpus"], actor_options("r0", True)["num_gpus"]) == (4, 1)
    assert actor_options("r0", False, num_gpus=4)["num_gpus"] == 0


def test_a_bad_vllm_arg_is_refused_in_one_line(model_dir):
    from unicache.plumbing.errors import UsageError

    bad = ReplicaSettings(engine="vllm", checkpoint=model_dir, block_size=32, vllm_args='{"no_such_arg": 1}')
    bad.check()  # a key is checked against vLLM's EngineArgs when the engine starts
    with pytest.raises(ValueError, match=r"^vllm_args: 'no_such_arg' is not a vLLM engine argument") as err:
        bad.vllm_engine_config().engine_args("cuda", *EP)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=r"^vllm_args: 'no_such_arg' is not a vLLM engine argument"):
        asyncio.run(VLLMEngine(bad.vllm_engine_config()).start())  # at start, before any process
    for text, message in (('{"block_size": 64}', "vllm_args: 'block_size' is set by UniCache; use the block_size setting"),
                          ('{"scheduler_cls": "x"}', "vllm_args: 'scheduler_cls' is set by UniCache and cannot be changed"),
                          ("[1]", "vllm_args must be a JSON object of vLLM engine arguments, got list"),
                          ("{nope", "vllm_args must be a JSON object")):
        with pytest.raises(UsageError, match=re.escape(message)):
            ReplicaSettings(engine="vllm", checkpoint=model_dir, block_size=32, vllm_args=text).check()
    with pytest.raises(UsageError, match="tensor_parallel_size and vllm_args need the vllm engine"):
        ReplicaSettings(tensor_parallel_size=2).check()


def test_unicache_up_passes_the_vllm_gpu_settings_to_its_replicas(model_dir):
    from unicache.cli.local_cluster import replica_settings

    cfg = ClusterSettings(engine="vllm", checkpoint=model_dir, block_size=32, tensor_parallel_size=2, gpu_memory_utilization=0.8,
                          enforce_eager=True, max_model_len=1024, vllm_args='{"kv_cache_dtype": "fp8"}')
    s = replica_settings(cfg, "redis://127.0.0.1:1/0")
    assert (s.tensor_parallel_size, s.gpu_memory_utilization, s.enforce_eager, s.max_model_len, s.num_blocks) == (2, 0.8, True, 1024, 0)
    args = s.vllm_engine_config().engine_args("cuda", *EP)
    assert (args["tensor_parallel_size"], args["gpu_memory_utilization"], args["kv_cache_dtype"], args["max_model_len"]) == (2, 0.8, "fp8", 1024)
    assert replica_settings(ClusterSettings(), "").num_blocks == 2048  # the built-in engine keeps its default
