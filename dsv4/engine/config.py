"""EngineConfig: everything one engine is configured with, frozen and validated in one place.

The runner, the scheduler and the main job (`experiments/serve.py`, whose flags are built from these fields) all take
this one object whole. Each field carries its help text (and, for a closed set of values, its choices) as field
metadata: the flags of a script are built from it (experiments/dataclass_flags.py), so they cannot drift from it.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from dsv4 import caches
from pallas_kernels import dispatch


# XLA's command buffer command types (DebugOptions.CommandBufferCmdType, by name).
COMMAND_BUFFER_TYPES = ("FUSION", "CUBLAS", "CUBLASLT", "CUSTOM_CALL", "CUDNN", "COLLECTIVES", "CONDITIONAL", "WHILE",
                        "DYNAMIC_SLICE_FUSION", "DYNAMIC_SLICE_COPY_FUSION")


def flag_field(default, help_text: str, choices: tuple | None = None):
  """A dataclass field whose metadata carries its flag's help text and choices (read by
  experiments/dataclass_flags.py); EngineConfig's and ServeOptions' fields are all made by it."""
  meta = {"help": help_text} if choices is None else {"help": help_text, "choices": choices}
  return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  max_num_seqs: int = flag_field(8, "Rows per step.")
  max_num_batched_tokens: int = flag_field(512, "Token budget per step.")
  chunk_size: int = flag_field(64, "Longest prefill chunk per request per step.")
  max_model_len: int = flag_field(2048, "Longest request (prompt + output).")
  num_full_blocks: int = flag_field(256, "Full-history blocks (128 tokens each).")
  num_swa_blocks: int = flag_field(512, "SWA blocks (32 tokens each).")
  enable_prefix_caching: bool = flag_field(True, "Reuse cached prefixes.")
  retention_interval: int = flag_field(0, "Keep an SWA checkpoint every N tokens inside a request (0 = only at prompt "
                                       "boundaries and request ends); must be a multiple of 128 (the full-attention "
                                       "block).")
  model_id: str = flag_field("dsv4", "The model's name in the KV cache keys (a tier never loads another model's KV).")
  record_logits: bool = flag_field(False, "Keep each sampled position's logits (tests, analysis).")
  layout: caches.CacheLayout = flag_field(caches.CacheLayout(), "KV pool layout and storage dtype "
                                          "(caches.CacheLayout).")
  kernel: dispatch.KernelConfig = flag_field(dispatch.KernelConfig(), "Attention kernel dispatch.")
  # Compute dtype of params / activations: "fp32" (bit for bit today's) or "bf16" (fp32 norms, softmaxes, logits;
  # model.cast_params). The KV pools' dtype is layout.kv_dtype (fp32, bf16 or caches.FP8).
  dtype: str = flag_field("fp32", "Compute dtype of params / activations (bf16 keeps fp32 norms, softmaxes and "
                          "logits).", ("fp32", "bf16"))
  tiering: object = flag_field(None, "KV tiers below the device (dsv4.engine.tiering.TieringConfig; None = off).")
  # "functional" (dsv4.model, the default) or "nnx" (the Flax modules of dsv4.nnx_model, on one device)
  model_api: str = flag_field("functional", "Run the model step through dsv4.model's functions (default) or through "
                              "the Flax NNX modules of dsv4.nnx_model (one device, same math).", ("functional", "nnx"))
  # In-batch shared-prefix deferral: a waiting request that shares at least one resume boundary of prefix with a
  # running request that has not yet computed that part waits until the leader commits past the boundary, then hits
  # it instead of computing the same KV alongside it (a cold wave of siblings sharing a system prompt). False =
  # admit in arrival order regardless (the behaviour before).
  defer_shared_prefix: bool = flag_field(True, "A waiting request whose prefix a running one is still computing waits "
                                         "for it and hits it, instead of computing the same KV alongside it.")
  # Async scheduling: step N+1 is planned and sent before step N's tokens are read; N's sampled tokens feed N+1 on
  # the device, stop conditions are seen one step late (a request that stopped may run one more step, whose
  # token is dropped). Same tokens as the synchronous engine. It applies on one device without tiers; there (a
  # mesh: the managers' own calls; tiers: they read block ids) each step is read before the next is planned
  # (`Engine.async_active` says which).
  async_scheduling: bool = flag_field(True, "Plan and send step N+1 before reading step N's tokens (same tokens; "
                                      "applies on one device without tiers).")
  # XLA CPU only: LLVM's optimisation level for the step program. On the CPU a short job's time is mostly compile:
  # a lower level compiles the step program faster and runs it slower (BUILD_NOTES.md, Compile time). A level set in
  # XLA_FLAGS wins. GPU and other backends: XLA's defaults.
  cpu_step_opt_level: int = flag_field(-1, "XLA CPU: LLVM optimisation level of the step program (0-3; -1 = XLA's "
                                       "default; XLA_FLAGS' level wins): lower compiles faster, runs slower. Other "
                                       "backends ignore it.")
  # XLA GPU only: the command types the step program's CUDA graphs take (`xla_gpu_enable_command_buffer`). By
  # default XLA's runtime runs each row-block loop's `while` from the host: a copy of its condition and a wait for
  # the stream per trip test (BUILD_NOTES.md, Engine, Open); with WHILE and CONDITIONAL the loops run inside the graph.
  # The GPU suite's `d.engine.cmdbuf` row measures the step both ways.
  gpu_step_command_buffers: str = flag_field("", "XLA GPU: command types of the step program's CUDA graphs, comma "
                                             "separated (e.g. FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,"
                                             "CONDITIONAL; '' = XLA's default). Other backends ignore it.")
  # Speculative decoding with the model's drafter (ModelConfig.num_mtp_layers >= 1: V4's MTP block, V4.1's DSpark
  # stages, k <= dspark.block_size): each decode row carries the k drafts proposed last step; one step verifies
  # them (greedy: the tokens without drafts; sampled: rejection sampling, the same distribution), keeps the accepted
  # prefix plus one decided token, and drafts k more. 0 = off. With async scheduling the next step is planned before
  # this one is read: its row is filled on the device from this step's results and shifted by the number of drafts
  # accepted. One device and the functional model (refused at construction otherwise).
  num_speculative_tokens: int = flag_field(0, "Speculative decoding: drafts per step from the model's drafter (V4 MTP "
                                           "block, V4.1 DSpark; 0 = off, up to 8; e.g. the v4_motif_mtp model). "
                                           "Greedy answers are unchanged; sampled ones keep their distribution.")

  def validate(self):
    for name in ("max_num_seqs", "max_num_batched_tokens", "chunk_size", "max_model_len", "num_full_blocks",
                 "num_swa_blocks"):
      v = getattr(self, name)
      if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
        raise ValueError(f"EngineConfig.{name}: an integer >= 1, got {v!r}")
    if not isinstance(self.retention_interval, (int, np.integer)) or self.retention_interval < 0:
      raise ValueError(f"EngineConfig.retention_interval: an integer >= 0 (0 = off), got {self.retention_interval!r}")
    for f in dataclasses.fields(self):      # dtype, model_api: a closed set each
      choices = f.metadata.get("choices")
      if choices is not None and getattr(self, f.name) not in choices:
        raise ValueError(f"EngineConfig.{f.name}: {' or '.join(map(repr, choices))}, got {getattr(self, f.name)!r}")
    lvl = self.cpu_step_opt_level
    if not isinstance(lvl, (int, np.integer)) or isinstance(lvl, bool) or not -1 <= lvl <= 3:
      raise ValueError(f"EngineConfig.cpu_step_opt_level: an integer in -1..3 (-1 = XLA's default), got {lvl!r}")
    cmds = self.gpu_step_command_buffers
    bad = [c for c in str(cmds).split(",") if c not in COMMAND_BUFFER_TYPES] if cmds else []   # XLA: no spaces
    if not isinstance(cmds, str) or bad:
      raise ValueError(f"EngineConfig.gpu_step_command_buffers: comma-separated names from "
                       f"{', '.join(COMMAND_BUFFER_TYPES)} ('' = XLA's default), got {cmds!r}")
    if not isinstance(self.async_scheduling, bool):
      raise ValueError(f"EngineConfig.async_scheduling: True or False, got {self.async_scheduling!r}")
    k = self.num_speculative_tokens
    if not isinstance(k, (int, np.integer)) or isinstance(k, bool) or not 0 <= k <= 8:
      raise ValueError(f"EngineConfig.num_speculative_tokens: an integer in 0..8 (0 = off), got {k!r}")
    if k and min(self.chunk_size, self.max_num_batched_tokens) < 1 + k:
      raise ValueError(f"EngineConfig.num_speculative_tokens={k}: a decode row is 1 + k tokens; chunk_size and "
                       f"max_num_batched_tokens must be >= {1 + k}")
    if k:
      for name, bad in (("model_api='nnx'", self.model_api != "functional"),):
        if bad:
          raise ValueError(f"EngineConfig: num_speculative_tokens > 0 with {name} is not supported (the speculative "
                           f"step is the functional model's, one verified row per request)")
    try:                                # the backend's name only: whether a GPU is here is the engine's check
      dispatch.check_backend(self.kernel, on_device=False)
    except ValueError as e:
      raise ValueError(f"EngineConfig.kernel: {e}") from None
    if self.tiering is not None:
      self.tiering.validate()           # before anything is built: a bad tier setting fails at once
