"""Assembling an engine from the config: the scheduler sized from the workers' cache layout,
and each worker's config. Torch-free, as the engine process is (docs/design.md §14); an engine
with its worker in this process is engine/local.py's."""

from __future__ import annotations

import logging
from pathlib import Path

from tokenizers import Tokenizer

from actors.process import rank_cpus
from engine.config import Config, ConfigError, Role
from engine.core import EngineCore, StepExecutor
from engine.scheduler import DisaggConfig, Scheduler, SchedulerConfig
from engine.stop import StopChecker
from kv.cache_layout import CacheLayout
from kv.kv_cache_manager import KVCacheManager
from models.config import ConfigError as ModelConfigError
from models.config import ModelConfig
from models.model_files import load_config, load_generation_config
from models.tp_shards import shard_config
from worker.config import WorkerConfig

log = logging.getLogger(__name__)


def worker_config(
    cfg: Config,
    role: Role = "colocated",
    engine_id: str = "",
    nixl_agent_name: str = "",
    tp_rank: int = 0,
    tp_init_method: str = "",
) -> WorkerConfig:
    """Rank `tp_rank`'s worker of an engine of `role`; the engine's KV memory is shared out
    among its ranks (each holds its share of the heads)."""
    tp = cfg.tp_size(role)
    cpus = cfg.role_cpus(role)
    return WorkerConfig(
        cfg.model,
        dtype=cfg.dtype,
        kv_cache_dtype=cfg.kv_cache_dtype,
        device=cfg.device,
        cpus=rank_cpus(cpus, tp_rank, tp) if cpus else (),
        cpu_kernels=cfg.cpu_kernels,
        cpu_vectors=cfg.cpu_vectors,
        block_size=cfg.block_size,
        num_kv_blocks=cfg.num_kv_blocks,
        kv_cache_memory=cfg.kv_cache_memory // tp,
        seed=cfg.seed,
        stream_delay_s=cfg.debug_stream_delay_ms / 1000,
        kv_role=role,
        engine_id=engine_id,
        nixl_agent_name=nixl_agent_name,
        kv_fail_fraction=cfg.debug_kv_fail_percent / 100 if role == "decode" else 0.0,
        kv_transfer_timeout_s=float(cfg.kv_transfer_timeout_s),
        kv_delay_s=cfg.debug_kv_delay_ms / 1000 if role == "decode" else 0.0,
        kv_verify=cfg.kv_verify,
        kv_verify_tp=cfg.tp_size("decode"),
        kv_corrupt_fraction=cfg.debug_kv_corrupt_percent / 100 if role == "decode" else 0.0,
        tp_rank=tp_rank,
        tp_size=tp,
        tp_init_method=tp_init_method,
    )


def check_tp(cfg: Config, role: Role) -> None:
    """Refuse a TP size the model's heads cannot be split over, before any worker starts."""
    tp = cfg.tp_size(role)
    flag = {"colocated": "tensor_parallel_size", "prefill": "prefill_tp", "decode": "decode_tp"}[role]
    try:
        shard_config(load_config(cfg.model), 0, tp)
    except ModelConfigError as e:
        raise ConfigError(f"invalid {flag} {tp} for {cfg.model}: {e}", flag) from None


def disagg_config(cfg: Config, role: Role, engine_id: str, agent_name: str = "") -> DisaggConfig | None:
    if role == "colocated":
        return None
    if cfg.debug_zero_loaded_blocks and role == "decode":
        log.warning(
            "DEBUG --debug-zero-loaded-blocks is ON in %s: blocks filled by remote KV loads are zeroed "
            "(the pre-fix behaviour); outputs can be wrong",
            engine_id,
        )
    return DisaggConfig(
        role,
        engine_id,
        float(cfg.kv_lease_s),
        cfg.debug_zero_loaded_blocks,
        cfg.kv_load_failure_policy,
        agent_name,
        cfg.tp_size(role),
    )


def make_scheduler(
    cfg: Config, model_cfg: ModelConfig, layout: CacheLayout, disagg: DisaggConfig | None = None
) -> Scheduler:
    max_len = cfg.max_model_len or model_cfg.max_position_embeddings
    kv = KVCacheManager(
        layout.groups,
        layout.num_blocks,
        layout.block_size,
        cfg.enable_prefix_caching,
        cfg.prefix_cache_checkpoint_interval,
        cfg.prefix_cache_checkpoint_pages,
    )
    tokenizer = Tokenizer.from_file(str(Path(cfg.model) / "tokenizer.json"))
    role = disagg.role if disagg is not None else "colocated"
    sched_cfg = SchedulerConfig(cfg.step_token_budget(role, layout.device), cfg.max_num_seqs, max_len)
    return Scheduler(sched_cfg, kv, StopChecker(tokenizer, max_len), disagg)


def make_engine(
    cfg: Config, layout: CacheLayout, executors: list[StepExecutor], disagg: DisaggConfig | None = None
) -> EngineCore:
    model_cfg = load_config(cfg.model)
    _, eos = load_generation_config(cfg.model, model_cfg)
    return EngineCore(
        make_scheduler(cfg, model_cfg, layout, disagg),
        executors,
        cfg.async_scheduling,
        eos,
        cfg.max_waiting,
        prefill_hold_s=cfg.prefill_hold_ms / 1000,
    )
