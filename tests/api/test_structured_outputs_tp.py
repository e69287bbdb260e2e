"""Structured outputs on a tensor-parallel engine over real HTTP: every rank keeps its own
matcher and masks its own logits, and the ranks must sample the same tokens (a rank that
disagrees fails the engine, engine/rank_merge.py), so seeded sampled requests come back valid
and the engine serves on."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai

from actors.ports import free_port
from engine.config import Config
from tests.api.conftest import deployed
from tests.api.test_structured_outputs import MODEL_DIR, NAME, PROMPTS, SCHEMA, seeded_schema_request


def test_tensor_parallel_ranks_mask_alike(ray_cluster):
    cfg = Config(
        model=str(MODEL_DIR),
        served_model_name=NAME,
        device="cpu",
        num_kv_blocks=256,
        max_model_len=256,
        max_num_seqs=16,
        worker_threads=1,
        port=free_port(),
        tensor_parallel_size=2,
    )
    with deployed(cfg) as dep:
        client = openai.OpenAI(base_url=dep.url + "/v1", api_key="none", max_retries=0, timeout=60)
        with ThreadPoolExecutor(4) as pool:
            responses = list(pool.map(lambda seed: seeded_schema_request(client, seed), range(12)))
        for r in responses:
            assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
            jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
        plain = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=2, temperature=0.0)
        assert plain.choices[0].text == "02"  # and the engine serves on
