"""Many engines behind one router: replicas (Ray actors that each own an engine), a prefix- and load-aware router
over a global prefix directory, prefill / decode disaggregation with whole-state transfer, and a discrete-event
model of the same policies at node scale (docs/cluster.md)."""
