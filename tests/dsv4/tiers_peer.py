"""Engine 2 of the two-process test: a fresh process and engine that resumes a conversation from the shared Redis
store. argv: model (v4|v41), redis url, JSON file with {"prompt": [...], "max_tokens": n}. Prints one JSON line."""

import dataclasses
import json
import sys

import jax

from dsv4 import config, model
from dsv4.engine.api import generate
from dsv4.engine.engine import Engine
from dsv4.engine.sampling import SamplingParams
from dsv4.engine.tiering_config import TieringConfig
from tests.dsv4.test_tiers_reload import EC


def main():
  name, url, path = sys.argv[1:4]
  cfg = config.v4_tiny() if name == "v4" else config.v41_tiny()
  params = model.init_params(cfg, jax.random.PRNGKey(0))
  job = json.load(open(path))
  eng = Engine(params, cfg, dataclasses.replace(EC, tiering=TieringConfig(tiers=("redis",), store_url=url,
                                                                          policy="load", engine_id="engine2")))
  (o,) = generate(params, cfg, [job["prompt"]], SamplingParams(max_tokens=job["max_tokens"], ignore_eos=True),
                  engine=eng)
  t = eng.tiering.store.tiers[0]
  print(json.dumps({"output": o.output, "hit": o.hit_tokens, "redis_hit_records": t.metrics["hit_records"],
                    "redis_hit_tokens": t.metrics["hit_tokens"],
                    "logits": [x.tolist() for x in o.token_logits]}))
  eng.tiering.close()


if __name__ == "__main__":
  main()
