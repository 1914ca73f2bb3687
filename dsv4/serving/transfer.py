"""KV transfer between replicas over Mooncake's transfer engine (TCP here; RDMA where the NICs exist).

Each replica owns one `TransferEndpoint`: a transfer engine with a registered receive buffer cut into fixed slots
(the router hands out slots of a decode replica; at most one transfer per slot) and a staging area it sends
from. Metadata goes peer to peer (`P2PHANDSHAKE`, no metadata server). A transfer writes one blob (the request's
records back to back) into the receiver's slot with one synchronous write; the list of record lengths travels with
the control message. There is no other data path: an endpoint that cannot start, a write that fails or a
transfer engine that is stopped is a `TransferError`, and the caller falls back (counted), never silently."""

from __future__ import annotations

import os


class TransferError(RuntimeError):
  pass


class TransferEndpoint:

  def __init__(self, slots: int, slot_bytes: int, host: str = "127.0.0.1", protocol: str = "tcp"):
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", host)
    try:
      from mooncake.engine import TransferEngine  # local: the optional Mooncake transfer engine
    except ImportError as e:
      raise TransferError(f"the Mooncake transfer engine is not installed: pip install "
                          f"mooncake-transfer-engine-non-cuda ({e})") from e
    self.te = TransferEngine()
    rc = self.te.initialize(host, "P2PHANDSHAKE", protocol, "")
    if rc != 0:
      raise TransferError(f"Mooncake transfer engine: initialize({host}, {protocol}) failed (rc={rc})")
    self.slots, self.slot_bytes = slots, slot_bytes
    self.recv_base = self.te.allocate_managed_buffer(slots * slot_bytes)
    self.send_base = self.te.allocate_managed_buffer(slot_bytes)
    if not self.recv_base or not self.send_base:
      raise TransferError(f"Mooncake transfer engine: cannot register {slots} x {slot_bytes} bytes")
    self.endpoint = f"{host}:{self.te.get_rpc_port()}"
    self.protocol = protocol
    self.stats = {"sent": 0, "sent_bytes": 0, "received": 0, "received_bytes": 0, "send_failures": 0}

  def slot_address(self, slot: int) -> int:
    if not 0 <= slot < self.slots:
      raise TransferError(f"slot {slot} out of range [0, {self.slots})")
    return self.recv_base + slot * self.slot_bytes

  def send(self, endpoint: str, remote_address: int, blob: bytes) -> None:
    if self.te is None:
      raise TransferError("the transfer engine is stopped")
    if len(blob) > self.slot_bytes:
      raise TransferError(f"state of {len(blob)} bytes does not fit a {self.slot_bytes}-byte slot")
    self.te.write_bytes_to_buffer(self.send_base, blob, len(blob))
    rc = self.te.transfer_sync_write(endpoint, self.send_base, remote_address, len(blob))
    if rc != 0:
      self.stats["send_failures"] += 1
      raise TransferError(f"Mooncake write of {len(blob)} bytes to {endpoint} failed (rc={rc})")
    self.stats["sent"] += 1
    self.stats["sent_bytes"] += len(blob)

  def receive(self, slot: int, nbytes: int) -> bytes:
    if nbytes > self.slot_bytes:
      raise TransferError(f"{nbytes} bytes announced for a {self.slot_bytes}-byte slot")
    data = bytes(self.te.read_bytes_from_buffer(self.slot_address(slot), nbytes))
    self.stats["received"] += 1
    self.stats["received_bytes"] += nbytes
    return data

  def stop(self) -> None:
    """The backend goes down: every later send fails (fault tests)."""
    self.te = None
