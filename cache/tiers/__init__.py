"""KV tiers below the device: records, backends (host, disk, Redis, Mooncake), a directory kept in the shared
store, a cost model, a bounded write-behind queue. Plain bytes and numpy only: nothing here imports `dsv4`.
See docs/tiers.md, and BUILD_NOTES.md, KV tiers for measurements."""
