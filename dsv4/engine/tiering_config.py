"""TieringConfig: the KV tiers below the device (host, disk, Redis, Mooncake) one engine uses, frozen and validated
in one place (`EngineConfig.tiering`; the serve flags --kv_tiers, --kv_disk_dir, --kv_store_url build it). The glue
that runs them is `dsv4.engine.tiering.Tiering`."""

from __future__ import annotations

import dataclasses

from cache.tiers.backends import check_tier_places

POLICIES = ("auto", "load", "recompute")
DEMOTES = ("evict", "store")
_FIELDS = {"tiers": "TieringConfig.tiers", "disk_dir": "TieringConfig.disk_dir", "store_url": "TieringConfig.store_url"}
_FLAGS = {"tiers": "--kv_tiers", "disk_dir": "--kv_disk_dir", "store_url": "--kv_store_url"}


@dataclasses.dataclass(frozen=True)
class TieringConfig:
  tiers: tuple[str, ...] = ("host",)       # order = L2, L3, L4
  disk_dir: str = ""
  store_url: str = ""                      # redis://127.0.0.1:6379/0 or mooncake://master_host:port
  capacity_bytes: tuple[int, ...] = ()     # per tier (default 1 GiB each)
  ttl_s: float | None = None
  tenant_quota_bytes: int | None = None
  write_queue: int = 256                   # write-behind bound (records); 0 = synchronous writes
  policy: str = "auto"                     # auto (cost model) | load (always, for gates) | recompute (never)
  load_timeout_s: float = 5.0              # hard cap of a load's time budget
  tier_timeout_s: float = 1.0              # socket timeout of remote tiers
  retry_after_s: float = 2.0
  demote: str = "evict"                    # evict | store
  tokenizer_id: str = ""
  model_digest: str = ""                   # "" = computed from the params
  engine_id: str = "e0"
  key_bits: int = 128                      # < 128 only to force key collisions in tests
  prefill_tokens_per_s: float = 2000.0     # prior until steps are measured

  def validate(self):
    if isinstance(self.tiers, str):
      raise ValueError(f"TieringConfig.tiers: a tuple of tier names, got the string {self.tiers!r}")
    check_tier_places(self.tiers, self.disk_dir, self.store_url, _FIELDS)
    if self.policy not in POLICIES:
      raise ValueError(f"TieringConfig.policy: one of {', '.join(POLICIES)}, got {self.policy!r}")
    if self.demote not in DEMOTES:
      raise ValueError(f"TieringConfig.demote: one of {', '.join(DEMOTES)}, got {self.demote!r}")
    if len(self.capacity_bytes) > len(self.tiers) or any(c <= 0 for c in self.capacity_bytes):
      raise ValueError(f"TieringConfig.capacity_bytes: at most one positive size per tier ({len(self.tiers)}), got "
                       f"{self.capacity_bytes}")
    for name in ("ttl_s", "tenant_quota_bytes"):
      v = getattr(self, name)
      if v is not None and not v > 0:
        raise ValueError(f"TieringConfig.{name}: > 0 or None (off), got {v!r}")
    for name in ("load_timeout_s", "tier_timeout_s", "prefill_tokens_per_s"):
      if not getattr(self, name) > 0:
        raise ValueError(f"TieringConfig.{name}: > 0, got {getattr(self, name)!r}")
    if self.retry_after_s < 0 or self.write_queue < 0:
      name = "retry_after_s" if self.retry_after_s < 0 else "write_queue"
      raise ValueError(f"TieringConfig.{name}: >= 0, got {getattr(self, name)!r}")
    if not 0 <= self.key_bits <= 128:
      raise ValueError(f"TieringConfig.key_bits: in [0, 128], got {self.key_bits!r}")

  @staticmethod
  def from_flags(kv_tiers: str, disk_dir: str = "", store_url: str = "", **kw) -> "TieringConfig | None":
    """From the serve flags (--kv_tiers, --kv_disk_dir, --kv_store_url); None when no tier is asked for. A tier
    without its place (disk without a directory, redis / mooncake without a URL) is a ValueError naming the flag."""
    tiers = tuple(t.strip() for t in kv_tiers.split(",") if t.strip())
    if not tiers:
      return None
    check_tier_places(tiers, disk_dir, store_url, _FLAGS)
    return TieringConfig(tiers=tiers, disk_dir=disk_dir, store_url=store_url, **kw)
